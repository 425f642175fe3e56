"""Regressions found by a bug hunt in the live cluster's failure and lifecycle paths (router bookkeeping when
workers vanish, worker liveness, stopping); each test names the bug it guards, which it showed on the code it was
written against."""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import replace

import httpx
import pytest

from kvbaton.model.registry import LoadedModel, load_model
from kvbaton.server import rpc
from kvbaton.server.base import GenerateCall, RejectedError, TokenDelta
from kvbaton.server.cluster import ClusterConfig, ClusterManager
from tests.server.pd_helpers import collect, colocated, greedy, run_pd, tokens_of, wait_clean
from tests.server.serve_helpers import serve_process
from tests.server.test_cluster_manager import call, register
from tests.server.test_worker_cluster import WorkerThread

pytestmark = pytest.mark.timeout(240)

# Long enough that waiting for it shows: 64 samples of 2000 tokens take tiny-random about 30 s on 2 cores (16: 7 s).
LONG_STREAM_TOKENS = 2000
LONG_STREAM_PROMPTS = ["drain me", "and me", "me too", "me as well"]  # x n=16: 64 samples


class _Socket:
    """The router socket as `ClusterManager` uses it: records sends; a worker in `gone` is unreachable."""

    def __init__(self) -> None:
        self.gone: set[str] = set()
        self.sent: list[tuple[str, rpc.Message]] = []

    def send(self, worker_id: str, message: rpc.Message) -> OSError | None:
        if worker_id in self.gone:
            return OSError(113, "Host unreachable")
        self.sent.append((worker_id, message))
        return None


class _Process:
    def __init__(self, code: int | None = None) -> None:
        self.code = code

    def poll(self) -> int | None:
        return self.code


def cluster_of(roles: dict[str, str], **config: object) -> tuple[ClusterManager, _Socket]:
    """A router (not started: its socket is a `_Socket`) whose workers `roles` names have registered and beat."""
    cluster = ClusterManager(ClusterConfig(model_name="tiny-random", block_size=4, **config),  # type: ignore[arg-type]
                             clock=lambda: 0.0)
    socket = _Socket()
    cluster.pool.socket = socket  # type: ignore[assignment]
    for worker_id, role in roles.items():
        cluster.pool.handle(worker_id, replace(register(worker_id, role=role),
                                           kv_address="shm://127.0.0.1:1" if role == "decode" else ""))
        cluster.pool.handle(worker_id, rpc.Stats(worker_id, 0, 0, 0, 0, 64, 0, 0, 0, 0, 0, 0.0))
    return cluster, socket


# Was a bug: a consumer leaving a stream (`generate`'s finally: the HTTP client went away) sends the worker an abort
# and then ends the call; when that abort found the worker unreachable, the worker left the pool and its removal
# ended the call already (an error delta to the queue nobody reads), and the finally ended it a second time:
# _num_waiting dropped twice for one call (-1 at idle), so the 429 limit (max_num_waiting) let one more call in per
# such loss from then on and /metrics showed a negative queue. Fixed: a call ends once (_end_call is idempotent).
def test_a_consumer_leaving_while_its_worker_is_unreachable_ends_the_call_once() -> None:
    async def main() -> None:
        cluster, socket = cluster_of({"w0": "mixed", "w1": "mixed"}, policy="round_robin", max_num_waiting=2)
        stream = cluster.generate(call("r0"))
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)  # routed: waiting for its first delta
        worker_id = cluster._calls["r0"].worker_id
        assert cluster.num_waiting == 1 and cluster.workers[worker_id].in_flight == {"r0"}
        socket.gone.add(worker_id)
        first.cancel()  # the consumer goes away
        await asyncio.gather(first, return_exceptions=True)
        assert worker_id in cluster.lost_workers and cluster.num_failed_by_worker_loss == 1
        assert cluster.num_waiting == 0 and cluster.num_in_flight == 0
        assert cluster.state.load.assignment("r0") is None
        # The queue limit still counts exactly: two waiting calls fill it, a third is refused.
        streams = [cluster.generate(call(f"r{i}")) for i in (1, 2)]
        pending = [asyncio.ensure_future(s.__anext__()) for s in streams]
        await asyncio.sleep(0)
        assert cluster.num_waiting == 2
        with pytest.raises(RejectedError, match="too many queued requests"):
            await cluster.generate(call("r3")).__anext__()
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        assert cluster.num_waiting == 0 and cluster.num_in_flight == 0

    asyncio.run(main())


# Was a bug: losing a prefill worker relayed "prefill worker lost" (HandoffFailed) to the decode worker for every call
# the prefill worker had ever handed off and that was still running, including calls whose KV had long been adopted
# and that were streaming tokens: each counted as a handoff fallback (/cluster transfers.num_fallbacks, /metrics), so
# a prefill worker that left (Goodbye at shutdown, or a crash) after a busy period reported as many fallbacks as
# calls were decoding, though no handoff had fallen back (so did a leg that expired awaiting a late ack after the
# decode worker adopted its KV). Fixed: a call with a first token has settled its handoff; neither is relayed.
def test_losing_a_prefill_worker_after_the_first_token_is_no_handoff_fallback() -> None:
    cluster, socket = cluster_of({"p0": "prefill", "d0": "decode"}, local_prefill_threshold_tokens=0)
    deltas: dict[str, list[TokenDelta]] = {"r0": [], "r1": []}
    for request_id in deltas:
        cluster.submit(call(request_id, tuple(range(1, 40))), deltas[request_id].append)
    assert cluster._calls["r0"].prefill_worker == "p0" and cluster._calls["r1"].prefill_worker == "p0"
    cluster.pool.handle("d0", rpc.TokenDeltas("d0", (TokenDelta("r0", (5,), "x", False, None, 39, worker_id="d0"),)))
    socket.sent.clear()
    # r0's leg expired awaiting an ack the decode worker sent late: its KV was adopted, nothing falls back.
    cluster.pool.handle("p0", rpc.HandoffEnded("p0", "r0", "d0", "expired", "no ack within the lease"))
    assert socket.sent == [] and cluster.num_handoff_fallbacks == 0 and cluster.handoff_endings == {"expired": 1}
    cluster.pool.handle("p0", rpc.Goodbye("p0", "shutdown: test"))
    # r1 still waits for its KV: the decode worker falls back for it; r0 decodes on undisturbed.
    assert [(w, type(m).__name__, getattr(m, "request_id", "")) for w, m in socket.sent] == [
        ("d0", "HandoffFailed", "r1")]
    assert cluster.num_handoff_fallbacks == 1 and cluster.transfer_totals()["num_fallbacks"] == 1
    assert cluster.num_in_flight == 2 and cluster.num_waiting == 1
    cluster.pool.handle("d0", rpc.TokenDeltas("d0", (TokenDelta("r0", (6,), "y", True, "length", 39, worker_id="d0"),
                                                 TokenDelta("r1", (7,), "z", True, "length", 39, worker_id="d0"))))
    assert [d.finish_reason for d in deltas["r0"]] == [None, "length"] and deltas["r1"][-1].finish_reason == "length"
    assert cluster.num_in_flight == 0 and cluster.num_waiting == 0


# Was a bug: the monitor's sweep (check_workers) walked a snapshot of the worker ids and read each record with
# self.workers[worker_id]; when removing one dead worker removed another (a decode worker's lost pair call aborts its
# prefill leg, and that send finds the prefill worker gone too: both died together, e.g. killed as a group), the
# sweep hit the second id with a KeyError: the rest of the pool went unchecked and unpinged that round, and the
# monitor logged "worker check failed" with a traceback. Fixed: the sweep skips a worker that already left.
def test_one_worker_sweep_survives_a_removal_that_removes_another_worker() -> None:
    cluster, socket = cluster_of({"d0": "decode", "p0": "prefill", "w0": "mixed"}, local_prefill_threshold_tokens=0,
                                 ping_interval_s=0.0, migration_limit=0)  # the call fails rather than move to w0
    deltas: list[TokenDelta] = []
    cluster.submit(call("r0", tuple(range(1, 40))), deltas.append)
    assert (cluster._calls["r0"].worker_id, cluster._calls["r0"].prefill_worker) == ("d0", "p0")
    cluster.watch_process("d0", _Process(-9))
    cluster.watch_process("p0", _Process(-9))
    socket.gone.update({"d0", "p0"})
    socket.sent.clear()
    cluster.check_workers()
    assert sorted(cluster.workers) == ["w0"]
    assert cluster.lost_workers == {"d0": "process 4321 exited with code -9", "p0": "process 4321 exited with code -9"}
    assert [(w, type(m).__name__) for w, m in socket.sent] == [("w0", "Ping")]  # the sweep went on to w0
    assert [d.finish_reason for d in deltas] == ["error"] and cluster.num_in_flight == 0 and cluster.num_waiting == 0


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random")


# Was a bug: a worker judged the router silent (router_timeout_s) right after its engine step, from the last message it
# had read before the step; a mixed or decode worker reads nothing during a step, so one step longer than the timeout
# (a long prefill on a slow host, a process suspended for a while) made it abort everything it ran and exit, though
# the router had pinged it all along: the pings were waiting unread in its socket. Fixed: before judging, the worker
# reads what arrived.
def test_a_step_longer_than_the_router_timeout_does_not_stop_the_worker(tiny: LoadedModel) -> None:
    async def body(cluster: ClusterManager, workers: dict[str, WorkerThread]) -> None:
        engine = workers["w0"].worker.engine
        assert engine is not None
        step = engine.step
        num_slow = [1]

        def slow_step() -> list[TokenDelta]:
            if num_slow[0]:
                num_slow[0] -= 1
                time.sleep(1.0)  # twice the worker's router timeout, while the router pings every 0.1 s
            return step()

        engine.step = slow_step  # type: ignore[method-assign]
        prompt = list(range(3, 23))
        deltas = await collect(cluster, GenerateCall("r0", tuple(prompt), greedy(4), 0.0))
        assert deltas[-1].finish_reason == "length" and tokens_of(deltas) == colocated(tiny, prompt, greedy(4))
        assert num_slow == [0] and sorted(cluster.workers) == ["w0"] and cluster.lost_workers == {}
        await wait_clean(cluster, ["w0"])

    run_pd(tiny, {"w0": "mixed"}, body, overrides={"w0": {"router_timeout_s": 0.5}}, ping_interval_s=0.05)


# Was a bug: the launcher promises that a second stop signal stops waiting for the drain (`Launcher.request_stop`),
# and it did stop uvicorn's wait (force_exit), but the launcher then waited on ClusterManager.drain for every call
# still in flight, up to the full --drain-timeout: a second Ctrl-C during a long stream still left the server up
# until the stream ended. Fixed: the cluster's drain ends as soon as the server was forced to exit; the workers are
# then told to stop and abort what is left.
def test_a_second_stop_signal_stops_waiting_for_the_drain() -> None:
    with serve_process(["--model", "tiny-random", "--workers", "1", "--num-blocks", "8192", "--drain-timeout", "300"],
                       120.0) as served, httpx.Client(timeout=60.0) as http:
        body = {"model": "tiny-random", "prompt": LONG_STREAM_PROMPTS, "max_tokens": LONG_STREAM_TOKENS, "n": 16,
                "temperature": 0, "ignore_eos": True, "stream": True}
        with http.stream("POST", served.url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()  # kept open: a dropped iterator closes the response (a client gone)
            next(lines)  # the samples stream: their calls are in flight
            served.process.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            forced_at = time.monotonic()
            served.process.send_signal(signal.SIGTERM)
            assert served.process.wait(120) == 0
            assert time.monotonic() - forced_at < 8.0, "the router waited for the stream after a second signal"


# Was a bug: a disaggregated call ended by a finished delta from its prefill worker (the error delta of an add
# it could not read) ended on the router but not on the decode worker, which waited out a lease for KV that never
# came, then recomputed the prompt and decoded it to the end for nobody. Fixed: the router aborts the other leg.
def test_a_pd_call_ended_by_its_prefill_worker_is_aborted_on_its_decode_worker() -> None:
    cluster, socket = cluster_of({"p0": "prefill", "d0": "decode"}, local_prefill_threshold_tokens=0)
    deltas: list[TokenDelta] = []
    cluster.submit(call("r0", tuple(range(1, 40))), deltas.append)
    assert (cluster._calls["r0"].worker_id, cluster._calls["r0"].prefill_worker) == ("d0", "p0")
    socket.sent.clear()
    cluster.pool.handle("p0", rpc.TokenDeltas("p0", (TokenDelta("r0", (), "", True, "error", 39, error="unreadable add",
                                                            worker_id="p0"),)))
    assert deltas[-1].finish_reason == "error" and cluster.num_in_flight == 0 and cluster.num_waiting == 0
    assert ("d0", rpc.Abort(("r0",))) in socket.sent
