"""Regressions found by a bug hunt in the router <-> worker RPC and registration; each test names the bug it
guards, which it showed on the code it was written against."""

from __future__ import annotations

import asyncio
import time
from dataclasses import astuple

import msgpack
import pytest
import zmq
import zmq.asyncio

from kvbaton.core.cluster_secret import ClusterSecret
from kvbaton.core.sampling import SamplingParams
from kvbaton.server import rpc
from kvbaton.server.base import TokenDelta
from kvbaton.server.cluster import ClusterConfig, ClusterManager
from kvbaton.server.metrics import ApiMetrics
from kvbaton.server.router_socket import RouterSocket
from kvbaton.server.rpc_auth import secure_dealer
from tests.server.test_cluster_manager import ScriptedWorker, call, register, run_cluster, settle

SECRET = ClusterSecret.generate()

pytestmark = pytest.mark.timeout(60)

INF = float("inf")
_SAMPLING = rpc.sampling_to_wire(SamplingParams(max_tokens=4))
_DELTA = rpc.delta_to_wire(TokenDelta("r1", (5,), "hi", True, "stop", 3, 0))
_STATS = ["stats", *astuple(rpc.Stats("w0", 0, 0, 0, 0, 64, 0, 0, 0, 0, 0, 0.0))]


def _frame(raw: list[object]) -> bytes:
    return msgpack.packb(raw, use_bin_type=True)


def _with(raw: list[object], index: int, value: object) -> list[object]:
    return [*raw[:index], value, *raw[index + 1:]]


# Was a bug: `from_wire` passed the fields of plain messages to their dataclass unchecked and converted numbers with
# int() without catching OverflowError, so a frame with a wrong type either decoded into a message whose field broke
# the router later, far from the frame (a decode worker's kv_address 5 made every routing raise AttributeError, a
# string in a heartbeat's counter made /metrics and /cluster raise TypeError), or raised OverflowError (an inf where
# an int belongs) out of `rpc.decode`, past RouterSocket's ProtocolError handler. Every such frame is now a
# ProtocolError, dropped in one place.
@pytest.mark.parametrize("raw", [
    ["snapshot", "w0", INF, []],
    ["snapshot", "w0", 3, "abc"],
    ["kv_events", "w0", "abc"],
    ["kv_events", "w0", [1, 2]],
    ["deltas", "w0", [_with(_DELTA, 5, INF)]],
    ["deltas", "w0", [_with(_DELTA, 1, [INF])]],
    ["deltas", "w0", [_with(_DELTA, 4, ["stop"])]],
    ["register", "d0", "decode", "tiny-random", "rev1", "lay", 4, 64, "probe", 1, 5, ""],
    ["register", "w0", "mixed", "tiny-random", "rev1", "lay", 4, "64", "probe", 1, "", ""],
    _with(_STATS, 2, "1"),
    _with(_STATS, 14, "x"),
    _with(_STATS, 12, None),
    ["heartbeat", "w0", [], _STATS[1:3]],
    ["heartbeat", "w0", [], "stats"],
    ["heartbeat", "w0", "abc", _STATS[1:]],
    ["handoff_ended", "p0", "r1", "d0", ["refused"], "no room"],
    ["goodbye", "w0", None],
    ["ping", "x"],
    ["register_ack", "w0", "fcfs", "fast"],
    ["handoff_failed", "r1", "lost", "no"],
    ["abort", "abc"],
    ["abort", [1, None]],
    ["add", "r1", ["a", 2], _SAMPLING],
    ["add", "r1", [1, 2], _SAMPLING, 5],
], ids=lambda raw: f"{raw[0]}")
def test_a_frame_with_a_field_of_the_wrong_type_is_a_protocol_error(raw: list[object]) -> None:
    with pytest.raises(rpc.ProtocolError):
        rpc.decode(_frame(raw))


def test_an_add_with_a_wrong_typed_field_still_names_its_request() -> None:
    with pytest.raises(rpc.ProtocolError) as caught:
        rpc.decode(_frame(["add", "r1", [1, 2], _SAMPLING, ["tenant"]]))
    assert caught.value.request_id == "r1"  # the worker fails that request instead of leaving it unanswered


def test_a_frame_whose_number_overflows_is_dropped_and_the_frames_after_it_still_arrive() -> None:
    # On the old code the OverflowError left the reader callback mid-drain (the loop's exception handler got it):
    # the frames queued behind the bad one waited for the next wakeup of the reader.
    escaped: list[object] = []

    async def main() -> list[rpc.Message]:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: escaped.append(context.get("exception")))
        router = RouterSocket("tcp://127.0.0.1:*", SECRET)
        context = zmq.Context()
        worker = context.socket(zmq.DEALER)
        secure_dealer(worker, SECRET)
        worker.setsockopt(zmq.IDENTITY, b"w0")
        worker.setsockopt(zmq.LINGER, 0)
        worker.connect(router.address)
        received: list[rpc.Message] = []
        try:
            worker.send(_frame(["snapshot", "w0", INF, []]))
            worker.send(rpc.encode(rpc.Goodbye("w0", "after the bad frame")))
            time.sleep(0.2)  # both queued before the first drain
            router.start(lambda sender, message: received.append(message))
            deadline = time.monotonic() + 1.0
            while not received and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return received
        finally:
            worker.close()
            context.term()
            router.close()

    assert asyncio.run(main()) == [rpc.Goodbye("w0", "after the bad frame")]
    assert escaped == []


def test_a_decode_worker_registering_a_non_string_kv_address_never_breaks_routing() -> None:
    async def body(cluster: ClusterManager, context: zmq.asyncio.Context) -> None:
        worker = ScriptedWorker(context, cluster, "w0")
        await worker.join()
        bad = ScriptedWorker(context, cluster, "d0")
        await bad.socket.send(_frame(["register", "d0", "decode", "tiny-random", "rev1",
                                      "llama-L2-kvh2-hd16-float32-bs4", 4, 64, "probe", 1, 5, ""]))
        await bad.socket.send(_frame(_with(_STATS, 1, "d0")))
        await settle()
        assert sorted(cluster.workers) == ["w0"]
        deltas: list[TokenDelta] = []
        cluster.submit(call("r1"), deltas.append)  # was AttributeError: 'int' object has no attribute 'partition'
        assert isinstance(await worker.expect(rpc.AddRequest), rpc.AddRequest)
        bad.close()

    run_cluster(body)


def test_a_heartbeat_with_a_string_counter_never_breaks_the_metrics() -> None:
    async def body(cluster: ClusterManager, context: zmq.asyncio.Context) -> None:
        worker = ScriptedWorker(context, cluster, "w0")
        await worker.join()
        await worker.socket.send(_frame(_with(_STATS, 14, "7")))  # num_transfers_started
        await settle()
        metrics = ApiMetrics()
        metrics.attach_cluster(cluster.cluster_info)
        assert b"kvbaton:num_workers 1.0" in metrics.render()  # was TypeError in transfer_totals

    run_cluster(body)


class _Process:
    def __init__(self, code: int | None = None) -> None:
        self.code = code

    def poll(self) -> int | None:
        return self.code


class _Socket:
    def send(self, worker_id: str, message: rpc.Message) -> None:
        return None


# Was a bug: the launcher's process handle stayed watched under the worker's id after that process exited, so a
# worker started again under the same id registered, was acked, and was dropped at the next check as
# "process ... exited" (the old process's exit code), its calls failed, however healthy it was.
def test_a_worker_registering_again_after_its_watched_process_exited_stays_in_the_pool() -> None:
    cluster = ClusterManager(ClusterConfig(model_name="tiny-random", block_size=4), clock=lambda: 0.0)
    cluster.pool.socket = _Socket()  # type: ignore[assignment]
    process = _Process()
    cluster.watch_process("w0", process)
    cluster.pool.handle("w0", register("w0"))
    process.code = 1
    cluster.check_workers()
    assert cluster.lost_workers == {"w0": "process 4321 exited with code 1"}
    cluster.pool.handle("w0", register("w0"))  # a new process with the same id
    cluster.pool.handle("w0", rpc.Stats("w0", 0, 0, 0, 0, 64, 0, 0, 0, 0, 0, 0.0))
    cluster.check_workers()
    assert sorted(cluster.workers) == ["w0"] and cluster.lost_workers == {}
    assert cluster.is_ready() == (True, "1 worker(s) serving: w0")


def test_alive_refreshes_a_worker_only_from_its_own_liveness_socket() -> None:
    now = [0.0]
    cluster = ClusterManager(ClusterConfig(model_name="tiny-random", block_size=4), clock=lambda: now[0])
    cluster.pool.socket = _Socket()  # type: ignore[assignment]
    cluster.pool.handle("w0", register("w0"))
    cluster.pool.handle("w1", register("w1"))
    now[0] = 10.0
    cluster.pool.handle("w1#alive", rpc.Alive("w0"))  # another worker's liveness socket naming w0
    cluster.pool.handle("w0", rpc.Alive("w0"))  # w0's main socket: Alive belongs on the other one
    assert cluster.workers["w0"].last_heard_at == 0.0
    cluster.pool.handle(rpc.alive_identity("w0"), rpc.Alive("w0"))
    assert cluster.workers["w0"].last_heard_at == 10.0
    cluster.pool.handle(rpc.alive_identity("w9"), rpc.Alive("w9"))  # no such worker: nothing to refresh, none added
    assert sorted(cluster.workers) == ["w0", "w1"]
