"""A worker's links to its routers: one authenticated DEALER per router, each with its own registration and liveness.

A worker may serve several routers over one engine (`kvbaton serve --routers N`, `kvbaton router --join`). Each
`RouterLink` is one router: its socket (a CurveZMQ client, `server/rpc_auth.py`), an `Alive` thread on a socket of its
own, whether the router has acknowledged this worker's registration, when it was last heard, and the requests it
sent that have not ended. The worker (`server/worker.py`) sends:
- what concerns one request (its deltas, a failed add, a handoff leg's end) to the link that sent it;
- what concerns the worker (heartbeats, KV events, goodbyes) to every registered link, encoded once;
- a snapshot to the link that asked (or that just registered: a router that joins or comes back rebuilds its prefix
  index from it).

Sends never wait. A link socket has ZMQ_IMMEDIATE set: while its router is down nothing queues for it (a send fails
with zmq.Again and the frame is dropped), so a router that comes back gets a fresh registration, not a backlog of
stale frames. A link that is not registered sends `Register` until one goes out, then again `REGISTER_RESEND_S` after
one that went unanswered: a router that died is retried at its address for as long as the worker lives. A link whose
router shut down on purpose (or refused this worker) is closed; a router started again joins with `--join`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

import zmq

from kvbaton.core.cluster_secret import ClusterSecret
from kvbaton.server import rpc
from kvbaton.server.rpc_auth import secure_dealer

log = logging.getLogger("kvbaton.worker")

REGISTER_RESEND_S = 5.0  # a Register that went out unanswered is sent again after this (one never sent: at once)
_NOBLOCK = int(zmq.NOBLOCK)
_POLLIN = int(zmq.POLLIN)


class AliveThread:
    """Sends `rpc.Alive` every `interval_s` on its own DEALER socket (a zmq socket belongs to one thread) until
    stopped. It needs the GIL only for a moment per beat, which a step's torch ops release."""

    def __init__(self, context: zmq.Context, router_address: str, worker_id: str, secret: ClusterSecret,
                 interval_s: float = rpc.ALIVE_INTERVAL_S) -> None:
        self._socket = context.socket(zmq.DEALER)
        secure_dealer(self._socket, secret)
        self._socket.setsockopt(zmq.IDENTITY, rpc.alive_identity(worker_id).encode())
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 4)  # an unreachable router queues a few beats, not a backlog
        self._socket.connect(router_address)
        self._frame = rpc.encode(rpc.Alive(worker_id))
        self._interval_s = interval_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{worker_id}-alive", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                try:
                    self._socket.send(self._frame, _NOBLOCK)
                except zmq.Again:
                    pass  # the router is not reachable right now: the next beat tries again
                if self._stopped.wait(self._interval_s):
                    return
        finally:
            self._socket.close()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()


class RouterLink:
    """One router this worker serves (or tries to): see the module docstring."""

    def __init__(self, address: str, socket: zmq.Socket, now: float) -> None:
        self.address = address
        self.socket = socket
        self.registered = False  # the router acknowledged this worker's registration and has not been given up
        self.refused = ""  # why the router refused this worker (then no more registrations are sent)
        self.closed = False  # its router shut down on purpose or refused this worker: nothing more is sent or read
        self.leaving = False  # its router is shutting down: closed once its requests have sent their final deltas
        self.last_heard_at = now  # worker clock of the latest frame from the router
        self.register_sent_at = float("-inf")
        self.request_ids: set[str] = set()  # requests it sent here that have not sent their final delta
        self.alive: AliveThread | None = None

    def send(self, message: rpc.Message) -> bool:
        return self.send_bytes(rpc.encode(message))

    def send_bytes(self, payload: bytes) -> bool:
        """Send without waiting; False when the router is not connected (the frame is dropped)."""
        if self.closed:
            return False
        try:
            self.socket.send(payload, _NOBLOCK)
        except zmq.Again:
            return False
        return True

    def has_input(self) -> bool:
        return not self.closed and bool(self.socket.get(zmq.EVENTS) & _POLLIN)

    def recv(self) -> bytes | None:
        """The next frame from the router, or None when none is waiting."""
        if self.closed:
            return None
        try:
            return self.socket.recv(_NOBLOCK)
        except zmq.Again:
            return None

    def close(self) -> None:
        if self.alive is not None:
            self.alive.stop()
            self.alive = None
        self.socket.close()  # with its LINGER: a goodbye sent just before still goes out
        self.closed = True
        self.registered = False


class RouterLinks:
    """Every router link of one worker, in the order they were added; the first is the one given on the command
    line first. `owner` maps a request id to the link that sent it."""

    def __init__(self, worker_id: str, secret: ClusterSecret | None, clock: Callable[[], float],
                 context: zmq.Context | None = None) -> None:
        self.worker_id = worker_id
        self._secret = secret
        self._clock = clock
        self._context = context
        self.links: list[RouterLink] = []
        self.owner: dict[str, RouterLink] = {}
        self._poller = zmq.Poller()

    @classmethod
    def of_socket(cls, socket: zmq.Socket, worker_id: str, clock: Callable[[], float]) -> RouterLinks:
        """Links over one socket connected by the caller (tests drive a worker's handlers this way)."""
        links = cls(worker_id, None, clock)
        link = RouterLink("", socket, clock())
        link.registered = True
        links.links.append(link)
        links._poller.register(socket, zmq.POLLIN)
        return links

    def add(self, address: str) -> RouterLink | None:
        """Connect to one more router (None when a link to `address` is open already)."""
        if any(link.address == address and not link.closed for link in self.links):
            return None
        assert self._context is not None and self._secret is not None, "links built over a socket cannot add more"
        socket = self._context.socket(zmq.DEALER)
        secure_dealer(socket, self._secret)
        socket.setsockopt(zmq.IDENTITY, self.worker_id.encode())
        socket.setsockopt(zmq.LINGER, 1000)  # a goodbye or final delta sent as the worker exits still goes out
        socket.setsockopt(zmq.IMMEDIATE, 1)  # queue only for a connected router (module docstring)
        socket.setsockopt(zmq.SNDHWM, 0)  # never drop a frame to a connected router: its deltas are a stream
        socket.connect(address)
        link = RouterLink(address, socket, self._clock())
        self.links.append(link)
        self._poller.register(socket, zmq.POLLIN)
        return link

    def start_alive(self, link: RouterLink) -> None:
        """Start the link's liveness beats (once it registered: a router ignores them from a stranger)."""
        if link.alive is None and self._context is not None and self._secret is not None:
            link.alive = AliveThread(self._context, link.address, self.worker_id, self._secret)

    @property
    def open_links(self) -> list[RouterLink]:
        return [link for link in self.links if not link.closed]

    @property
    def registered(self) -> list[RouterLink]:
        return [link for link in self.links if link.registered]

    def poll(self, timeout_ms: int) -> None:
        """Wait up to `timeout_ms` for a frame on any link."""
        self._poller.poll(timeout_ms)

    def frames(self) -> Iterator[tuple[RouterLink, bytes]]:
        """Every frame waiting now, link by link (each link's frames in arrival order)."""
        for link in list(self.links):
            while True:
                payload = link.recv()
                if payload is None:
                    break
                yield link, payload

    def broadcast(self, message: rpc.Message) -> None:
        """To every registered link, encoded once."""
        payload = rpc.encode(message)
        for link in self.links:
            if link.registered:
                link.send_bytes(payload)

    def assign(self, request_id: str, link: RouterLink) -> None:
        self.owner[request_id] = link
        link.request_ids.add(request_id)

    def release(self, request_id: str) -> RouterLink | None:
        """The request sent its final delta: it leaves its link; returns that link."""
        link = self.owner.pop(request_id, None)
        if link is not None:
            link.request_ids.discard(request_id)
        return link

    def link_of(self, request_id: str) -> RouterLink | None:
        return self.owner.get(request_id)

    def close_link(self, link: RouterLink) -> None:
        if not link.closed:
            self._poller.unregister(link.socket)
            link.close()

    def close(self) -> None:
        for link in self.links:
            self.close_link(link)
