"""`SampleRun` on its own: its `start` waits for every sample's first delta without blocking the event loop."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvbaton.core.sampling import SamplingParams
from kvbaton.server.api_run import SampleRun
from kvbaton.server.protocol import ApiError
from kvbaton.server.base import DeltaSink, GenerateCall, TokenDelta
from kvbaton.server.metrics import ApiMetrics


def _first_delta(request_id: str) -> TokenDelta:
    return TokenDelta(request_id, (7,), "x", False, None, 1)


async def _start_with_first_deltas_apart() -> bool:
    """Two samples whose first deltas arrive in different loop iterations (different workers, or one worker's
    two steps): `start` must return once both came, yielding to the loop in between."""
    sinks: dict[str, DeltaSink] = {}
    calls = [GenerateCall(f"r-{i}", (1, 2, 3), SamplingParams(max_tokens=4), 0.0) for i in range(2)]
    run = SampleRun(cluster=None, calls=calls, metrics=ApiMetrics(), clock=lambda: 0.0,  # type: ignore[arg-type]
                    background=set(), submit=lambda call, sink: sinks.__setitem__(call.request_id, sink))
    starting = asyncio.create_task(run.start())
    await asyncio.sleep(0)  # start() submitted both and waits
    sinks["r-0"](_first_delta("r-0"))
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, lambda: sinks["r-1"](_first_delta("r-1")))  # runs only if start() yields to the loop
    await asyncio.wait_for(starting, timeout=5.0)
    return True


def test_start_yields_to_the_loop_between_first_deltas() -> None:
    # A thread of its own: a start() that spins without yielding would hold its loop (and the test) forever.
    outcome: list[object] = []
    thread = threading.Thread(target=lambda: outcome.append(asyncio.run(_start_with_first_deltas_apart())),
                              daemon=True)
    thread.start()
    thread.join(10.0)
    assert not thread.is_alive(), "SampleRun.start spun without yielding while a sample's first delta was pending"
    assert outcome == [True]


def test_a_call_rejected_before_its_first_token_is_refused_with_429() -> None:
    """The cluster's decode-stage gate ends a call it took with a "rejected" delta: the API answers as for a
    refusal at arrival (429 with Retry-After), and the other sample is aborted."""
    sinks: dict[str, DeltaSink] = {}
    aborted: list[str] = []

    class Cluster:
        async def abort(self, request_id: str) -> None:
            aborted.append(request_id)

    calls = [GenerateCall(f"r-{i}", (1, 2, 3), SamplingParams(max_tokens=4), 0.0) for i in range(2)]
    run = SampleRun(cluster=Cluster(), calls=calls, metrics=ApiMetrics(), clock=lambda: 0.0,  # type: ignore[arg-type]
                    background=set(), submit=lambda call, sink: sinks.__setitem__(call.request_id, sink))

    async def main() -> None:
        starting = asyncio.create_task(run.start())
        await asyncio.sleep(0)
        sinks["r-0"](_first_delta("r-0"))
        sinks["r-1"](TokenDelta("r-1", (), "", True, "rejected", 3, error="decode over capacity; retry later",
                                extra={"retry_after_s": 2.0}))
        with pytest.raises(ApiError) as refused:
            await asyncio.wait_for(starting, timeout=5.0)
        assert refused.value.status_code == 429 and "decode over capacity" in str(refused.value)
        assert refused.value.headers == {"Retry-After": "2"}
        assert aborted == ["r-0"]  # the rejected one ended at the cluster already

    asyncio.run(main())
