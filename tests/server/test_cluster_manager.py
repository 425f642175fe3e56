"""ClusterManager against scripted workers: plain DEALER sockets speaking the RPC schema (no engine).

These pin the router side of the protocol — registration and refusal, routing, streaming, abort
propagation, KV-event gaps and snapshots, dead-worker detection, backpressure — in well under a
second each; tests/server/test_worker_cluster.py runs the same paths with real engine workers.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable

import pytest
import zmq
import zmq.asyncio

from kvbaton.cache.events import KVEvent, KVEventKind
from kvbaton.cache.hashing import CacheKey, hash_block_tokens
from kvbaton.core.cluster_secret import ClusterSecret
from kvbaton.core.sampling import SamplingParams
from kvbaton.server import rpc
from kvbaton.server.base import GenerateCall, RejectedError, TokenDelta
from kvbaton.server.cluster import ClusterConfig, ClusterManager
from kvbaton.server.rpc_auth import secure_dealer

LAYOUT = "llama-L2-kvh2-hd16-float32-bs4"


def register(worker_id: str, kv_layout: str = LAYOUT, probe: str = "probe", block_size: int = 4, role: str = "mixed",
             model: str = "tiny-random", revision: str = "rev1", tp: int = 1, pp: int = 1) -> rpc.Register:
    return rpc.Register(worker_id, role, model, revision, kv_layout, block_size, 64, probe, 4321,
                        tensor_parallel_size=tp, pipeline_parallel_size=pp)


class ScriptedWorker:
    def __init__(self, context: zmq.asyncio.Context, cluster: ClusterManager, worker_id: str) -> None:
        self.worker_id = worker_id
        self.socket = context.socket(zmq.DEALER)
        secure_dealer(self.socket, cluster.secret)
        self.socket.setsockopt(zmq.IDENTITY, worker_id.encode())
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(cluster.address)

    async def send(self, message: rpc.Message) -> None:
        await self.socket.send(rpc.encode(message))

    async def expect(self, kind: type, timeout_s: float = 2.0) -> rpc.Message:
        """Next message of `kind`, skipping pings."""
        while True:
            message = rpc.decode(await asyncio.wait_for(self.socket.recv(), timeout_s))
            if not isinstance(message, rpc.Ping):
                assert isinstance(message, kind), message
                return message

    async def join(self, heartbeat: bool = True) -> rpc.Message:
        await self.send(register(self.worker_id))
        ack = await self.expect(rpc.RegisterAck)
        if heartbeat:
            await self.heartbeat()
        return ack

    async def heartbeat(self) -> None:
        """An idle worker's stats; the router counts a worker as serving from its first one."""
        await self.send(rpc.Stats(self.worker_id, 0, 0, 0, 0, 64, 0, 0, 0, 0, 0, 0.0))
        await settle()

    def close(self) -> None:
        self.socket.close(linger=0)


def run_cluster(body: Callable[[ClusterManager, zmq.asyncio.Context], Awaitable[None]], **config: object) -> None:
    async def main() -> None:
        cluster = ClusterManager(ClusterConfig(model_name="tiny-random", block_size=4, tokenizer_probe_hash="probe",
                                               **config))  # type: ignore[arg-type]
        await cluster.start()
        context = zmq.asyncio.Context()
        try:
            await asyncio.wait_for(body(cluster, context), 10.0)
        finally:
            await cluster.shutdown(timeout_s=0.1)
            context.destroy(linger=0)

    asyncio.run(main())


def call(request_id: str, tokens: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8, 9), max_tokens: int = 4) -> GenerateCall:
    return GenerateCall(request_id, tokens, SamplingParams(max_tokens=max_tokens, temperature=0.0), arrival_at=0.0)


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0.005)


def test_register_ack_carries_the_local_queue_policy() -> None:
    async def body(cluster: ClusterManager, context: zmq.asyncio.Context) -> None:
        assert cluster.is_ready() == (False, "no worker registered yet")
        worker = ScriptedWorker(context, cluster, "w0")
        ack = await worker.join(heartbeat=False)
        assert ack == rpc.RegisterAck("w0", "preble", 0.05)
        assert cluster.is_ready() == (False, "1 worker(s) registered, none has started its engine loop yet")
        await worker.heartbeat()
        assert cluster.is_ready() == (True, "1 worker(s) serving: w0")
        info = cluster.cluster_info()
        assert [w["worker_id"] for w in info["workers"]] == ["w0"]  # type: ignore[index]
        assert info["identity"] == {"model_revision": "rev1", "kv_layout": LAYOUT, "block_size": 4}

    run_cluster(body, policy="preble")


@pytest.mark.parametrize("kwargs, reason", [
    ({"kv_layout": "llama-L2-kvh2-hd16-bfloat16-bs4"}, "KV layout"),
    ({"probe": "other"}, "tokenize prompts differently"),
    ({"block_size": 8}, "block size 8"),
    ({"revision": "rev2"}, "model revision 'rev2'"),
    ({"model": "smollm2-135m"}, "model 'smollm2-135m' differs"),
    ({"role": "verifier"}, "role 'verifier' is not served"),
    ({"role": "decode"}, "a decode worker must offer a KV address"),
    ({"tp": 0}, "tensor and pipeline parallel sizes must be >= 1, got 0 x 1"),
])
def test_incompatible_worker_is_refused_with_the_reason(kwargs: dict[str, object], reason: str) -> None:
    async def body(cluster: ClusterManager, context: zmq.asyncio.Context) -> None:
        first = ScriptedWorker(context, cluster, "w0")
        await first.join()
        second = ScriptedWorker(context, cluster, "w1")
        await second.send(register("w1", **kwargs))  # type: ignore[arg-type]
        refuse = await second.expect(rpc.RegisterRefuse)
        assert isinstance(refuse, rpc.RegisterRefuse) and reason in refuse.reason
        assert sorted(cluster.workers) == ["w0"]

    run_cluster(body)


def test_cluster_view_shows_each_workers_parallelism_as_it_registered() -> None:
    async def body(cluster: ClusterManager, context: zmq.asyncio.Context) -> None:
        for worker_id, tp, pp in (("w0", 1, 1), ("w1", 2, 1), ("w2", 1, 2)):
            worker = ScriptedWorker(context, cluster, worker_id)
            await worker.send(register(worker_id, tp=tp, pp=pp))
            await worker.expect(rpc.RegisterAck)
            await worker.heartbeat()
        workers = cluster.cluster_info()["workers"]
        assert [(w["worker_id"], w["tensor_parallel_size"], w["pipeline_parallel_size"])  # type: ignore[index]
                for w in workers] == [("w0", 1, 1), ("w1", 2, 1), ("w2", 1, 2)]  # type: ignore[union-attr]

    run_cluster(body)


def test_call_streams_deltas_and_counts_the_decision() -> None:
    async def body(cluster: ClusterManager, context: zmq.asyncio.Context) -> None:
        worker = ScriptedWorker(context, cluster, "w0")
        await worker.join()
        stream = cluster.generate(call("r1"))
        first = asyncio.ensure_future(stream.__anext__())
        add = await worker.expect(rpc.AddRequest)
        assert add == rpc.AddRequest("r1", call("r1").prompt_token_ids, call("r1").sampling, "", "default")
        assert cluster.num_waiting == 1
        await worker.send(rpc.TokenDeltas("w0", (TokenDelta("r1", (7,), "a", False, None, 9, 4, worker_id="w0"),)))
        assert (await first).new_token_ids == (7,)
        assert cluster.num_waiting == 0 and cluster.num_in_flight == 1
        await worker.send(rpc.TokenDeltas("w0", (TokenDelta("r1", (8,), "b", True, "length", 9, 4, worker_id="w0"),)))
        last = await stream.__anext__()
        assert last.finished and last.finish_reason == "length"
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        assert cluster.num_in_flight == 0 and cluster.workers["w0"].in_flight == set()
        assert cluster.router_decisions == {"least_load": 1}

    run_cluster(body)


def test_consumer_leaving_mid_stream_aborts_on_the_worker() -> None:
    async def body(cluster: ClusterManager, context: zmq.asyncio.Context) -> None:
        worker = ScriptedWorker(context, cluster, "w0")
        await worker.join()
        stream = cluster.generate(call("r1"))
        first = asyncio.ensure_future(stream.__anext__())
        await worker.expect(rpc.AddRequest)
        await worker.send(rpc.TokenDeltas("w0", (TokenDelta("r1", (7,), "a", False, None, 9, 0),)))
        await first
        await stream.aclose()  # what the HTTP layer does when the client disconnects
        assert await worker.expect(rpc.Abort) == rpc.Abort(("r1",))
        assert cluster.num_in_flight == 0
        # The worker's late abort delta for the dropped call is ignored.
        await worker.send(rpc.TokenDeltas("w0", (TokenDelta("r1", (), "", True, "abort", 9, 0),)))
        await settle()
        assert cluster.num_in_flight == 0

    run_cluster(body)


def test_explicit_abort_reaches_the_worker_and_the_stream_ends_with_its_delta() -> None:
    async def body(cluster: ClusterManager, context: zmq.asyncio.Context) -> None:
        worker = ScriptedWorker(context, cluster, "w0")
        await worker.join()
        stream = cluster.generate(call("r1"))
        first = asyncio.ensure_future(stream.__anext__())
        await worker.expect(rpc.AddRequest)
        await cluster.abort("r1")
        await cluster.abort("unknown")  # idempotent, no error
        assert await worker.expect(rpc.Abort) == rpc.Abort(("r1",))
        await worker.send(rpc.TokenDeltas("w0", (TokenDelta("r1", (), "", True, "abort", 9, 0),)))
        assert (await first).finish_reason == "abort"

    run_cluster(body)


def test_silent_worker_fails_its_calls_and_leaves_the_pool() -> None:
    async def body(cluster: ClusterManager, context: zmq.asyncio.Context) -> None:
        worker = ScriptedWorker(context, cluster, "w0")
        await worker.join()
        stream = cluster.generate(call("r1"))
        first = asyncio.ensure_future(stream.__anext__())
        await worker.expect(rpc.AddRequest)
        delta = await first  # the monitor notices the silence within worker_timeout_s
        assert delta.finished and delta.finish_reason == "error"
        assert "worker w0 was lost" in delta.error and "no heartbeat" in delta.error
        ready, reason = cluster.is_ready()
        assert not ready and "w0: no heartbeat" in reason
        assert cluster.num_failed_by_worker_loss == 1
        assert cluster.num_waiting == 0 and cluster.num_in_flight == 0
        with pytest.raises(RejectedError) as rejected:
            await cluster.generate(call("r2")).__anext__()
        assert rejected.value.status_code == 503

    run_cluster(body, worker_timeout_s=0.3)


class _ExitedProcess:
    def __init__(self) -> None:
        self.code: int | None = None

    def poll(self) -> int | None:
        return self.code


def test_process_exit_is_noticed_before_the_heartbeat_timeout() -> None:
    async def body(cluster: ClusterManager, context: zmq.asyncio.Context) -> None:
        worker = ScriptedWorker(context, cluster, "w0")
        await worker.join()
        process = _ExitedProcess()
        cluster.watch_process("w0", process)
        stream = cluster.generate(call("r1"))
        first = asyncio.ensure_future(stream.__anext__())
        await worker.expect(rpc.AddRequest)
        process.code = -9
        delta = await asyncio.wait_for(first, 1.0)
        assert "process 4321 exited with code -9" in delta.error
        assert cluster.lost_workers == {"w0": "process 4321 exited with code -9"}

    run_cluster(body, worker_timeout_s=30.0)


def test_an_exit_reported_after_the_worker_was_dropped_is_added_to_why_it_was_lost() -> None:
    # A Ray actor reports its worker's exit a moment after the connection drops (server/ray_workers.py).
    now = [0.0]
    cluster = ClusterManager(ClusterConfig(model_name="tiny-random", block_size=4, worker_timeout_s=5.0),
                             clock=lambda: now[0])
    cluster.pool.handle("w0", register("w0"))
    process = _ExitedProcess()
    cluster.watch_process("w0", process)
    cluster.pool.remove("w0", "unreachable (Host unreachable)")
    cluster.check_workers()
    assert cluster.lost_workers == {"w0": "unreachable (Host unreachable)"}
    process.code = -9
    cluster.check_workers()
    cluster.check_workers()  # noted once
    assert cluster.lost_workers == {"w0": "unreachable (Host unreachable); its process exited with code -9"}


def test_a_lost_connection_waits_a_moment_for_its_processs_exit_code() -> None:
    # A killed worker's sockets close a moment before it can be reaped: the send that finds it unreachable waits
    # briefly for the exit, so the reason names it (an exit that never comes leaves "unreachable").
    class _DyingProcess(_ExitedProcess):
        def __init__(self, polls_before_exit: int) -> None:
            super().__init__()
            self.polls_left = polls_before_exit

        def poll(self) -> int | None:
            self.polls_left -= 1
            return -9 if self.polls_left < 0 else None

    class _GoneSocket:
        def send(self, worker_id: str, message: object) -> OSError:
            return OSError(113, "Host unreachable")

    for polls, reason in ((3, "process 4321 exited with code -9"), (10**9, "unreachable (Host unreachable)")):
        cluster = ClusterManager(ClusterConfig(model_name="tiny-random", block_size=4), clock=lambda: 0.0)
        cluster.pool.handle("w0", register("w0"))
        cluster.watch_process("w0", _DyingProcess(polls))
        cluster.pool.socket = _GoneSocket()  # type: ignore[assignment]
        cluster.pool.send("w0", rpc.Ping(0.0))
        assert cluster.lost_workers["w0"].startswith(reason), cluster.lost_workers


def test_kv_event_gap_requests_a_snapshot_and_the_index_follows_it() -> None:
    async def body(cluster: ClusterManager, context: zmq.asyncio.Context) -> None:
        worker = ScriptedWorker(context, cluster, "w0")
        await worker.join()
        hashes = hash_block_tokens(CacheKey("rev1", LAYOUT), list(range(1, 13)), 4)
        root = CacheKey("rev1", LAYOUT).root_hash
        stored = KVEvent(1, KVEventKind.STORED, tuple(hashes[:2]), root, 4)
        await worker.send(rpc.KVEvents("w0", (stored.to_wire(),)))
        await settle()
        assert cluster.state.index.num_worker_blocks("w0") == 2
        gap = KVEvent(3, KVEventKind.STORED, (hashes[2],), hashes[1], 4)
        await worker.send(rpc.KVEvents("w0", (gap.to_wire(),)))
        assert await worker.expect(rpc.SnapshotRequest) == rpc.SnapshotRequest("kv event seq gap")
        snapshot = KVEvent(3, KVEventKind.STORED, tuple(hashes), root, 4)
        await worker.send(rpc.SnapshotResponse("w0", 3, (snapshot.to_wire(),)))
        await settle()
        assert cluster.state.index.num_worker_blocks("w0") == 3
        assert cluster.state.index.last_seq("w0") == 3
        # An empty snapshot still moves the resume point, so the next event applies without a gap.
        await worker.send(rpc.SnapshotResponse("w0", 5, ()))
        await worker.send(rpc.KVEvents("w0", (KVEvent(6, KVEventKind.STORED, (hashes[0],), root, 4).to_wire(),)))
        await settle()
        assert cluster.state.index.last_seq("w0") == 6
        assert cluster.num_snapshots_requested == 1

    run_cluster(body)


def test_queue_limit_rejects_with_retry_after() -> None:
    async def body(cluster: ClusterManager, context: zmq.asyncio.Context) -> None:
        worker = ScriptedWorker(context, cluster, "w0")
        await worker.join()
        streams = [cluster.generate(call(f"r{i}")) for i in range(2)]
        pending = [asyncio.ensure_future(s.__anext__()) for s in streams]
        await worker.expect(rpc.AddRequest)
        await worker.expect(rpc.AddRequest)
        with pytest.raises(RejectedError) as rejected:
            await cluster.generate(call("r2")).__anext__()
        assert rejected.value.status_code == 429 and rejected.value.retry_after_s == 1.0
        assert cluster.num_rejected == 1
        for task, stream in zip(pending, streams):
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await stream.aclose()
        assert cluster.num_waiting == 0 and cluster.num_in_flight == 0
        assert [await worker.expect(rpc.Abort) for _ in range(2)] == [rpc.Abort(("r0",)), rpc.Abort(("r1",))]

    run_cluster(body, max_num_waiting=2)


def test_goodbye_removes_the_worker_and_shutdown_is_sent_to_live_ones() -> None:
    async def body(cluster: ClusterManager, context: zmq.asyncio.Context) -> None:
        w0, w1 = ScriptedWorker(context, cluster, "w0"), ScriptedWorker(context, cluster, "w1")
        await w0.join()
        await w1.join()
        await w0.send(rpc.Goodbye("w0", "shutdown: test"))
        await settle()
        assert sorted(cluster.workers) == ["w1"] and cluster.lost_workers == {"w0": "left: shutdown: test"}
        shutting_down = asyncio.ensure_future(cluster.shutdown(timeout_s=2.0))
        assert await w1.expect(rpc.Shutdown) == rpc.Shutdown("router shutting down")
        await w1.send(rpc.Goodbye("w1", "shutdown"))
        await shutting_down
        assert cluster.workers == {}

    run_cluster(body)


def test_a_router_stall_is_not_blamed_on_the_workers() -> None:
    now = [0.0]
    cluster = ClusterManager(ClusterConfig(model_name="tiny-random", block_size=4, worker_timeout_s=5.0),
                             clock=lambda: now[0])
    cluster.pool.handle("w0", register("w0"))  # not started: nothing is sent, the pool bookkeeping is the same
    assert sorted(cluster.workers) == ["w0"]
    now[0] = 20.0  # the router's loop was blocked for 20 s: unread heartbeats may be waiting in the socket
    cluster.check_workers()
    assert sorted(cluster.workers) == ["w0"]
    removed_at = None
    for step in range(1, 80):
        now[0] = 20.0 + step * 0.1
        cluster.check_workers()
        if not cluster.workers:
            removed_at = now[0]
            break
    assert removed_at is not None and 24.0 < removed_at < 24.2  # a real silence still ends it, 5 s after the stall
    assert cluster.lost_workers["w0"].startswith("no heartbeat for 5.")


def _instant_worker(address: str, worker_id: str, secret: ClusterSecret) -> None:
    """A synchronous worker in its own thread: registers, then answers every add at once until shutdown."""
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    secure_dealer(socket, secret)
    socket.setsockopt(zmq.IDENTITY, worker_id.encode())
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    socket.send(rpc.encode(register(worker_id)))
    socket.send(rpc.encode(rpc.Stats(worker_id, 0, 0, 0, 0, 64, 0, 0, 0, 0, 0, 0.0)))  # queued after the register
    try:
        while socket.poll(5000):
            message = rpc.decode(socket.recv())
            if isinstance(message, rpc.AddRequest):
                done = TokenDelta(message.request_id, (1,), "x", True, "length", 9, 0)
                socket.send(rpc.encode(rpc.TokenDeltas(worker_id, (done,))))
            elif isinstance(message, rpc.Shutdown):
                socket.send(rpc.encode(rpc.Goodbye(worker_id, "shutdown")))
                return
    finally:
        socket.close()
        context.term()


def test_many_concurrent_calls_with_an_instant_worker_never_stall_the_receive_loop() -> None:
    """Regression: a send on the router socket must not swallow the wakeup of the pending receive."""

    async def body(cluster: ClusterManager, context: zmq.asyncio.Context) -> None:
        thread = threading.Thread(target=_instant_worker, args=(cluster.address, "w0", cluster.secret))
        thread.start()
        try:
            await cluster.wait_for_workers(1, timeout_s=5.0)

            async def one(i: int) -> str | None:
                return [d async for d in cluster.generate(call(f"r{i}"))][-1].finish_reason

            reasons = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(300))), 8.0)
            assert reasons == ["length"] * 300
            assert cluster.num_in_flight == 0 and cluster.num_waiting == 0
        finally:
            await cluster.shutdown(timeout_s=2.0)
            await asyncio.to_thread(thread.join, 5.0)
        assert not thread.is_alive()

    run_cluster(body, max_num_waiting=1000, worker_timeout_s=3.0)


def test_an_unknown_worker_is_asked_to_register_again_at_most_once_a_second() -> None:
    """A worker the router does not know (it restarted, or dropped the worker) that still heartbeats gets one
    RegisterAgain per second of the router's clock, however often it reports; registering ends them."""
    now: list[float | None] = [100.0]  # the router's clock, until None: the real one (the shutdown waits on it)

    async def main() -> None:
        cluster = ClusterManager(ClusterConfig(model_name="tiny-random", block_size=4, tokenizer_probe_hash="probe"),
                                 clock=lambda: time.monotonic() if now[0] is None else now[0])
        await cluster.start()
        context = zmq.asyncio.Context()
        worker = ScriptedWorker(context, cluster, "w-unknown")
        stats = rpc.Stats("w-unknown", 0, 0, 0, 0, 64, 0, 0, 0, 0, 0, 0.0)

        async def asked_again() -> int:
            """RegisterAgain frames that arrive within 0.3 s (pings skipped)."""
            count = 0
            deadline = asyncio.get_running_loop().time() + 0.3
            while True:
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    return count
                try:
                    message = rpc.decode(await asyncio.wait_for(worker.socket.recv(), left))
                except TimeoutError:
                    return count
                if isinstance(message, rpc.RegisterAgain):
                    assert message.worker_id == "w-unknown"
                    count += 1

        try:
            for _ in range(5):  # five reports within the same second: one answer
                await worker.send(stats)
            assert await asked_again() == 1
            now[0] = 100.99
            await worker.send(stats)
            assert await asked_again() == 0
            now[0] = 101.01  # a second after the first answer
            await worker.send(rpc.Heartbeat(rpc.KVEvents("w-unknown", ()), stats))
            await worker.send(stats)
            assert await asked_again() == 1
            now[0] = 106.0
            await worker.join()  # known now: its reports are taken, not answered
            await worker.send(stats)
            assert await asked_again() == 0
        finally:
            worker.close()
            now[0] = None
            await cluster.shutdown(timeout_s=0.1)
            context.destroy(linger=0)

    asyncio.run(asyncio.wait_for(main(), 20.0))
