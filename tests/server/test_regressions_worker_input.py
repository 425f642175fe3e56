"""Regressions found by bug hunting: a request or a frame a worker cannot take ends that request, never the worker.

Each test failed on the code it was written against; the fixes it guards are named in its comment.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import msgpack
import pytest
import zmq

from kvbaton.core.sampling import SamplingParams
from kvbaton.model.registry import LoadedModel, load_model
from kvbaton.server import rpc
from kvbaton.server.base import GenerateCall
from kvbaton.server.cluster import ClusterManager
from kvbaton.server.worker import Worker, WorkerConfig
from kvbaton.server.worker_links import RouterLinks
from tests.server.pd_helpers import collect, colocated, greedy, run_pd, tokens_of, wait_clean
from tests.server.test_worker_cluster import WorkerThread


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random")


@contextmanager
def linked_router(worker_id: str) -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    """A ROUTER socket (the router's end) and the worker's DEALER, linked in process."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    dealer = context.socket(zmq.DEALER)
    try:
        router.bind(f"inproc://{worker_id}-input")
        dealer.setsockopt(zmq.IDENTITY, worker_id.encode())
        dealer.connect(f"inproc://{worker_id}-input")
        dealer.send(rpc.encode(rpc.Ping(0.0)))  # the router learns the dealer's route
        router.recv_multipart()
        yield router, dealer
    finally:
        dealer.close(linger=0)
        router.close(linger=0)
        context.term()


def unreadable_frames() -> list[bytes]:
    """Frames a worker cannot read: not msgpack, an unknown tag, an Abort of the wrong shape, an AddRequest whose
    sampling misses a field (a router of another version), and one whose sampling the worker refuses."""
    wire = rpc.to_wire(rpc.AddRequest("short", (5, 6, 7), SamplingParams(max_tokens=2)))
    short = [*wire[:3], wire[3][:-1], *wire[4:]]
    invalid = [wire[0], "invalid", wire[2], [0, *wire[3][1:]], *wire[4:]]  # max_tokens 0
    return [b"\xc1 not msgpack", msgpack.packb(["no_such_tag", 1]), msgpack.packb(["abort", 5, 6]),
            msgpack.packb(short, use_bin_type=True), msgpack.packb(invalid, use_bin_type=True)]


def failed_deltas(router: zmq.Socket) -> dict[str, str]:
    """request id -> error of every failed delta the worker sent so far."""
    failed: dict[str, str] = {}
    while router.poll(200):
        message = rpc.decode(router.recv_multipart()[1])
        if isinstance(message, rpc.TokenDeltas):
            failed.update((d.request_id, d.error) for d in message.deltas if d.finish_reason == "error")
    return failed


def test_an_unreadable_frame_fails_its_request_not_the_worker(tiny: LoadedModel) -> None:
    # Was a bug (server/worker.py `Worker._drain`): `rpc.decode` raised ProtocolError out of the worker's loop, so
    # one frame the worker could not read (an AddRequest from a router of another version, whose sampling has a
    # field more or less, or values this worker refuses) killed the worker and every request on it.
    # Fixed: the frame is dropped and logged; an AddRequest whose id can be read fails with the reason.
    worker = Worker(WorkerConfig(router_address="inproc://unused", worker_id="w0", model="tiny-random",
                                 block_size=16, num_blocks=64), tiny)
    worker.engine = worker._build_engine("fcfs")
    with linked_router("w0") as (router, dealer):
        worker._links = RouterLinks.of_socket(dealer, "w0", time.monotonic)
        for frame in unreadable_frames():
            router.send_multipart([b"w0", frame])
        good = rpc.AddRequest("good", (5, 6, 7), SamplingParams(max_tokens=2, temperature=0.0))
        for message in (good, rpc.Shutdown("done")):
            router.send_multipart([b"w0", rpc.encode(message)])
        while not worker._stopping:
            assert dealer.poll(2000), "messages did not arrive"
            worker._drain()
        failed = failed_deltas(router)
    assert sorted(failed) == ["invalid", "short"], failed
    assert "max_tokens must be a positive integer" in failed["invalid"] and "malformed add" in failed["short"]
    assert worker._in_flight == {"good"} and worker.engine.has_unfinished_requests()


def test_an_unreadable_frame_mid_step_fails_its_request_not_the_prefill_worker(tiny: LoadedModel) -> None:
    # The same between two layers of a prefill worker's step (`Worker._read_mid_step`), where a raise would also
    # tear the step in flight.
    worker = Worker(WorkerConfig(router_address="inproc://unused", worker_id="p0", model="tiny-random",
                                 role="prefill", block_size=16, num_blocks=64), tiny)
    worker.engine = worker._build_engine("fcfs")
    frames = unreadable_frames()
    with linked_router("p0") as (router, dealer):
        worker._links = RouterLinks.of_socket(dealer, "p0", time.monotonic)
        for frame in frames:
            router.send_multipart([b"p0", frame])
        router.send_multipart([b"p0", rpc.encode(rpc.Ping(1.0))])
        while not worker._deferred:
            assert dealer.poll(2000), "messages did not arrive"
            worker._read_mid_step()
        failed = failed_deltas(router)
    assert sorted(failed) == ["invalid", "short"], failed
    assert [message for _, message in worker._deferred] == [rpc.Ping(1.0)]


def test_a_request_id_used_again_does_not_kill_the_prefill_worker(tiny: LoadedModel) -> None:
    # Was a bug (engine/handoff_prefill.py `PrefillHandoffs.submit`): the handoff source keeps an ended leg as a
    # tombstone for 10 minutes, and `HandoffSource.start` raises ProtocolError for a transfer id it knows. The
    # router refuses a request id only while a call with it is in flight, so a caller of the cluster that used an
    # id again (a retry, ids numbered per run) killed the prefill worker on its second handoff.
    # Fixed: the prefill worker refuses such a handoff, and the decode worker runs the request itself.
    prompt = tiny.tokenizer.encode("A prompt long enough to be handed off, asked twice under one id.")
    expected = colocated(tiny, prompt, greedy(6))

    async def body(cluster: ClusterManager, workers: dict[str, WorkerThread]) -> None:
        for _ in range(2):
            deltas = await collect(cluster, GenerateCall("same-0", tuple(prompt), greedy(6), arrival_at=0.0))
            assert tokens_of(deltas) == expected and deltas[-1].finish_reason == "length", deltas[-1]
        await wait_clean(cluster, ["p0", "d0"])
        assert cluster.workers["d0"].stats.num_transfer_recomputes == 1
        assert all(w.thread.is_alive() for w in workers.values())

    run_pd(tiny, {"p0": "prefill", "d0": "decode"}, body)
