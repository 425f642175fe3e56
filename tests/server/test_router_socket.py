"""RouterSocket read from the event loop's reader callback: frames queued before `start`, bursts larger than one
drain batch, malformed frames, and sends to a vanished peer."""

from __future__ import annotations

import asyncio
import time

import zmq

from kvbaton.core.cluster_secret import ClusterSecret
from kvbaton.server import rpc
from kvbaton.server.router_socket import RouterSocket
from kvbaton.server.rpc_auth import secure_dealer


SECRET = ClusterSecret.generate()


def _dealer(context: zmq.Context, address: str, identity: str) -> zmq.Socket:
    socket = context.socket(zmq.DEALER)
    secure_dealer(socket, SECRET)
    socket.setsockopt(zmq.IDENTITY, identity.encode())
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    return socket


async def _until(predicate: object, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_frames_sent_before_start_and_bursts_beyond_one_drain_all_arrive_in_order() -> None:
    async def main() -> list[tuple[str, rpc.Message]]:
        router = RouterSocket("tcp://127.0.0.1:*", SECRET)
        context = zmq.Context()
        worker = _dealer(context, router.address, "w0")
        received: list[tuple[str, rpc.Message]] = []
        try:
            worker.send(rpc.encode(rpc.Goodbye("w0", "early")))
            worker.send(b"\xc1")  # not msgpack: dropped, the rest still arrives
            time.sleep(0.2)  # queued in the socket before anyone reads it
            router.start(lambda sender, message: received.append((sender, message)))
            for i in range(600):  # more than one drain batch
                worker.send(rpc.encode(rpc.Ping(float(i))))
            await _until(lambda: len(received) == 601)
            return received
        finally:
            worker.close()
            context.term()
            router.close()

    received = asyncio.run(main())
    assert received[0] == ("w0", rpc.Goodbye("w0", "early"))
    assert [m for _, m in received[1:]] == [rpc.Ping(float(i)) for i in range(600)]


def test_replies_sent_from_the_handler_never_stall_the_reads() -> None:
    """An echo server: each handler sends, which can consume the edge of frames that arrived meanwhile."""

    async def main() -> int:
        router = RouterSocket("tcp://127.0.0.1:*", SECRET)
        context = zmq.Context()
        worker = _dealer(context, router.address, "w0")
        try:
            router.start(lambda sender, message: router.send(sender, message))
            for i in range(200):  # strictly one at a time: a lost edge would stall the exchange for good
                worker.send(rpc.encode(rpc.Ping(float(i))))
                await _until(lambda: worker.poll(0) != 0, timeout_s=2.0)
                assert rpc.decode(worker.recv()) == rpc.Ping(float(i))
            return 200
        finally:
            worker.close()
            context.term()
            router.close()

    assert asyncio.run(main()) == 200


def test_sends_from_outside_the_reader_never_hide_arriving_frames() -> None:
    """A send processes the socket's command queue and can consume the edge of frames arriving meanwhile;
    the socket must notice (EVENTS) or those frames wait for an edge that never comes."""

    async def main() -> int:
        router = RouterSocket("tcp://127.0.0.1:*", SECRET)
        context = zmq.Context()
        worker = _dealer(context, router.address, "w0")
        received: list[rpc.Message] = []
        try:
            router.start(lambda sender, message: received.append(message))
            for i in range(300):
                worker.send(rpc.encode(rpc.Ping(float(i))))
                deadline = time.monotonic() + 2.0
                while len(received) <= i:  # sends from a handler-like coroutine while the frame arrives
                    assert time.monotonic() < deadline, f"frame {i} never read"
                    router.send("w0", rpc.Ping(-1.0))
                    await asyncio.sleep(0)
            return len(received)
        finally:
            worker.close()
            context.term()
            router.close()

    assert asyncio.run(main()) == 300


def test_a_send_to_an_unknown_peer_returns_the_error() -> None:
    async def main() -> zmq.ZMQError | None:
        router = RouterSocket("tcp://127.0.0.1:*", SECRET)
        try:
            router.start(lambda sender, message: None)
            return router.send("nobody", rpc.Ping(0.0))
        finally:
            router.close()

    error = asyncio.run(main())
    assert isinstance(error, zmq.ZMQError) and error.errno == zmq.EHOSTUNREACH
