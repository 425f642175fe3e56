"""Persistent TCP links carrying length-prefixed frames: the two link ends the tcp and shm transports share.

Wire format (`framing.py`): `u32 little-endian header length | msgpack header | payload`, where only a tcp
`LayerChunk` has a payload (its KV bytes, K then V, in position order; the size follows from the
layout). A link starts with Challenge -> Hello -> Welcome | Rejected: each end proves it holds the
cluster secret (`kvbaton.transfer.link_auth`), so a peer without it is refused before any of its bytes
can reach a block, and a worker with a different KV layout is refused at registration. Handshake frames
are small (at most 64 KiB) and must arrive within `HANDSHAKE_TIMEOUT_S`, so a peer that connects and
stalls holds neither the reader thread nor a socket for long.

`SocketKVReceiver` (decode end) listens and runs one reader thread that accepts links and reads
frames, so KV lands in storage while the engine keeps decoding; the engine drains what arrived with
`poll`. `SocketKVSender` (prefill end) keeps one connection per peer and reads replies in `poll`
on the caller's thread.
"""

from __future__ import annotations

import queue
import select
import socket
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from kvbaton.core.cluster_secret import ClusterSecret
from kvbaton.transfer.base import (
    Delivery,
    KVTransport,
    LayoutRejectedError,
    LinkAuthError,
    PeerLost,
    TransportError,
    check_storage,
)
from kvbaton.transfer.codec import (
    HANDSHAKE_FRAMES,
    Challenge,
    Frame,
    FrameError,
    Hello,
    Rejected,
    Welcome,
    decode,
    layout_to_wire,
)
from kvbaton.transfer.framing import HEADER_LENGTH, recv_frame, send_frame, send_frames, split_frames
from kvbaton.transfer.layout import KVLayout
from kvbaton.transfer.link_auth import NONCE_BYTES, LinkKey, new_nonce
from kvbaton.transfer.messages import LayerChunk, Message

_MAX_HANDSHAKE_BYTES = 1 << 16
HANDSHAKE_TIMEOUT_S = 5.0  # a new link's handshake frames must arrive within this


_RECV_BYTES = 1 << 18  # one read of a payload-less link: a prefill step's control frames fit many times


@dataclass(slots=True)
class _Pending:
    """A link accepted and challenged, its Hello not yet whole."""

    nonce: bytes
    deadline: float  # monotonic; closed then if its Hello has not arrived
    data: bytearray = field(default_factory=bytearray)


@dataclass(slots=True)
class _Link:
    sock: socket.socket
    peer: str
    welcome: Welcome | None = None
    unread: bytearray = field(default_factory=bytearray)  # received bytes of frames not yet complete


class SocketKVReceiver(KVTransport):
    """Decode end: accepts links from prefill workers and delivers their frames (see module docstring)."""

    def __init__(self, name: str, layout: KVLayout, kv: np.ndarray, host: str = "127.0.0.1", port: int = 0,
                 io_timeout_s: float = 30.0, *, secret: ClusterSecret) -> None:
        check_storage(kv, layout)
        self.name, self.layout, self.kv = name, layout, kv
        self.io_timeout_s = io_timeout_s  # a peer stalled this long inside one frame counts as lost
        self._link_key = LinkKey(secret)
        self.num_refused_links = 0  # links that did not prove the cluster secret
        self._listener = socket.create_server((host, port))
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._links: dict[str, _Link] = {}
        self._send_lock = threading.Lock()
        # The reader thread puts a link's frames in batches: one put (one consumer wake-up) per
        # burst of frames, e.g. a prefill step's chunks for every layer plus SourceDone.
        self._inbox: queue.Queue[list[Delivery | PeerLost]] = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=f"kv-receiver-{name}", daemon=True)
        self._thread.start()

    # -- hooks for the tcp / shm variants ---------------------------------------------------------

    # True when a chunk's bytes follow its frame on the link (tcp): frames are then read exactly,
    # so payload bytes go from the kernel straight into their blocks. Links without payloads (shm)
    # are read in large pieces and split into frames here: a burst costs a few syscalls, not 3 a frame.
    streams_payload = False

    def _shm_path(self) -> str:
        return ""

    def _receive_payload(self, sock: socket.socket, chunk: LayerChunk) -> bool:
        """Read the chunk's payload (if this transport has one); False if the link closed meanwhile."""
        return True

    # -- KVTransport --------------------------------------------------------------------------

    def send(self, peer: str, message: Message, source_kv: np.ndarray | None = None) -> None:
        link = self._links.get(peer)
        if link is None:
            raise TransportError(f"{self.name}: no link to {peer}")
        try:
            with self._send_lock:
                send_frame(link.sock, message)
        except OSError as error:
            raise TransportError(f"{self.name}: sending to {peer} failed: {error}") from error

    def poll(self, timeout_s: float) -> list[Delivery | PeerLost]:
        items: list[Delivery | PeerLost] = []
        try:
            items += self._inbox.get(timeout=timeout_s) if timeout_s > 0 else self._inbox.get_nowait()
            while True:
                items += self._inbox.get_nowait()
        except queue.Empty:
            return items

    def disconnect(self, peer: str) -> None:
        link = self._links.get(peer)
        if link is not None:
            # The reader thread sees the end of the stream, closes the socket and reports PeerLost.
            try:
                link.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # the reader thread closed it first: PeerLost is already on its way

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wake_writer.send(b"x")
        self._thread.join(timeout=10.0)
        for sock in (self._listener, self._wake_reader, self._wake_writer):
            sock.close()

    # -- reader thread ----------------------------------------------------------------------------

    def _serve(self) -> None:
        pending: dict[socket.socket, _Pending] = {}  # accepted, Hello not yet complete
        try:
            while not self._closed:
                socks = [self._listener, self._wake_reader, *pending, *(link.sock for link in self._links.values())]
                wait_s = max(0.0, min(entry.deadline for entry in pending.values()) - time.monotonic()) \
                    if pending else None
                readable, _, _ = select.select(socks, [], [], wait_s)
                for sock in readable:
                    if sock is self._wake_reader:
                        return
                    if sock is self._listener:
                        self._accept(pending)
                    elif sock in pending:
                        self._read_hello(sock, pending)
                    else:
                        self._read_available(sock)
                now = time.monotonic()
                for sock in [sock for sock, entry in pending.items() if entry.deadline <= now]:
                    del pending[sock]  # connected and did not finish its Hello in time
                    self._refuse(sock)
        finally:
            for sock in pending:
                sock.close()
            for link in list(self._links.values()):
                link.sock.close()
            self._links.clear()

    def _accept(self, pending: dict[socket.socket, _Pending]) -> None:
        """Take a new connection and challenge it: its Hello must prove the cluster secret over this nonce."""
        conn, _ = self._listener.accept()
        nonce = new_nonce()
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            send_frame(conn, Challenge(nonce))
        except OSError:
            conn.close()
            return
        pending[conn] = _Pending(nonce, time.monotonic() + HANDSHAKE_TIMEOUT_S)

    def _read_hello(self, sock: socket.socket, pending: dict[socket.socket, _Pending]) -> None:
        """Read what a new link sent (the socket is readable, so this never waits) until its Hello is whole: a peer
        that sends it slowly holds only its own socket, never this thread."""
        entry = pending[sock]
        try:
            data = sock.recv(_MAX_HANDSHAKE_BYTES)
        except OSError:
            data = b""
        entry.data += data
        header, have = HEADER_LENGTH.size, len(entry.data)
        length = HEADER_LENGTH.unpack_from(entry.data)[0] if have >= header else None
        if not data or (length is not None and (length > _MAX_HANDSHAKE_BYTES or have > header + length)):
            del pending[sock]  # closed, too long, or more than a Hello before its Welcome
            self._refuse(sock)
            return
        if length is None or have < header + length:
            return  # the rest is on its way
        del pending[sock]
        try:
            hello = decode(bytes(entry.data[header:]))
        except FrameError:
            self._refuse(sock)
            return
        self._handshake(sock, entry.nonce, hello)

    def _refuse(self, sock: socket.socket) -> None:
        self.num_refused_links += 1
        sock.close()

    def _handshake(self, sock: socket.socket, nonce: bytes, hello: Frame) -> None:
        """Link the sender of `hello` only if it proves the cluster secret (checked first) and its layout matches."""
        try:
            if not isinstance(hello, Hello):
                raise FrameError("a link must start with Hello")
            fields = [hello.worker_id, *layout_to_wire(hello.layout)]
            if len(hello.nonce) != NONCE_BYTES or not self._link_key.verify(hello.proof, "hello", nonce, hello.nonce,
                                                                              fields):
                self.num_refused_links += 1  # counted before the peer can read why
                send_frame(sock, Rejected("the link did not prove the cluster secret", "auth"))
                sock.close()
                return
            reason, kind = self.layout.mismatch(hello.layout), "layout"
            if not reason and hello.worker_id in self._links:
                reason, kind = f"worker {hello.worker_id} is already linked", "linked"
            if reason:
                send_frame(sock, Rejected(reason, kind))
                sock.close()
                return
            num_blocks, shm_path = self.kv.shape[2], self._shm_path()
            proof = self._link_key.proof("welcome", nonce, hello.nonce, [self.name, num_blocks, shm_path])
            sock.settimeout(self.io_timeout_s)
            with self._send_lock:
                send_frame(sock, Welcome(self.name, num_blocks, shm_path, proof))
            self._links[hello.worker_id] = _Link(sock, hello.worker_id)
        except (OSError, FrameError):
            self._refuse(sock)

    def _read_available(self, sock: socket.socket) -> None:
        """Read frames from one link while more are already waiting, and hand them over in one put."""
        link = next(link for link in self._links.values() if link.sock is sock)
        batch: list[Delivery | PeerLost] = []
        try:
            while True:
                frames: list[Frame | None] = []
                try:
                    self._read_frames(link, frames)
                    error = ""
                except (OSError, FrameError) as exc:
                    error = f"link error: {exc}"
                for frame in frames:  # the frames before an error still count, as they arrived first
                    if frame is None:
                        batch.append(self._lose(link.peer, "peer closed the link"))
                        return
                    if isinstance(frame, HANDSHAKE_FRAMES):
                        batch.append(self._lose(link.peer, f"unexpected {type(frame).__name__} frame"))
                        return
                    batch.append(Delivery(link.peer, frame))
                if error:
                    batch.append(self._lose(link.peer, error))
                    return
                if not select.select([sock], [], [], 0)[0]:
                    return
        finally:
            if batch:
                self._inbox.put(batch)

    def _read_frames(self, link: _Link, frames: list[Frame | None]) -> None:
        """Append the frames one read completes (None if the link closed); the socket is readable."""
        if self.streams_payload:
            frame = recv_frame(link.sock)
            if isinstance(frame, LayerChunk) and not self._receive_payload(link.sock, frame):
                frame = None
            frames.append(frame)
            return
        data = link.sock.recv(_RECV_BYTES)
        if not data:
            frames.append(None)
            return
        link.unread += data
        split_frames(link.unread, frames)

    def _lose(self, peer: str, reason: str) -> PeerLost:
        """Close the link; the caller delivers the returned PeerLost after the link's earlier frames."""
        link = self._links.pop(peer)
        link.sock.close()
        return PeerLost(peer, reason)


class SocketKVSender(KVTransport):
    """Prefill end: one persistent connection per decode peer; replies are read in `poll`."""

    def __init__(self, name: str, layout: KVLayout, io_timeout_s: float = 30.0, *, secret: ClusterSecret) -> None:
        self.name, self.layout = name, layout
        self.io_timeout_s = io_timeout_s
        self._link_key = LinkKey(secret)
        self._links: dict[str, _Link] = {}
        self._lost: list[PeerLost] = []

    # -- hooks ------------------------------------------------------------------------------------

    def _on_welcome(self, link: _Link) -> None:
        """Set up per-peer state once the receiver accepted the link (shm attaches its region)."""

    def _chunk_payload(self, link: _Link, chunk: LayerChunk, source_kv: np.ndarray) -> list[memoryview]:
        """Check and list the chunk's bytes; what is returned is streamed right after the frame header."""
        return []

    def _place_chunks(self, link: _Link, chunks: list[LayerChunk], source_kv: np.ndarray) -> None:
        """Move the bytes of one write's chunks into the peer's storage before their frames go (shm)."""

    def _on_link_closed(self, link: _Link) -> None:
        """Release per-peer state (shm detaches)."""

    # -- KVTransport --------------------------------------------------------------------------

    def connect(self, address: tuple[str, int], timeout_s: float = 10.0) -> str:
        """Open the persistent link to a decode worker; returns its id. Raises LayoutRejectedError, LinkAuthError
        (either end did not prove the cluster secret) or TransportError."""
        sock: socket.socket | None = None
        try:
            sock = socket.create_connection(address, timeout=timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            challenge = recv_frame(sock, _MAX_HANDSHAKE_BYTES)
            if not isinstance(challenge, Challenge) or len(challenge.nonce) != NONCE_BYTES:
                raise FrameError("the peer did not open with a challenge: not a kvbaton KV receiver")
            nonce = new_nonce()
            proof = self._link_key.proof("hello", challenge.nonce, nonce, [self.name, *layout_to_wire(self.layout)])
            send_frame(sock, Hello(self.name, self.layout, nonce, proof))
            reply = recv_frame(sock, _MAX_HANDSHAKE_BYTES)
        except (OSError, FrameError) as error:
            if sock is not None:
                sock.close()
            raise TransportError(f"{self.name}: cannot link to {address}: {error}") from error
        if not isinstance(reply, Welcome):
            sock.close()
            reason = reply.reason if isinstance(reply, Rejected) else "link closed during the handshake"
            error_type = LinkAuthError if isinstance(reply, Rejected) and reply.kind == "auth" else LayoutRejectedError
            raise error_type(f"{address} refused the link: {reason}")
        if not self._link_key.verify(reply.proof, "welcome", challenge.nonce, nonce,
                                     [reply.worker_id, reply.num_blocks, reply.shm_path]):
            sock.close()
            raise LinkAuthError(f"{address} did not prove the cluster secret: no KV goes to it")
        sock.settimeout(self.io_timeout_s)
        link = _Link(sock, reply.worker_id, reply)
        try:
            self._on_welcome(link)
        except BaseException:
            sock.close()
            raise
        self._links[reply.worker_id] = link
        return reply.worker_id

    def send(self, peer: str, message: Message, source_kv: np.ndarray | None = None) -> None:
        self.send_many(peer, [message], source_kv)

    def send_many(self, peer: str, messages: list[Message], source_kv: np.ndarray | None = None) -> None:
        link = self._links.get(peer)
        if link is None:
            raise TransportError(f"{self.name}: no link to {peer}")
        try:
            frames: list[tuple[Frame, list[memoryview]]] = []
            chunks: list[LayerChunk] = []
            for message in messages:
                payload: list[memoryview] = []
                if isinstance(message, LayerChunk):
                    if source_kv is None:
                        raise TransportError("a layer chunk needs the source KV storage")
                    payload = self._chunk_payload(link, message, source_kv)
                    chunks.append(message)
                frames.append((message, payload))
            if chunks:
                assert source_kv is not None
                self._place_chunks(link, chunks, source_kv)
            send_frames(link.sock, frames)
        except OSError as error:
            self._lose(peer, f"send failed: {error}")
            raise TransportError(f"{self.name}: sending to {peer} failed: {error}") from error

    def poll(self, timeout_s: float) -> list[Delivery | PeerLost]:
        items: list[Delivery | PeerLost] = list(self._lost)
        self._lost.clear()
        wait_s = 0.0 if items else timeout_s
        while self._links:
            by_sock = {link.sock: link for link in self._links.values()}
            readable, _, _ = select.select(list(by_sock), [], [], wait_s)
            if not readable:
                break
            for sock in readable:
                link = by_sock[sock]
                try:
                    frame = recv_frame(sock)
                except (OSError, FrameError) as error:
                    frame, reason = None, f"link error: {error}"
                else:
                    reason = "peer closed the link"
                if frame is None or isinstance(frame, HANDSHAKE_FRAMES):
                    self._lose(link.peer, reason)
                else:
                    items.append(Delivery(link.peer, frame))
            items += self._lost
            self._lost.clear()
            wait_s = 0.0
        return items

    def disconnect(self, peer: str) -> None:
        if peer in self._links:
            self._lose(peer, "link dropped")

    def close(self) -> None:
        for peer in sorted(self._links):
            self._lose(peer, "closed")
        self._lost.clear()

    def _lose(self, peer: str, reason: str) -> None:
        link = self._links.pop(peer)
        try:
            link.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already reset by the peer
        link.sock.close()
        self._on_link_closed(link)
        self._lost.append(PeerLost(peer, reason))
