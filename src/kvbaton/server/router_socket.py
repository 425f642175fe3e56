"""The router's end of the RPC: one asyncio zmq ROUTER socket that every worker's DEALER connects to.

Frames are [worker identity, msgpack payload]; malformed ones are logged and skipped here, so the
cluster manager only ever sees decoded `rpc.Message`s. Sends never wait: a frame to a worker whose
connection is gone fails at once (ROUTER_MANDATORY) and the caller decides what that means.
"""

from __future__ import annotations

import logging

import zmq
import zmq.asyncio

from kvbaton.server import rpc

log = logging.getLogger("kvbaton.cluster")


class RouterSocket:
    def __init__(self, bind_address: str) -> None:
        self._context = zmq.asyncio.Context()
        socket = self._context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished worker raises instead of dropping
        socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker with the same id takes over
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, 0)  # never drop or refuse a frame to a live worker; admission bounds the queue
        socket.bind(bind_address)
        self._socket: zmq.asyncio.Socket | None = socket
        self.address = socket.getsockopt_string(zmq.LAST_ENDPOINT)  # the real port when bound to "*"

    def send(self, identity: str, message: rpc.Message) -> zmq.ZMQError | None:
        """Send without waiting; returns the error (EHOSTUNREACH: that worker's connection is gone), if any.

        With NOBLOCK the asyncio socket sends at once and hands back a finished future. Going through it
        (not a synchronous shadow socket) matters: it re-arms the pending recv, whose edge-triggered
        readiness a bare send on the same socket can consume, stalling the receive loop.
        """
        if self._socket is None:
            return None
        future = self._socket.send_multipart([identity.encode(), rpc.encode(message)], flags=zmq.NOBLOCK)
        error = future.exception() if future.done() else None
        return error if isinstance(error, zmq.ZMQError) else None

    async def recv(self) -> tuple[str, rpc.Message]:
        """The next well-formed message and the identity of the worker that sent it."""
        assert self._socket is not None, "socket closed"
        while True:
            frames = await self._socket.recv_multipart()
            if len(frames) != 2:
                log.warning("dropping a %d-frame message", len(frames))
                continue
            identity, payload = frames
            try:
                return identity.decode(errors="replace"), rpc.decode(payload)
            except rpc.ProtocolError as exc:
                log.warning("dropping a malformed message from %r: %s", identity, exc)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._context.term()
            self._socket = None
