"""A worker's (or router's) connection to its host's KV store node (`kvbaton.server.store_server`): the engine's `StoreLink`.

**Several nodes.** `StoreNodes` is the `StoreLink` of a worker in a cluster of several store nodes (one per host):
its own host's node takes every save and is read first (shared memory), the others are `remote_nodes`, which a
load continues from over their TCP ports for the blocks its own node lacks (`kvbaton.engine.store_io`).

One zmq DEALER under CurveZMQ (the store channel's key pairs, from the cluster secret), and the node's TCP link
(`kvbaton.transfer.store_tcp`, opened on first use), used by one thread only (the worker's store IO thread,
`kvbaton.engine.store_io`). Saves are sent on the control socket without waiting and dropped, never queued
without bound, when its send queue is full (`put` says so); `acquire` and `release` go on the TCP link (a
load waits on the acquire's trip, and that link's is the shorter); a call waits at most `timeout_s` for its
answer and raises `StoreUnavailable` otherwise. After a failure the node is
taken as down for `retry_after_s`: every call in that window fails at once, so a dead store node costs each
request at most one timeout and then nothing (they recompute).

**Which data path.** `hello` answers the node's host id: a worker on the same host (same id) maps the node's
shared-memory slots and copies them itself; one on another host reads the leased slots over the node's TCP
port (`kvbaton.transfer.store_tcp`, `read_into`). `transport` ("auto", "shm" or "tcp"; by default the
`KVBATON_STORE_TRANSPORT` environment variable, else "auto") forces one, so tests and benchmarks on one host
run the cross-host path on 127.0.0.1.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

import msgpack
import zmq

from kvbaton.cache.kv_store import StoreEvent, capacity_blocks
from kvbaton.core.cluster_secret import ClusterSecret
from kvbaton.core.errors import InvalidRequestError
from kvbaton.engine.store_io import StoreUnavailable
from kvbaton.server.rpc_auth import secure_dealer
from kvbaton.server.store_node import StoreNodeState
from kvbaton.server.store_server import STORE_CHANNEL, StoreServer, disk_tier
from kvbaton.transfer.store_slots import UNLEASED_READS, host_id
from kvbaton.transfer.store_tcp import StoreLinkError, StoreTcpLink

TRANSPORT_ENV = "KVBATON_STORE_TRANSPORT"
TRANSPORTS = ("auto", "shm", "tcp")


class StoreClient:
    remote_nodes: tuple[StoreClient, ...] = ()  # one node: none but itself

    def __init__(self, address: str, secret: ClusterSecret, timeout_s: float = 10.0, retry_after_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, max_queued_messages: int = 256,
                 transport: str | None = None, unleased_reads: bool = True) -> None:
        """`unleased_reads`: a same-host worker copies the blocks the node's slot index shows without acquiring them
        first (`kvbaton.transfer.store_slots`; where the machine allows); False: every load acquires a lease."""
        transport = transport or os.environ.get(TRANSPORT_ENV) or "auto"
        self.unleased_reads = unleased_reads
        if transport not in TRANSPORTS:
            raise ValueError(f"a store transport is one of {TRANSPORTS}, got {transport!r}")
        self.transport = transport
        self.address = address
        self._secret = secret
        self._tcp: StoreTcpLink | None = None
        self._tcp_port = 0
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self._clock = clock
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, max_queued_messages)
        secure_dealer(self._socket, secret, STORE_CHANNEL)
        self._socket.connect(address)
        self._ids = itertools.count(1)
        self._down_until = 0.0

    def hello(self) -> dict:
        """The node's slots (`shm_path`, `block_bytes`, `num_slots`, `num_rows`) and `transport`: "shm" when this
        process maps them, "tcp" when it reads them over the node's TCP port; `unleased_reads`: whether it may copy
        what the slot index shows without a lease."""
        reply = self._call({"op": "hello"})
        self._tcp_port = int(reply.get("tcp_port", 0))
        same_host = reply.get("host_id") == host_id()
        transport = self.transport if self.transport != "auto" else ("shm" if same_host else "tcp")
        if transport == "shm" and not same_host:
            raise StoreUnavailable(f"store node {self.address} is on another host: its slots cannot be mapped")
        return {"shm_path": str(reply["shm_path"]), "block_bytes": int(reply["block_bytes"]),
                "num_slots": int(reply["num_slots"]), "num_rows": int(reply["num_rows"]), "transport": transport,
                "unleased_reads": self.unleased_reads and transport == "shm" and UNLEASED_READS}

    def read_into(self, lease: int, buffers: list[memoryview]) -> None:
        """A lease's blocks over the node's TCP port into `buffers` (wire order, `store_tcp.row_views`). The link is
        opened on first use and again after a failure; raises StoreUnavailable."""
        self._over_tcp(lambda link: link.read_into(lease, buffers))

    def load_into(self, namespace: Sequence[str], block_hashes: Sequence[int],
                  buffers_for: Callable[[int], list[memoryview]], copies: list[int] | None = None) -> int:
        """Acquire, read and release over the node's TCP port in one trip (`StoreTcpLink.load_into`): the leading
        blocks held into `buffers_for(n)`; returns n (`copies`: as there). Raises StoreUnavailable."""
        return self._over_tcp(lambda link: link.load_into(namespace, block_hashes, buffers_for, copies))

    def _over_tcp(self, call: Callable[[StoreTcpLink], object]) -> object:
        """`call` on the TCP link, opened first if need be. A link opened before that breaks without timing out
        (the node restarted: it listens on another port now, or closed its links) is opened again once at once, so
        a restart costs no load; any other failure takes the node as down for `retry_after_s`."""
        now = self._clock()
        if now < self._down_until:
            raise StoreUnavailable(f"store node {self.address} is down (retrying in {self._down_until - now:.1f} s)")
        reopen = self._tcp is not None
        while True:
            try:
                if self._tcp is None:
                    self._probe()  # a dead node is known at once, not after a hello's whole timeout
                    self.hello()  # the node's TCP port now (a restarted node listens on another)
                    self._tcp = StoreTcpLink(urlsplit(self.address).hostname or "127.0.0.1", self._tcp_port,
                                             self._secret, self.timeout_s)
                return call(self._tcp)
            except (StoreLinkError, OSError, StoreUnavailable) as exc:
                self._drop_tcp()
                if reopen and isinstance(exc, StoreLinkError) and not isinstance(exc.__cause__, TimeoutError):
                    reopen = False
                    continue
                self._down_until = self._clock() + self.retry_after_s
                raise StoreUnavailable(str(exc)) from exc

    def _drop_tcp(self) -> None:
        """Close the TCP link (it broke): the next call opens another."""
        if self._tcp is not None:
            self._tcp.close()
            self._tcp = None

    def _probe(self) -> None:
        """Raise StoreLinkError unless the node's control port takes a TCP connection within a second: before the
        link is opened (first, or again after it broke), so a node that died costs a load no more than that
        (refused at once on its host; a second for a host that is down), where a hello to it waits its whole
        `timeout_s` (zmq reconnects in the background, unseen)."""
        parts = urlsplit(self.address)
        try:
            socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 0),
                                     timeout=min(self.timeout_s, 1.0)).close()
        except OSError as exc:
            raise StoreLinkError(f"store node {self.address} takes no connection: {exc}") from exc

    def put(self, namespace: Sequence[str], parent_hash: int, block_hashes: Sequence[int],
            payloads: Sequence[memoryview], replica: bool = False) -> bool:
        header = {"op": "put", "namespace": list(namespace), "parent": parent_hash, "hashes": list(block_hashes),
                  "replica": replica}
        return self._send([msgpack.packb(header), *payloads])

    def touch(self, namespace: Sequence[str], block_hashes: Sequence[int]) -> bool:
        """Tell the node these blocks were copied from its slots unleased (a use each for its eviction), not waiting;
        False when dropped (the send queue full, or the node taken as down)."""
        return self._send([msgpack.packb({"op": "touch", "namespace": list(namespace), "hashes": list(block_hashes)})])

    def acquire(self, namespace: Sequence[str], block_hashes: Sequence[int]) -> tuple[int, list[int], str]:
        """On the node's TCP link (`StoreTcpLink.acquire`): one socket between this thread and the node's, where the
        CurveZMQ socket's trip wakes two IO threads more on each side, which a load waits on."""
        return self._over_tcp(lambda link: link.acquire(namespace, block_hashes))  # type: ignore[return-value]

    def held(self, namespace: Sequence[str], block_hashes: Sequence[int]) -> int:
        """How many leading blocks of the chain the node holds, nothing pinned (on the TCP link)."""
        return self._over_tcp(lambda link: link.held(namespace, block_hashes))  # type: ignore[return-value]

    def begin_acquire(self, namespace: Sequence[str], block_hashes: Sequence[int]) -> object | None:
        """Send an acquire on the TCP link without waiting (the IO thread's next load, while it copies this one): a
        token for `end_acquire`, or None when the link is not up (that load then acquires as usual). Never raises."""
        if self._tcp is None or self._clock() < self._down_until:
            return None
        try:
            return (self._tcp, self._tcp.begin_acquire(namespace, block_hashes), namespace, list(block_hashes))
        except StoreLinkError:
            self._drop_tcp()
            return None

    def end_acquire(self, token: object) -> tuple[int, list[int], str]:
        """`acquire`'s answer to `begin_acquire`'s call. Its link gone since (broken, or reopened), the acquire is
        asked again on a fresh one (what the node pinned for the lost answer expires with its lease); a link that
        timed out takes the node as down, as `acquire` does."""
        link, call_id, namespace, block_hashes = token  # type: ignore[misc]
        # `_over_tcp`'s reopening once of a link that broke is the asking again on a fresh one
        return self._over_tcp(lambda tcp: tcp.end_acquire(call_id, len(block_hashes)) if tcp is link  # type: ignore
                              else tcp.acquire(namespace, block_hashes))

    def release(self, lease: int) -> bool:
        """On the TCP link while it is up, else on the control socket, and sent there even while the node is taken
        as down (a failed TCP read leaves the control path up): a pin is let go as soon as the node can hear it, not
        when its lease expires."""
        if self._tcp is not None:
            try:
                self._tcp.release(lease)
                return True
            except StoreLinkError:
                self._drop_tcp()
        return self._send([msgpack.packb({"op": "release", "lease": lease})], even_if_down=True)

    def stats(self) -> dict:
        return self._call({"op": "stats"})

    def clear(self) -> int:
        """Drop every block the node holds that no load pins; returns how many."""
        return int(self._call({"op": "clear"})["num_cleared"])

    def events_since(self, seq: int) -> dict:
        return self._call({"op": "events", "since": seq})

    def close(self) -> None:
        if self._tcp is not None:
            self._tcp.close()
        self._socket.close()
        self._context.term()

    def _send(self, frames: list, even_if_down: bool = False) -> bool:
        if self._clock() < self._down_until and not even_if_down:
            return False
        try:
            self._socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    def _call(self, header: dict) -> dict:
        now = self._clock()
        if now < self._down_until:
            raise StoreUnavailable(f"store node {self.address} is down (retrying in {self._down_until - now:.1f} s)")
        call_id = header["id"] = next(self._ids)
        deadline = now + self.timeout_s
        if not self._send([msgpack.packb(header)]):
            self._down_until = self._clock() + self.retry_after_s
            raise StoreUnavailable(f"store node {self.address} takes no messages")
        return self._wait(call_id, deadline)

    def _wait(self, call_id: int, deadline: float) -> dict:
        while True:
            left_ms = int((deadline - self._clock()) * 1000)
            if left_ms <= 0 or not self._socket.poll(left_ms):
                self._down_until = self._clock() + self.retry_after_s
                raise StoreUnavailable(f"store node {self.address} did not answer within {self.timeout_s} s")
            reply = msgpack.unpackb(self._socket.recv(), raw=False)
            if isinstance(reply, dict) and reply.get("id") != call_id:  # a late answer to a call given up
                if reply.get("lease"):
                    self.release(int(reply["lease"]))  # nobody copies what it pinned: let it go now
                continue
            if isinstance(reply, dict):
                if "error" in reply:
                    raise StoreUnavailable(f"store node {self.address}: {reply['error']}")
                self._down_until = 0.0
                return reply


class LocalStoreNode:
    """A store node on a thread of this process, on 127.0.0.1 under a secret of its own: an offline `LLM`'s
    (`kvbaton.llm`, `kv_store_gb`), the DRAM tier past its KV pool (and disk past that, `disk` "DIR:GB"), with
    the live data path's asynchronous loads and saves. `link` is its engine's connection (built on the store IO
    thread); `stop` ends the node and frees its shared memory."""

    def __init__(self, block_bytes: int, block_tokens: int, block_rows: int, dram_gb: float, disk: str = "") -> None:
        dram_blocks = capacity_blocks(dram_gb, block_bytes)
        if dram_blocks < 1:
            raise InvalidRequestError(f"kv_store_gb {dram_gb:g} holds no KV block ({block_bytes} bytes each)")
        disk_files = disk_tier(disk, block_bytes) if disk else None
        self.secret = ClusterSecret.generate()
        self.server = StoreServer(StoreNodeState(block_bytes, block_tokens, dram_blocks, disk_files,
                                                 block_rows=block_rows), self.secret)
        self.address = self.server.address
        # Stopped at interpreter exit too, when the owner never calls `stop` (an `LLM` left unclosed): the node's
        # thread is a daemon, and a daemon killed at exit would leave its DRAM file in /dev/shm.
        self._stop = weakref.finalize(self, _stop_thread, self.server, self.server.start_thread())

    def link(self) -> StoreClient:
        return StoreClient(self.address, self.secret)

    def stop(self) -> None:
        """Idempotent."""
        self._stop()


def _stop_thread(server: StoreServer, thread: threading.Thread) -> None:
    server.stop()
    thread.join(timeout=10)


class KnownStoreNodes:
    """The cluster's store nodes a worker knows of: its flags' (`--kv-store-nodes`) and those its routers name
    (`rpc.StoreNodesKnown`, at registration and whenever a worker on another host names a new one). Added to on the
    worker's thread, read by its store IO thread; never shrinks (a dead node is passed over by its down-window)."""

    def __init__(self, addresses: Sequence[str] = ()) -> None:
        self._lock = threading.Lock()
        self._addresses = dict.fromkeys(address for address in addresses if address)

    def add(self, addresses: Sequence[str]) -> bool:
        """True when any of `addresses` is new."""
        with self._lock:
            new = [address for address in addresses if address and address not in self._addresses]
            self._addresses.update(dict.fromkeys(new))
            return bool(new)

    def addresses(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._addresses)


class StoreNodes:
    """A worker's link to the cluster's store nodes (a `StoreLink`): `local`, its host's node, takes every save and
    answers hello, acquire and release (what the worker maps, on its host); every other address in `nodes` (a list,
    or the `KnownStoreNodes` its routers add to) is one of `remote_nodes`, a `StoreClient` read over its TCP port only
    (`load_into`; opened on first use, on the store IO thread), each with its own down-window: a dead node costs a load
    at most one timeout, then nothing until it is retried. A dead local node drops the saves (never sent to another
    node: a block lives where its writer's host is) while loads still reach the others."""

    def __init__(self, local: str, nodes: Sequence[str] | KnownStoreNodes, secret: ClusterSecret,
                 timeout_s: float = 10.0, retry_after_s: float = 5.0, transport: str | None = None,
                 unleased_reads: bool = True) -> None:
        self.local = StoreClient(local, secret, timeout_s, retry_after_s, transport=transport,
                                 unleased_reads=unleased_reads)
        self._known = nodes if isinstance(nodes, KnownStoreNodes) else KnownStoreNodes(nodes)
        self._remotes: dict[str, StoreClient] = {}
        self._num_known = 0
        self._secret, self._timeout_s, self._retry_after_s = secret, timeout_s, retry_after_s
        self.address = local

    @property
    def remote_nodes(self) -> tuple[StoreClient, ...]:
        """Every known node but the local one, in the order they became known."""
        addresses = self._known.addresses()
        for address in addresses[self._num_known:]:
            if address != self.address and address not in self._remotes:
                self._remotes[address] = StoreClient(address, self._secret, self._timeout_s, self._retry_after_s,
                                                     transport="tcp")
        self._num_known = len(addresses)
        return tuple(self._remotes.values())

    def hello(self) -> dict:
        return self.local.hello()

    def put(self, namespace: Sequence[str], parent_hash: int, block_hashes: Sequence[int],
            payloads: Sequence[memoryview], replica: bool = False) -> bool:
        return self.local.put(namespace, parent_hash, block_hashes, payloads, replica)

    def acquire(self, namespace: Sequence[str], block_hashes: Sequence[int]) -> tuple[int, list[int], str]:
        return self.local.acquire(namespace, block_hashes)

    def touch(self, namespace: Sequence[str], block_hashes: Sequence[int]) -> bool:
        return self.local.touch(namespace, block_hashes)

    def begin_acquire(self, namespace: Sequence[str], block_hashes: Sequence[int]) -> object | None:
        return self.local.begin_acquire(namespace, block_hashes)

    def held(self, namespace: Sequence[str], block_hashes: Sequence[int]) -> int:
        return self.local.held(namespace, block_hashes)

    def end_acquire(self, token: object) -> tuple[int, list[int], str]:
        return self.local.end_acquire(token)

    def read_into(self, lease: int, buffers: list[memoryview]) -> None:
        self.local.read_into(lease, buffers)

    def load_into(self, namespace: Sequence[str], block_hashes: Sequence[int],
                  buffers_for: Callable[[int], list[memoryview]], copies: list[int] | None = None) -> int:
        return self.local.load_into(namespace, block_hashes, buffers_for, copies)

    def release(self, lease: int) -> bool:
        return self.local.release(lease)

    def stats(self) -> dict:
        return self.local.stats()

    def clear(self) -> int:
        """The local node's (`StoreClient.clear`): the other nodes' are emptied by their own hosts' workers."""
        return self.local.clear()

    def close(self) -> None:
        for client in (self.local, *self._remotes.values()):
            client.close()


class StoreEventFeed:
    """A router's reader of one store node's events, on a thread of its own (its calls may wait on a dead node):
    every `interval_s` it asks for what came after the last seq it had, and hands the events (or a snapshot, when
    the node's log no longer reaches back) to `deliver(events, is_snapshot)`, which the caller runs on its own
    thread (the router's event loop: `loop.call_soon_threadsafe`). Any number of routers may each run one. A node with
    a disk also answers its disk reads' cumulative (bytes, seconds): each time they move they go to `on_disk_reads`
    (called the same way), which the router measures the disk's speed from.

    A node that has not answered for `lost_after_s` is lost: `on_lost()` once (the router takes its blocks out of
    its directory, so no load is planned from them), and the feed asks it from the start when it answers again.
    A node that answers under another epoch than before restarted (however quickly): what it held is gone and its
    seqs begin again, so the same `on_lost()`, and the feed asks it from the start."""

    def __init__(self, address: str, secret: ClusterSecret,
                 deliver: Callable[[list[StoreEvent], bool], None], interval_s: float = 0.05,
                 on_disk_reads: Callable[[int, float], None] | None = None,
                 on_lost: Callable[[], None] | None = None, lost_after_s: float = 3.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._address, self._secret, self._deliver, self._interval_s = address, secret, deliver, interval_s
        self._on_disk_reads = on_disk_reads
        self._on_lost, self.lost_after_s, self._clock = on_lost, lost_after_s, clock
        self.lost = False
        self._disk_reads: tuple[int, float] = (0, 0.0)
        self._stop = threading.Event()
        self._seq = 0
        self._epoch: object = None  # the node's start the feed has read (None: none yet)
        self.num_polls = 0
        self._thread = threading.Thread(target=self._run, name="kv-store-events", daemon=True)

    def start(self) -> StoreEventFeed:
        self._thread.start()
        return self

    def resync(self) -> None:
        """The reader found a gap: ask from the start (the node answers with its log or a snapshot)."""
        self._seq = 0

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        client = StoreClient(self._address, self._secret, timeout_s=1.0, retry_after_s=1.0)
        heard_at = self._clock()
        try:
            while not self._stop.wait(self._interval_s):
                try:
                    reply = client.events_since(self._seq)
                except StoreUnavailable:
                    if not self.lost and self._clock() - heard_at >= self.lost_after_s:
                        self.lost, self._seq, self._disk_reads = True, 0, (0, 0.0)
                        if self._on_lost is not None:
                            self._on_lost()
                    continue
                heard_at, self.lost = self._clock(), False
                self.num_polls += 1
                epoch = reply.get("epoch")
                if self._epoch is not None and epoch != self._epoch:  # restarted: its answer counts from its new seqs
                    self._epoch, self._seq, self._disk_reads = epoch, 0, (0, 0.0)
                    if self._on_lost is not None:
                        self._on_lost()
                    continue
                self._epoch = epoch
                events = [StoreEvent(int(seq), kind, tuple(hashes), tier) for seq, kind, hashes, tier in reply["events"]]
                if events:
                    self._seq = max(event.seq for event in events)
                    self._deliver(events, bool(reply["snapshot"]))
                disk_bytes, disk_s = reply.get("disk_read_bytes"), reply.get("disk_read_s")
                if (self._on_disk_reads is not None and type(disk_bytes) is int and isinstance(disk_s, (int, float))
                        and (disk_bytes, disk_s) != self._disk_reads):
                    self._disk_reads = (disk_bytes, float(disk_s))
                    self._on_disk_reads(disk_bytes, float(disk_s))
        finally:
            client.close()
