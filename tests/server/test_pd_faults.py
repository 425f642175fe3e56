"""Must-show 4: handoff faults injected through live prefill/decode workers, each ending in bounded time with a
clean error or a correct recompute, and with zero blocks held on either worker afterwards.

Faults are scripted with the transport's injection hooks (`WorkerConfig.transfer_faults`) and short
leases; "killed mid-transfer" kills a real prefill worker process with SIGKILL while its KV streams.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from kvbaton.core.cluster_secret import SECRET_ENV
from kvbaton.model.registry import LoadedModel, load_model
from kvbaton.server.base import GenerateCall
from kvbaton.server.cluster import ClusterManager
from kvbaton.transfer.base import LayoutRejectedError
from kvbaton.transfer.faults import FaultAction, FaultRule
from kvbaton.transfer.messages import LayerChunk, ReserveRefused, ReserveRequest, SourceDone, TransferId
from kvbaton.transfer.states import DestinationState, SourceState
from kvbaton.transfer.transport_shm import ShmKVSender
from kvbaton.engine.handoff import kv_layout_for, transfer_id_of
from kvbaton.server.worker_kv import parse_kv_address
from tests.server.pd_helpers import BLOCK_SIZE, colocated, collect, greedy, run_pd, start, tokens_of, wait_clean
from tests.server.test_worker_cluster import SECRET, WorkerThread

PD = {"p0": "prefill", "d0": "decode"}
PROMPT = list(range(3, 83))  # 80 tokens: 5 blocks, two prefill chunks at a 64-token budget


def tokens(num_tokens: int, offset: int = 0) -> list[int]:
    """A prompt of any length inside tiny-random's 384-token vocabulary; offsets give unrelated prompts."""
    return [(i * 7 + offset) % 380 + 3 for i in range(num_tokens)]
LEASE_S = 1.0


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random")


def faulty(*rules: FaultRule) -> dict[str, dict[str, object]]:
    return {"p0": {"transfer_faults": tuple(rules), "kv_lease_s": LEASE_S}, "d0": {"kv_lease_s": LEASE_S}}


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_dropped_layer_message_expires_then_recomputes_or_fails(tiny: LoadedModel, policy: str) -> None:
    async def body(cluster: ClusterManager, workers: dict[str, WorkerThread]) -> None:
        started = time.monotonic()
        deltas = await collect(cluster, GenerateCall("r-0", tuple(PROMPT), greedy(8), 0.0))
        assert time.monotonic() - started < LEASE_S + 3.0
        if policy == "recompute":
            assert tokens_of(deltas) == colocated(tiny, PROMPT, greedy(8))
            assert cluster.workers["d0"].stats is not None
        else:
            assert deltas[-1].finish_reason == "error" and "KV transfer failed" in deltas[-1].error
        await wait_clean(cluster, ["p0", "d0"])
        assert cluster.workers["d0"].stats.num_transfer_recomputes == (policy == "recompute")
        assert cluster.workers["p0"].stats.num_transfers_failed == 1

    run_pd(tiny, PD, body, faulty(FaultRule(FaultAction.DROP, LayerChunk, layer_index=1)),
           kv_load_failure_policy=policy)


def test_transfer_delayed_past_its_lease_recomputes_and_the_late_message_is_ignored(tiny: LoadedModel) -> None:
    async def body(cluster: ClusterManager, workers: dict[str, WorkerThread]) -> None:
        deltas = await collect(cluster, GenerateCall("r-0", tuple(PROMPT), greedy(8), 0.0))
        assert tokens_of(deltas) == colocated(tiny, PROMPT, greedy(8))
        await asyncio.sleep(LEASE_S * 2)  # the delayed SourceDone arrives now, after the expiry
        await wait_clean(cluster, ["p0", "d0"])
        decode = workers["d0"].worker.decode
        assert decode is not None and decode.destination.num_ignored_messages >= 1
        # Whichever lease ran out first (the decode reservation, or the prefill leg awaiting its ack, which
        # then fails the decode leg through the router): the KV never counted, and the prompt was recomputed.
        assert decode.destination.state(TransferId("r-0")) in (DestinationState.EXPIRED, DestinationState.FAILED)
        assert cluster.workers["d0"].stats.num_transfer_recomputes == 1

    run_pd(tiny, PD, body, faulty(FaultRule(FaultAction.DELAY, SourceDone, delay_s=LEASE_S * 2.5)))


def test_decode_refuses_the_reservation_and_runs_the_prompt_once_blocks_free(tiny: LoadedModel) -> None:
    occupant, refused = tokens(120), tokens(400, offset=1)  # 8 blocks (+19 while decoding), then 25

    async def body(cluster: ClusterManager, workers: dict[str, WorkerThread]) -> None:
        stream = cluster.generate(GenerateCall("a-0", tuple(occupant), greedy(300), 0.0))
        first = [await stream.__anext__()]
        b = await collect(cluster, GenerateCall("b-0", tuple(refused), greedy(4), 0.0))
        a = first + [d async for d in stream]
        assert tokens_of(a) == colocated(tiny, occupant, greedy(300))
        assert tokens_of(b) == colocated(tiny, refused, greedy(4))
        await wait_clean(cluster, ["p0", "d0"])
        assert cluster.cluster_info()["transfers"]["num_refusals_reported"] == 1
        assert cluster.workers["d0"].stats.num_transfer_refusals == 1
        assert cluster.workers["d0"].stats.num_transfer_recomputes == 1

    run_pd(tiny, PD, body, {"d0": {"num_blocks": 32}}, kv_load_failure_policy="fail")


async def until(predicate: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.002)


def _source_state(workers: dict[str, WorkerThread], request_id: str) -> SourceState | None:
    prefill = workers["p0"].worker.prefill
    try:
        return prefill.source.state(transfer_id_of(request_id)) if prefill is not None else None
    except Exception:  # noqa: BLE001 - not started yet
        return None


@pytest.mark.parametrize("stage", ["queued", "prefilling", "transferring", "decoding"])
def test_cancellation_in_each_state_frees_both_workers(tiny: LoadedModel, stage: str) -> None:
    rules = {"queued": (FaultRule(FaultAction.DELAY, ReserveRequest, delay_s=100.0),),
             "transferring": (FaultRule(FaultAction.DELAY, SourceDone, delay_s=100.0),)}.get(stage, ())
    long_prompt = tokens(400)

    async def body(cluster: ClusterManager, workers: dict[str, WorkerThread]) -> None:
        if stage == "prefilling":  # slow the prefill worker's steps so the cancel lands between chunks
            engine = workers["p0"].worker.engine
            execute = engine.runner.execute
            engine.runner.execute = lambda plan, *hook: (time.sleep(0.05), execute(plan, *hook))[1]
        stream = cluster.generate(GenerateCall("c-0", tuple(long_prompt), greedy(500), 0.0))
        consumer = asyncio.ensure_future(stream.__anext__())
        decode = workers["d0"].worker.decode
        if stage == "queued":
            await until(lambda: _source_state(workers, "c-0") is SourceState.RESERVING)
        elif stage == "prefilling":
            prefill = workers["p0"].worker.prefill
            await until(lambda: prefill.owns("c-0") and 0 < prefill._legs["c-0"].num_streamed_tokens < 400)
        elif stage == "transferring":
            await until(lambda: _source_state(workers, "c-0") is SourceState.AWAITING_ACK)
            assert decode.destination.state(TransferId("c-0")) is DestinationState.RECEIVING
        else:
            await consumer
        await cluster.abort("c-0")
        rest = [await consumer]
        if not rest[-1].finished:
            rest += [d async for d in stream]
        assert rest[-1].finished and rest[-1].finish_reason == "abort"
        await wait_clean(cluster, ["p0", "d0"])
        assert _source_state(workers, "c-0") in (SourceState.CANCELLED, SourceState.DONE)

    run_pd(tiny, PD, body, {"p0": {"transfer_faults": rules, "max_num_batched_tokens": 32}})


def test_mismatched_layout_is_refused_at_registration_and_per_handoff(tiny: LoadedModel) -> None:
    async def body(cluster: ClusterManager, workers: dict[str, WorkerThread]) -> None:
        bad = start(tiny, cluster.address, "d1", "decode", block_size=BLOCK_SIZE * 2)  # another KV layout
        await asyncio.to_thread(bad.thread.join, 10.0)
        assert "router refused worker d1: KV layout" in str(bad.error) and "d1" not in cluster.workers
        layout = kv_layout_for(tiny, BLOCK_SIZE)
        _, address = parse_kv_address(cluster.workers["d0"].register.kv_address)
        other = replace(layout, model_revision="other-revision")
        with pytest.raises(LayoutRejectedError, match="model_revision"):
            ShmKVSender("intruder", other, secret=SECRET).connect(address)  # refused at link registration
        sender = ShmKVSender("p-test", layout, secret=SECRET)
        try:
            peer = sender.connect(address)
            sender.send(peer, ReserveRequest(TransferId("x"), other, 32))  # a handoff announcing another layout
            replies: list[object] = []
            await until(lambda: bool(replies.extend(e.message for e in sender.poll(0.0)) or replies))
            assert isinstance(replies[0], ReserveRefused) and "KV layout mismatch" in replies[0].reason
        finally:
            sender.close()
        await until(lambda: cluster.workers["d0"].stats.num_transfer_refusals == 1)  # the next heartbeat says so
        await wait_clean(cluster, ["p0", "d0"])
        ok = await collect(cluster, GenerateCall("ok-0", tuple(PROMPT), greedy(4), 0.0))
        assert tokens_of(ok) == colocated(tiny, PROMPT, greedy(4))

    run_pd(tiny, PD, body)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_prefill_worker_process_killed_mid_transfer(tiny: LoadedModel, policy: str) -> None:
    prompt = tokens(1200)  # 1200 tokens at 16 per step: the transfer spans ~75 prefill steps

    async def body(cluster: ClusterManager, workers: dict[str, WorkerThread]) -> None:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvbaton.cli", "worker", "--role", "prefill", "--router", cluster.address,
             "--model", "tiny-random", "--worker-id", "p9", "--block-size", str(BLOCK_SIZE), "--num-blocks", "128",
             "--max-num-batched-tokens", "16", "--threads", "1"], start_new_session=True,
            env={**os.environ, SECRET_ENV: SECRET.to_hex()})
        cluster.watch_process("p9", process)
        try:
            await until(lambda: "p9" in cluster.workers and cluster.workers["p9"].stats is not None, 60.0)
            consumer = asyncio.ensure_future(collect(cluster, GenerateCall("k-0", tuple(prompt), greedy(6), 0.0)))
            decode = workers["d0"].worker.decode
            await until(lambda: decode.owns("k-0") and decode._state("k-0") is DestinationState.RECEIVING, 30.0)
            os.kill(process.pid, signal.SIGKILL)
            started = time.monotonic()
            deltas = await consumer
            assert time.monotonic() - started < 5.0
        finally:
            if process.poll() is None:
                process.kill()
            process.wait(10.0)
        if policy == "recompute":
            assert tokens_of(deltas) == colocated(tiny, prompt, greedy(6))
        else:
            assert deltas[-1].finish_reason == "error" and "KV transfer failed" in deltas[-1].error
        await wait_clean(cluster, ["d0"])
        await until(lambda: "p9" in cluster.lost_workers)  # d0 may have seen the link drop before the router
        assert cluster.lost_workers["p9"].startswith("process")

    run_pd(tiny, {"d0": "decode"}, body, {"d0": {"num_blocks": 256}}, timeout_s=90.0, kv_load_failure_policy=policy)
