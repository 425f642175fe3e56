"""The router's end of the RPC: one zmq ROUTER socket that every worker's DEALER connects to, read from the
event loop's own reader callback.

The socket is a CurveZMQ server that admits only holders of the cluster secret (`server/rpc_auth.py`).
Frames are [worker identity, msgpack payload]; malformed ones are logged and skipped here, so the
cluster manager only ever sees decoded `rpc.Message`s, handed to its `on_message` callback on the
event loop. Sends never wait: a frame to a worker whose connection is gone fails at once
(ROUTER_MANDATORY) and the caller decides what that means.

Why not zmq.asyncio: its futures (one per recv, a poller re-armed after every send) cost the router
more CPU per request than the rest of the RPC together. Here the socket is a plain one whose FD the
loop watches. zmq's FD is edge-triggered and only says "the socket's events changed", so:
- every wakeup drains with NOBLOCK until zmq.Again (a batch bound yields to the loop between batches,
  with a call_soon that resumes the drain: no edge will come for what is already queued);
- every send is followed by a check of `EVENTS` (one per loop iteration however many sends it made,
  from a call_soon), because a send processes the socket's command queue and can consume the edge of
  frames that arrived meanwhile; if frames are waiting, the check drains them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq

from kvbaton.core.cluster_secret import ClusterSecret
from kvbaton.server import rpc
from kvbaton.server.rpc_auth import secure_router

log = logging.getLogger("kvbaton.cluster")

# Plain ints: pyzmq's flag enums cost a few microseconds per send and receive in enum arithmetic
# (send_multipart ORs SNDMORE into the flags per frame; recv_multipart asks RCVMORE by enum).
_NOBLOCK = int(zmq.NOBLOCK)
_NOBLOCK_SNDMORE = int(zmq.NOBLOCK) | int(zmq.SNDMORE)
_POLLIN = int(zmq.POLLIN)
_EVENTS = int(zmq.EVENTS)
_MAX_MESSAGES_PER_DRAIN = 256  # then yield to the loop (HTTP handlers) before reading on


class RouterSocket:
    """Bound at construction; `start` begins delivering messages to `on_message` on the running loop."""

    def __init__(self, bind_address: str, secret: ClusterSecret) -> None:
        self._context = zmq.Context()
        socket = self._context.socket(zmq.ROUTER)
        self._authenticator = secure_router(socket, self._context, secret)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished worker raises instead of dropping
        # A restarted worker with the same id takes over; only a holder of the cluster secret gets that far.
        socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, 0)  # never drop or refuse a frame to a live worker; admission bounds the queue
        try:
            socket.bind(bind_address)
        except zmq.ZMQError:
            socket.close(linger=0)
            self._authenticator.stop()
            self._context.term()
            raise
        self._socket: zmq.Socket | None = socket
        self.address = socket.getsockopt_string(zmq.LAST_ENDPOINT)  # the real port when bound to "*"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_message: Callable[[str, rpc.Message], None] | None = None
        self._fd = -1
        self._drain_scheduled = False  # a call_soon(_drain) is pending
        self._check_scheduled = False  # a call_soon(_check_events) is pending
        self._draining = False  # inside _drain: sends made by handlers need no extra check

    def start(self, on_message: Callable[[str, rpc.Message], None]) -> None:
        """Deliver every well-formed message to `on_message(identity, message)` from the running loop.

        `on_message` runs inside the reader callback: an exception it raises is logged and the drain goes on."""
        assert self._socket is not None, "socket closed"
        self._loop = asyncio.get_running_loop()
        self._on_message = on_message
        self._fd = self._socket.getsockopt(zmq.FD)
        self._loop.add_reader(self._fd, self._drain)
        self._schedule_drain()  # frames that arrived before the reader was added raised no edge we will see

    def send(self, identity: str, message: rpc.Message) -> zmq.ZMQError | None:
        """Send without waiting; returns the error (EHOSTUNREACH: that worker's connection is gone), if any."""
        socket = self._socket
        if socket is None:
            return None
        try:
            payload = rpc.encode(message)
            # Both frames or neither: a ROUTER queues a message only once its last frame is sent, and with
            # ROUTER_MANDATORY an unroutable identity fails on the first frame.
            socket.send(identity.encode(), _NOBLOCK_SNDMORE)
            socket.send(payload, _NOBLOCK)
        except zmq.ZMQError as exc:
            return exc
        finally:
            if not self._draining and not self._check_scheduled and self._loop is not None:
                self._check_scheduled = True  # this send may have consumed the edge of frames now waiting
                self._loop.call_soon(self._check_events)
        return None

    def _check_events(self) -> None:
        self._check_scheduled = False
        if self._socket is not None and self._socket.getsockopt(_EVENTS) & _POLLIN:
            self._drain()

    def _schedule_drain(self) -> None:
        if not self._drain_scheduled and self._loop is not None:
            self._drain_scheduled = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        """Read until zmq.Again (or a batch), handing each message to `on_message`."""
        self._drain_scheduled = False
        socket = self._socket
        on_message = self._on_message
        if socket is None or on_message is None:
            return
        self._draining = True
        try:
            for _ in range(_MAX_MESSAGES_PER_DRAIN):
                try:
                    frame = socket.recv(_NOBLOCK, copy=False)  # a Frame knows `more` without a getsockopt
                except zmq.Again:
                    break
                frames = [frame.bytes]
                while frame.more:  # the rest of a message is there once its first frame is
                    frame = socket.recv(_NOBLOCK, copy=False)
                    frames.append(frame.bytes)
                decoded = self._decode(frames)
                if decoded is None:
                    continue
                try:
                    on_message(*decoded)
                except Exception:  # one bad message must not stop the reads every call depends on
                    log.exception("failed to handle %s from %r", type(decoded[1]).__name__, decoded[0])
            else:
                self._schedule_drain()  # more may be queued; their edge has already fired
                return
        finally:
            self._draining = False
        # Handlers' sends ran while draining (unchecked); one last look covers frames their sends' edge hid.
        if self._socket is not None and self._socket.getsockopt(_EVENTS) & _POLLIN:
            self._schedule_drain()

    @staticmethod
    def _decode(frames: list[bytes]) -> tuple[str, rpc.Message] | None:
        if len(frames) != 2:
            log.warning("dropping a %d-frame message", len(frames))
            return None
        identity, payload = frames
        try:
            return identity.decode(errors="replace"), rpc.decode(payload)
        except rpc.ProtocolError as exc:
            log.warning("dropping a malformed message from %r: %s", identity, exc)
            return None

    def close(self) -> None:
        if self._socket is not None:
            if self._loop is not None and self._fd >= 0 and not self._loop.is_closed():
                self._loop.remove_reader(self._fd)
            self._socket.close(linger=0)
            self._authenticator.stop()
            self._context.term()
            self._socket = None
            self._on_message = None
