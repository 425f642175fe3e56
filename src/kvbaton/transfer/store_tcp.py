"""The KV store's cross-host data path: a worker reads a load's blocks over plain TCP, straight into its KV pool.

A same-host worker maps the node's DRAM slots (`kvbaton.transfer.store_slots`) and copies them itself; a
worker on another host (or one told to, `KVBATON_STORE_TRANSPORT=tcp`) cannot, so the node also listens on a
TCP port and streams a lease's slots to it. The control path stays where it was (the store's CurveZMQ socket:
acquire, release); only the bytes move here, unencrypted, as the KV links of `kvbaton.transfer.transport_tcp`
move theirs, and under the same kind of handshake:

    node   -> {nonce_r}                                  16 fresh random bytes
    worker -> {nonce_s, proof}     proof = HMAC(k, "hello", nonce_r, nonce_s, [])
    node   -> {proof}              proof = HMAC(k, "welcome", nonce_r, nonce_s, [])

with k the cluster secret's "kv-store-link" key (`kvbaton.transfer.link_auth`, its own purpose: a KV link's
proof is no use here). The node checks the worker's proof before it reads anything else, so a peer without the
secret never names a lease; the worker checks the node's, so it writes only a real node's bytes into its pool.
Every message is `framing.py`'s `u32 length | msgpack map` (never pickle); then

    worker -> {id, lease}                                read a lease acquired over the control path
    node   -> {id, num_bytes} + the lease's blocks, row by row | {id, error}
    worker -> {id, op: "load", namespace, hashes, remote} acquire, read and release in one trip
    node   -> {id, num_blocks, num_bytes, copies} + those blocks, row by row | {id, error}

A `load` is what a worker with room for the whole chain sends: the node pins the leading blocks it holds
(`acquire`, promoting disk blocks), streams them and lets the pin go itself when the last byte is sent (or the
send failed), so the load costs one round trip on this link and none on the control path. `remote`: the worker
is on another store node's host, so the read counts toward the store's replication rule; `copies` are the
positions of the blocks sent that the rule grants a copy on the worker's node (`kvbaton.cache.kv_store`).

A worker on the node's own host copies from the node's slots itself, so it asks here only for the pin, no bytes:

    worker -> {id, op: "acquire", namespace, hashes}      pin the leading blocks held
    node   -> {id, lease, slots, shm_path}                their DRAM slots in the file it maps | {id, error}
    worker -> {id, op: "release", lease}                  not answered
    worker -> {id, op: "held", namespace, hashes}         how many leading blocks it holds, nothing pinned
    node   -> {id, num_blocks}

the same acquire and release as the control path's, on this link because it is one socket between two threads:
a round trip on it costs this host ~0.2 ms warm and ~0.9 ms after an idle pause, the CurveZMQ one (two more IO
threads woken on each side) ~0.3 and ~1.3 ms, and a same-host load waits on that trip.

The payload is the lease's blocks as the slots hold them, rows first (`[rows, blocks, row bytes]`: each layer's
K, then V, of every block in lease order), so the node sends each run of consecutive slots of a row with one
gathering `sendmsg` entry from its mapping, and the worker scatters each run of consecutive device blocks of a
row into its pool with one `recvmsg_into` entry: no staging buffer on either side, the kernel's copies only. A
read holds the lease busy (`StoreNodeState.begin_read`), so its expiry waits for the read to end, and every
socket has a timeout: a node that dies or stalls mid-read costs the worker at most `timeout_s`.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Sequence

import msgpack

from kvbaton.core.cluster_secret import ClusterSecret
from kvbaton.transfer.framing import HEADER_LENGTH, recv_exact_into, recv_into_buffers, send_buffers
from kvbaton.transfer.link_auth import NONCE_BYTES, LinkKey, new_nonce
from kvbaton.transfer.store_slots import StoreSlots

log = logging.getLogger("kvbaton.store")

STORE_LINK_PURPOSE = "kv-store-link"
MAX_MESSAGE_BYTES = 1 << 16  # every message here is a small map
HANDSHAKE_TIMEOUT_S = 5.0
SOCKET_BUFFER_BYTES = 8 << 20  # few, large reads and writes: fewer trips through the GIL


class StoreLinkError(OSError):
    """The TCP link to a store node failed: refused, closed, timed out, or the peer's proof or answer was wrong."""


def send_message(sock: socket.socket, message: dict, payload: Sequence[memoryview] = ()) -> None:
    body = msgpack.packb(message, use_bin_type=True)
    send_buffers(sock, [memoryview(HEADER_LENGTH.pack(len(body)) + body), *payload])


def recv_message(sock: socket.socket) -> dict | None:
    """The next message, None when the peer closed the link; StoreLinkError when it is not a small msgpack map."""
    prefix = bytearray(HEADER_LENGTH.size)
    if not recv_exact_into(sock, memoryview(prefix)):
        return None
    (length,) = HEADER_LENGTH.unpack(prefix)
    if length > MAX_MESSAGE_BYTES:
        raise StoreLinkError(f"a store link message of {length} bytes")
    body = bytearray(length)
    if not recv_exact_into(sock, memoryview(body)):
        return None
    try:
        message = msgpack.unpackb(bytes(body), raw=False, strict_map_key=True)
    except (msgpack.UnpackException, ValueError) as exc:
        raise StoreLinkError(f"a store link message is not msgpack: {exc}") from exc
    if not isinstance(message, dict):
        raise StoreLinkError("a store link message must be a map")
    return message


def row_views(rows: object, indices: Sequence[int]) -> list[memoryview]:
    """`rows` (`[rows, items, row bytes]`, uint8) through `indices`, in wire order: for each row, each run of
    consecutive indices as one view."""
    runs: list[tuple[int, int]] = []
    for index in indices:
        if runs and index == runs[-1][0] + runs[-1][1]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((index, 1))
    views: list[memoryview] = []
    for row in rows:  # type: ignore[attr-defined]
        views += [memoryview(row[start : start + num]).cast("B") for start, num in runs]
    return views


def _tune(sock: socket.socket, timeout_s: float) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
    sock.settimeout(timeout_s)


class StoreTcpServer:
    """The node's end: accepts links on `host`, one thread per link, and streams leased slots.

    `begin_read(lease)` -> the lease's slots (marking it busy) or None; `end_read(lease)` ends the read. Both are
    the node's (`StoreNodeState`), called under the node's lock by `locked`."""

    def __init__(self, slots: Callable[[], StoreSlots], begin_read: Callable[[int], list[int] | None],
                 end_read: Callable[[int], None], locked: Callable[[], threading.Lock], secret: ClusterSecret,
                 host: str = "127.0.0.1", port: int = 0, timeout_s: float = 10.0,
                 acquire: Callable[[dict], int] | None = None, release: Callable[[int], None] | None = None,
                 pin: Callable[[dict], dict] | None = None, settle: Callable[[], None] | None = None,
                 held: Callable[[dict], int] | None = None) -> None:
        """`acquire(request)`: a `load`'s lease (0: nothing held; raises ValueError on a bad request) and the
        positions of its blocks granted a copy on the reader's node (`copies`), and
        `release(lease)`; `pin(request)`: an `acquire` op's answer (`lease`, `slots`, `shm_path`), and `settle()`,
        called once that answer is sent (the node prices the blocks after answering); `held(request)`: how many
        leading blocks of a chain the node holds; all the node's, called under `locked`."""
        self._slots, self._begin_read, self._end_read, self._locked = slots, begin_read, end_read, locked
        self._acquire, self._release, self._pin, self._settle, self._held = acquire, release, pin, settle, held
        self._key = LinkKey(secret, STORE_LINK_PURPOSE)
        self._timeout_s = timeout_s
        self._listener = socket.create_server((host, port))
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._links: set[socket.socket] = set()
        self._links_lock = threading.Lock()
        self.num_refused = self.num_reads = self.num_sent_bytes = 0
        self._thread = threading.Thread(target=self._accept, name="kv-store-tcp", daemon=True)

    def start(self) -> StoreTcpServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Close the listener and every link (a worker mid-read sees its link fail at once)."""
        self._stop.set()
        self._thread.join(timeout=5)
        with self._links_lock:
            for sock in self._links:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()
            self._links.clear()

    def _accept(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    sock, _ = self._listener.accept()
                except TimeoutError:
                    continue
                except OSError:
                    return
                with self._links_lock:
                    self._links.add(sock)
                threading.Thread(target=self._serve, args=(sock,), name="kv-store-tcp-link", daemon=True).start()
        finally:
            self._listener.close()

    def _serve(self, sock: socket.socket) -> None:
        try:
            _tune(sock, HANDSHAKE_TIMEOUT_S)
            try:
                welcomed = self._handshake(sock)
            except (OSError, ValueError):
                welcomed = False
            if not welcomed:  # closed before it could name a lease
                self.num_refused += 1
                return
            sock.settimeout(self._timeout_s)
            while not self._stop.is_set():
                request = recv_message(sock)
                if request is None:
                    return
                self._read(sock, request)
        except (OSError, ValueError) as exc:
            log.debug("store link closed: %s", exc)
        finally:
            with self._links_lock:
                self._links.discard(sock)
            sock.close()

    def _handshake(self, sock: socket.socket) -> bool:
        nonce_r = new_nonce()
        send_message(sock, {"nonce": nonce_r})
        hello = recv_message(sock)
        nonce_s = hello.get("nonce") if hello else None
        proof = hello.get("proof") if hello else None
        if not (isinstance(nonce_s, bytes) and len(nonce_s) == NONCE_BYTES and isinstance(proof, bytes)
                and self._key.verify(proof, "hello", nonce_r, nonce_s, [])):
            return False
        send_message(sock, {"proof": self._key.proof("welcome", nonce_r, nonce_s, [])})
        return True

    def _load(self, sock: socket.socket, request: dict) -> None:
        if self._acquire is None or self._release is None:
            send_message(sock, {"id": request.get("id"), "error": "this node serves no loads"})
            return
        try:
            with self._locked():
                lease, copies = self._acquire(request)
                slots = self._begin_read(lease) if lease else []
        except (ValueError, TypeError, KeyError) as exc:
            send_message(sock, {"id": request.get("id"), "error": str(exc)[:200]})
            return
        try:
            mapping = self._slots()
            num_bytes = len(slots or []) * mapping.block_bytes
            send_message(sock, {"id": request.get("id"), "num_blocks": len(slots or []), "num_bytes": num_bytes,
                                "copies": copies if slots else []}, row_views(mapping.rows, slots or []))
            self.num_reads += 1
            self.num_sent_bytes += num_bytes
        finally:
            if lease:
                with self._locked():
                    self._end_read(lease)
                    self._release(lease)

    def _control(self, sock: socket.socket, request: dict) -> None:
        """A same-host worker's pin (answered) or release (not answered; a lease it does not hold is no error), or
        any worker's question how much of a chain the node holds (answered)."""
        op = request["op"]
        pins = self._pin is not None and self._release is not None
        if op == "release":
            lease = request.get("lease")
            if pins and isinstance(lease, int):
                with self._locked():
                    self._release(lease)  # type: ignore[misc]
            return
        if op == "held":
            held = self._held
            answer = (lambda request: {"num_blocks": held(request)}) if held is not None else None
            refusal = "this node answers no held"
        else:
            answer, refusal = (self._pin if pins else None), "this node pins no blocks over TCP"
        try:
            if answer is None:
                raise ValueError(refusal)
            with self._locked():
                reply = answer(request)
        except (ValueError, TypeError, KeyError) as exc:
            send_message(sock, {"id": request.get("id"), "error": str(exc)[:200]})
            return
        send_message(sock, {"id": request.get("id"), **reply})
        if op == "acquire" and self._settle is not None:  # the node prices the blocks once its answer is out
            with self._locked():
                self._settle()

    def _read(self, sock: socket.socket, request: dict) -> None:
        op = request.get("op")
        if op == "load":
            self._load(sock, request)
            return
        if op in ("acquire", "release", "held"):
            self._control(sock, request)
            return
        lease = request.get("lease")
        if not isinstance(lease, int):
            send_message(sock, {"id": request.get("id"), "error": "a read names a lease"})
            return
        with self._locked():
            slots = self._begin_read(lease)
        if slots is None:
            send_message(sock, {"id": request.get("id"), "error": f"no lease {lease}"})
            return
        try:
            mapping = self._slots()
            views = row_views(mapping.rows, slots)
            num_bytes = len(slots) * mapping.block_bytes
            send_message(sock, {"id": request.get("id"), "num_bytes": num_bytes}, views)
            self.num_reads += 1
            self.num_sent_bytes += num_bytes
        finally:
            with self._locked():
                self._end_read(lease)


class StoreTcpLink:
    """The worker's end of one link to a node (one thread uses it): `read_into` a lease's blocks, `load_into` a
    chain's in one trip, and a same-host worker's `acquire` and `release`."""

    def __init__(self, host: str, port: int, secret: ClusterSecret, timeout_s: float = 10.0) -> None:
        key = LinkKey(secret, STORE_LINK_PURPOSE)
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as exc:
            raise StoreLinkError(f"cannot reach the store node's TCP port {host}:{port}: {exc}") from exc
        try:
            _tune(self._sock, timeout_s)
            challenge = recv_message(self._sock)
            nonce_r = challenge.get("nonce") if challenge else None
            if not (isinstance(nonce_r, bytes) and len(nonce_r) == NONCE_BYTES):
                raise StoreLinkError("the store node sent no challenge")
            nonce_s = new_nonce()
            send_message(self._sock, {"nonce": nonce_s, "proof": key.proof("hello", nonce_r, nonce_s, [])})
            welcome = recv_message(self._sock)
            proof = welcome.get("proof") if welcome else None
            if not (isinstance(proof, bytes) and key.verify(proof, "welcome", nonce_r, nonce_s, [])):
                raise StoreLinkError("the store node refused the link or could not prove it holds the secret")
        except BaseException:
            self._sock.close()
            raise
        self._ids = 0
        self._awaited: set[int] = set()  # calls sent whose answers have not been read
        self._early: dict[int, dict] = {}  # answers read before their calls asked for them
        self.num_read_bytes = 0

    def read_into(self, lease: int, buffers: list[memoryview]) -> None:
        """The lease's blocks into `buffers` (their wire order: `row_views` of the destination); raises
        StoreLinkError (the link is then unusable) when the node refuses, closes or stalls."""
        try:
            self._receive(buffers, self._ask({"lease": lease}, "read"), "read")
        except OSError as exc:
            raise StoreLinkError(f"the store link failed: {exc}") from exc

    def load_into(self, namespace: Sequence[str], block_hashes: Sequence[int],
                  buffers_for: Callable[[int], list[memoryview]], copies: list[int] | None = None) -> int:
        """Acquire, read and release in one trip: the leading blocks the node holds of `block_hashes` into
        `buffers_for(n)` (their wire order); returns n. `copies` (a list): this worker is on another store node's
        host (the read counts toward the replication rule), and the positions of the blocks read that the node
        grants a copy on this worker's node are appended. Raises StoreLinkError as `read_into` does."""
        try:
            request = {"op": "load", "namespace": list(namespace), "hashes": list(block_hashes)}
            if copies is not None:
                request["remote"] = True
            reply = self._ask(request, "load")
            num_blocks, granted = reply.get("num_blocks"), reply.get("copies", [])
            if not isinstance(num_blocks, int) or not 0 <= num_blocks <= len(block_hashes):
                raise StoreLinkError(f"the store node answers {num_blocks!r} blocks of {len(block_hashes)}")
            if not (isinstance(granted, list) and all(isinstance(i, int) and 0 <= i < num_blocks for i in granted)):
                raise StoreLinkError("the store node's copies are malformed")
            if copies is not None:
                copies.extend(granted)
            self._receive(buffers_for(num_blocks) if num_blocks else [], reply, "load")
        except OSError as exc:
            raise StoreLinkError(f"the store link failed: {exc}") from exc
        return num_blocks

    def acquire(self, namespace: Sequence[str], block_hashes: Sequence[int]) -> tuple[int, list[int], str]:
        """Pin the leading blocks the node holds of `block_hashes` (no bytes move): (lease, their slots, the file the
        slots are in); lease 0 and no slots when none. Raises StoreLinkError as `read_into` does."""
        return self.end_acquire(self.begin_acquire(namespace, block_hashes), len(block_hashes))

    def begin_acquire(self, namespace: Sequence[str], block_hashes: Sequence[int]) -> int:
        """Send an acquire without waiting for its answer: its id, for `end_acquire`. Other calls may come between
        (the node answers in order; an answer not yet asked for is kept)."""
        self._ids += 1
        try:
            send_message(self._sock, {"id": self._ids, "op": "acquire", "namespace": list(namespace),
                                      "hashes": list(block_hashes)})
        except OSError as exc:
            raise StoreLinkError(f"the store link failed: {exc}") from exc
        self._awaited.add(self._ids)
        return self._ids

    def end_acquire(self, call_id: int, num_hashes: int) -> tuple[int, list[int], str]:
        """The answer to `begin_acquire`'s call `call_id` (of `num_hashes` hashes), as `acquire` returns it."""
        try:
            reply = self._reply(call_id, "acquire")
        except OSError as exc:
            raise StoreLinkError(f"the store link failed: {exc}") from exc
        lease, slots, shm_path = reply.get("lease"), reply.get("slots"), reply.get("shm_path")
        if not (isinstance(lease, int) and isinstance(slots, list) and len(slots) <= num_hashes
                and all(isinstance(slot, int) for slot in slots) and isinstance(shm_path, str)):
            raise StoreLinkError("the store node's answer to an acquire is malformed")
        return lease, slots, shm_path

    def held(self, namespace: Sequence[str], block_hashes: Sequence[int]) -> int:
        """How many leading blocks of `block_hashes` the node holds (in any tier), nothing pinned."""
        try:
            reply = self._ask({"op": "held", "namespace": list(namespace), "hashes": list(block_hashes)}, "held")
        except OSError as exc:
            raise StoreLinkError(f"the store link failed: {exc}") from exc
        num_blocks = reply.get("num_blocks")
        if not isinstance(num_blocks, int) or not 0 <= num_blocks <= len(block_hashes):
            raise StoreLinkError(f"the store node answers {num_blocks!r} blocks held of {len(block_hashes)}")
        return num_blocks

    def release(self, lease: int) -> None:
        """Let the pin go (not answered). Raises StoreLinkError when the link is broken."""
        self._ids += 1
        try:
            send_message(self._sock, {"id": self._ids, "op": "release", "lease": lease})
        except OSError as exc:
            raise StoreLinkError(f"the store link failed: {exc}") from exc

    def _ask(self, request: dict, what: str) -> dict:
        """Send `request` under the next id and return the node's answer to it (its header: the bytes follow)."""
        self._ids += 1
        send_message(self._sock, {"id": self._ids, **request})
        self._awaited.add(self._ids)
        return self._reply(self._ids, what)

    def _reply(self, call_id: int, what: str) -> dict:
        """The answer to call `call_id`: kept already, or the next ones read until it comes, the answers to earlier
        calls sent without waiting (`begin_acquire`, no bytes follow them) kept for their `end_acquire`."""
        reply = self._early.pop(call_id, None)
        while reply is None:
            got = recv_message(self._sock)
            got_id = got.get("id") if got is not None else None
            if not (isinstance(got_id, int) and got_id in self._awaited and got_id <= call_id):
                raise StoreLinkError("the store node closed the link or answered out of turn")
            if got_id == call_id:
                reply = got
            else:
                self._early[got_id] = got
        self._awaited.discard(call_id)
        if "error" in reply:
            raise StoreLinkError(f"the store node refused the {what}: {str(reply['error'])[:200]}")
        return reply

    def _receive(self, buffers: list[memoryview], reply: dict, what: str) -> None:
        """The bytes `reply` announced into `buffers`, which must hold exactly that many."""
        expected = sum(len(buffer) for buffer in buffers)
        if reply.get("num_bytes") != expected:
            raise StoreLinkError(f"the store node sends {reply.get('num_bytes')} bytes, {expected} expected")
        if not recv_into_buffers(self._sock, buffers):
            raise StoreLinkError(f"the store node closed the link mid-{what}")
        self.num_read_bytes += expected

    def close(self) -> None:
        self._sock.close()
