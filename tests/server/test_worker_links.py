"""A worker's router links (server/worker_links.py): nothing queues for a router that is not there (a router that comes
back gets a fresh registration, not a backlog), frames flow once it binds, and requests are owned by the link that
sent them."""

from __future__ import annotations

import socket
import time

import zmq

from kvbaton.server import rpc
from kvbaton.server.rpc_auth import secure_router
from kvbaton.server.worker_links import RouterLinks
from tests.server.test_worker_cluster import SECRET


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_frames_for_an_absent_router_are_dropped_and_flow_once_it_binds() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    context = zmq.Context()
    links = RouterLinks("w0", SECRET, time.monotonic, context)
    router = context.socket(zmq.ROUTER)
    authenticator = None
    try:
        link = links.add(address)
        assert link is not None and links.add(address) is None  # one link per address
        assert not link.send(rpc.Ping(1.0)), "a frame queued for a router that is not there"
        authenticator = secure_router(router, context, SECRET)
        router.bind(address)
        deadline = time.monotonic() + 10.0
        while not link.send(rpc.Goodbye("w0", "hello")):  # the link connects (and authenticates) on its own
            assert time.monotonic() < deadline, "the link never connected"
            time.sleep(0.02)
        assert router.poll(5000)
        identity, payload = router.recv_multipart()
        assert identity == b"w0" and rpc.decode(payload) == rpc.Goodbye("w0", "hello")  # not the dropped Ping
        router.send_multipart([b"w0", rpc.encode(rpc.Ping(2.0))])
        links.poll(5000)
        assert [(got, rpc.decode(frame)) for got, frame in links.frames()] == [(link, rpc.Ping(2.0))]
    finally:
        links.close()
        router.close(linger=0)
        if authenticator is not None:
            authenticator.stop()
        context.term()


def test_a_request_belongs_to_the_link_that_sent_it_until_its_final_delta() -> None:
    context = zmq.Context()
    links = RouterLinks("w0", SECRET, time.monotonic, context)
    try:
        first, second = links.add("tcp://127.0.0.1:1"), links.add("tcp://127.0.0.1:2")
        assert first is not None and second is not None
        links.assign("a", first)
        links.assign("b", second)
        assert links.link_of("a") is first and first.request_ids == {"a"} and second.request_ids == {"b"}
        assert links.release("a") is first and links.link_of("a") is None and first.request_ids == set()
        assert links.release("a") is None  # once
        links.close_link(second)
        assert second.closed and links.open_links == [first] and not second.send(rpc.Ping(0.0))
    finally:
        links.close()
        context.term()
