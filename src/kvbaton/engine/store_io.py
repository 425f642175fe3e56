"""A worker's data path to the cluster KV store: one background thread moves every byte, so no step waits on it.

- **Saves (write-through).** The prefix cache calls `on_cached` (as it calls its tier: `RadixCache.tier`)
  with the blocks it just adopted; they join a bounded queue (`max_pending_saves` blocks). A full queue drops
  the save (counted), never blocks. The thread copies each block out of the KV pool and `put`s it to the store.
  Until it has copied a block, an eviction of that block (`demote`, which runs before its device block can be
  reused) cancels the save, under the lock the copy holds: a save never reads a reused block. A `clear` (an
  admin's reset, not a step) copies the pending blocks out itself instead, so a reset loses no save. Blocks
  loaded are not saved again, but for those another node granted a copy on this worker's node (`copies` of a
  TCP load, the store's replication rule: `kvbaton.cache.kv_store`): they are saved as the worker's own
  blocks are, marked `replica`.
- **Loads.** `acquire` asks the store node for the leading blocks of a chain (pinned under a lease, in its DRAM
  slots); `copy_in` copies them from the node's shared-memory slots straight into device blocks the engine
  allocated (or, when the link says the node is on another host, reads them over its TCP port into those
  blocks: `kvbaton.transfer.store_tcp`; with room for the whole chain, acquire, read and release are one
  `load_into` there), then releases the lease. Results come back through `take_results`, read by the engine
  between steps (`kvbaton.engine.store_loads`). A store that does not answer (`StoreUnavailable`) fails the
  load: the request recomputes. `load_totals` counts the bytes every load brought, the seconds it took (acquire +
  copy, or the one TCP trip), the loads, and of those seconds the round trips' (the acquire's answer, or the TCP
  load's header); the worker's heartbeat carries them, and the router prices a load's fixed round trip apart from
  its bytes' speed from them (`kvbaton.cache.store_prices.LinkMeter`). On the same host (x86) a load first reads
  what the node's slot index shows without a lease (`_copy_unleased`: no round trip; its lookup is the fixed
  part counted), and acquires only what the node may hold past it; an engine with nothing else to step or load
  does that read on its own thread (`copy_now`), with no hand-off to this one, its copy split over
  `copy_threads` threads when large (one core's copy is not the memory's limit).
- **Not a tier of its own.** Matching past the device cache is not done here (`match` finds nothing): loads are
  asynchronous, started by the engine before admission, so the scheduler only ever sees device hits.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from kvbaton.cache.tier import EvictedBlock
from kvbaton.transfer.store_slots import StoreSlots
from kvbaton.transfer.store_tcp import row_views

# A lone load read on the engine thread (`copy_now`) splits its rows over this many threads (the engine thread and
# helpers) when it copies at least SPLIT_COPY_BYTES: the engine has nothing else to run, and one core's copy is
# not the memory's limit (a two-thread memcpy of 46 MB ran 1.14-1.66x a one-thread one on this 2-core host).
DEFAULT_COPY_THREADS = min(2, os.cpu_count() or 1)
SPLIT_COPY_BYTES = 4 << 20


class StoreUnavailable(RuntimeError):
    """The store node did not answer in time, refused, or is taken as down."""


class StoreLink(Protocol):
    """The worker's connection to its store node (`kvbaton.server.store_client.StoreClient`); one thread uses it."""

    def hello(self) -> dict:
        """The node's slots: `shm_path`, `block_bytes`, `num_slots`, `num_rows` (rows per block), and `transport`:
        "shm" (map the slots and copy them) or "tcp" (read leased slots with `read_into`); `unleased_reads`: with
        "shm", copy what the node's slot index shows without acquiring it (`kvbaton.transfer.store_slots`)."""

    def put(self, namespace: Sequence[str], parent_hash: int, block_hashes: Sequence[int],
            payloads: Sequence[memoryview], replica: bool = False) -> bool:
        """Send blocks to store, not waiting; False when dropped. `replica`: copies another node granted."""

    def acquire(self, namespace: Sequence[str], block_hashes: Sequence[int]) -> tuple[int, list[int], str]:
        """(lease, slots, the slots' shared-memory path) of the leading blocks the node holds, pinned; raises
        StoreUnavailable."""

    def read_into(self, lease: int, buffers: list[memoryview]) -> None:
        """The lease's blocks, rows first, into `buffers` over TCP; raises StoreUnavailable."""

    def load_into(self, namespace: Sequence[str], block_hashes: Sequence[int],
                  buffers_for: Callable[[int], list[memoryview]], copies: list[int] | None = None) -> int:
        """Acquire, read (rows first, into `buffers_for(n)`) and release over TCP in one trip; returns n. `copies`
        (from another node): the positions of the blocks read that it grants a copy on this worker's node."""

    def touch(self, namespace: Sequence[str], block_hashes: Sequence[int]) -> bool:
        """These blocks were copied from the node's slots unleased: a use each (for its eviction), not waiting."""

    def release(self, lease: int) -> bool:
        """Unpin a lease's blocks, not waiting."""

    def clear(self) -> int:
        """Drop every block the node holds that no load pins (an admin's reset); how many. Raises StoreUnavailable."""

    @property
    def remote_nodes(self) -> Sequence[StoreLink]:
        """The cluster's other store nodes, which a load continues from over TCP (`load_into`) for the blocks this
        node lacks; none with one node (`kvbaton.server.store_client.StoreNodes` has them)."""

    def close(self) -> None: ...


@dataclass(slots=True)
class LoadJob:
    """One request's load from the store, from `acquire` to its end (`kvbaton.engine.store_loads` drives it)."""

    request_id: str
    namespace: tuple[str, ...]
    block_hashes: list[int]  # the chain asked for, after the device prefix
    lease: int = 0
    slots: list[int] = field(default_factory=list)  # of the leading blocks the node holds
    shm_path: str = ""  # the file those slots are in
    device_block_ids: list[int] = field(default_factory=list)
    num_copied: int = 0  # leading blocks copied into device_block_ids (set with the "copied" result)
    acquire_s: float = 0.0  # seconds its acquire took (a load's time is its acquire's plus its copy's)
    error: str = ""
    prefetch: object = None  # its own node's acquire, sent while the load before it copied (the IO thread's)
    more_nodes: bool = False  # set by `acquire`: there are other nodes, which `copy` goes on to
    num_elsewhere: int = 0  # set by `acquire`: blocks past the own node's that other nodes held then (not pinned)
    copies: list[int] = field(default_factory=list)  # hashes loaded from other nodes that granted a copy here


@dataclass(slots=True)
class _SaveJob:
    namespace: tuple[str, ...]
    parent_hash: int
    block_hashes: list[int]
    device_block_ids: list[int]
    cancelled: bool = False
    payloads: list | None = None  # copied out already (by a `clear`, before its blocks went back to the pool)
    replica: bool = False  # blocks loaded from another node that granted them a copy on this worker's node


def namespace_of(cache_key: object) -> tuple[str, str, str]:
    """A CacheKey as the store's wire names it."""
    return (cache_key.model_revision, cache_key.kv_layout, cache_key.tenant_salt)  # type: ignore[attr-defined]


class WorkerStoreIO:
    def __init__(self, kv_cache: torch.Tensor, create_link: Callable[[], StoreLink],
                 max_pending_saves: int = 1024, copy_threads: int = DEFAULT_COPY_THREADS) -> None:
        self.kv_cache = kv_cache  # [layers, 2, blocks, block_size, kv_heads, head_dim]
        # a block's bytes, every layer's K and V (taken once: a slice of the pool costs a load ~0.2 ms of the GIL)
        self._block_bytes = kv_cache[:, :, 0].numel() * kv_cache.element_size()
        self.max_pending_saves = max_pending_saves
        self.copy_threads = copy_threads  # threads a `copy_now` load's copy runs on (SPLIT_COPY_BYTES and more)
        self._copy_helpers: ThreadPoolExecutor | None = None  # made at the first split copy
        self._create_link = create_link
        self._tasks: queue.Queue = queue.Queue()
        self._results: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # held while a save copies device blocks, and while saves are cancelled
        self._pending: dict[int, _SaveJob] = {}  # device block id -> the save that has not copied it yet
        self._num_pending_blocks = 0
        self._slots: torch.Tensor | None = None
        self._mapping: StoreSlots | None = None
        self._rows: tuple[np.ndarray, np.ndarray] | None = None
        self.transport = ""  # "shm" | "tcp", from the node's hello
        self.unleased_reads = False  # from the hello too: copy what the node's slot index shows without a lease
        self._touches: list[tuple[StoreLink, tuple[str, ...], list[int]]] = []  # unleased copies' uses, to send
        self._staging: torch.Tensor | None = None  # a TCP read's host buffer on an accelerator
        self.skip_saves: set[int] = set()  # hashes loaded from the store: caching them saves nothing
        self.copy_saves: set[int] = set()  # hashes loaded from another node that granted them a copy here
        self.num_saved_blocks = self.num_dropped_saves = self.num_cancelled_saves = 0
        self.num_loaded_blocks = self.num_failed_loads = 0
        self.num_prefetched_acquires = 0  # loads whose acquire went out while the one before them copied
        self.num_unleased_blocks = 0  # of num_loaded_blocks, those copied without a lease (the slot index's)
        self.num_loads_now = 0  # loads the engine thread did itself (`copy_now`)
        self.copy_in_s = 0.0  # seconds spent copying loads into the KV pool (on the IO thread, or in `copy_now`)
        # (bytes, seconds, loads, round-trip seconds) of every load that brought blocks: acquire + copy (over shm) or
        # the one TCP trip, and of that the acquire's answer (or the TCP header's); one tuple, swapped whole, so a
        # heartbeat never reads one counter of a load without the others.
        self.load_totals: tuple[int, float, int, float] = (0, 0.0, 0, 0.0)
        self._thread = threading.Thread(target=self._run, name="kv-store-io", daemon=True)
        self._thread.start()

    # ---- the prefix cache's tier calls (engine thread) ------------------------------------------
    def on_cached(self, block_hashes: Sequence[int], parent_hash: int, namespace: object,
                  device_block_ids: Sequence[int] = ()) -> None:
        keep = [i for i, h in enumerate(block_hashes) if h not in self.skip_saves]
        if not keep:
            return
        with self._lock:
            if self._num_pending_blocks + len(keep) > self.max_pending_saves:
                self.num_dropped_saves += len(keep)
                return
            # Only a chain's leading run is written here: a block whose parent the store may not get is no use.
            first = keep[0]
            run = keep[: next((j for j, i in enumerate(keep) if i != first + j), len(keep))]
            parent = block_hashes[first - 1] if first else parent_hash
            job = _SaveJob(namespace_of(namespace), parent, [block_hashes[i] for i in run],
                           [device_block_ids[i] for i in run], replica=block_hashes[first] in self.copy_saves)
            for block_id in job.device_block_ids:
                self._pending[block_id] = job
            self._num_pending_blocks += len(run)
        self._tasks.put(("save", job))

    def demote(self, blocks: Sequence[EvictedBlock]) -> list[int]:
        """The device evicted these; a save that has not read one yet is cancelled. All left the device."""
        with self._lock:
            for block in blocks:
                self._cancel(self._pending.get(block.device_block_id))
        return [block.block_hash for block in blocks]

    def clear(self) -> list[int]:
        """The device cache is being emptied (not on a step's path): saves not copied yet copy their blocks now."""
        with self._lock:
            for job in {id(job): job for job in self._pending.values()}.values():
                job.payloads = self._payloads(job)
                self._unlist(job)
        return []

    def clear_store(self, wait_s: float = 0.0) -> int | None:
        """Empty the store node of what no load pins (vLLM's `reset_prefix_cache` reaching the store), after the saves
        queued before this call (the IO thread's link sends them first). `wait_s` 0: ask and go on (a serving worker's
        loop waits on no node), None back; else wait that long for the answer, how many blocks went, or raise
        StoreUnavailable."""
        answer: queue.Queue = queue.Queue(maxsize=1)
        self._tasks.put(("clear", answer))
        if not wait_s:
            return None
        try:
            result = answer.get(timeout=wait_s)
        except queue.Empty:
            raise StoreUnavailable(f"the store node was not cleared within {wait_s} s") from None
        if isinstance(result, StoreUnavailable):
            raise result
        return result

    def match(self, parent_hash: int, token_blocks: Sequence[tuple[int, ...]], block_hashes: Sequence[int] = (),
              namespace: object = None) -> int:
        return 0

    def take(self, parent_hash: int, token_blocks: Sequence[tuple[int, ...]], block_hashes: Sequence[int] = (),
             namespace: object = None) -> list[int]:
        return []

    def load(self, block_hashes: Sequence[int], device_block_ids: list[int]) -> None:
        assert not block_hashes, "the store loads through WorkerStoreIO.copy_in, never inside admission"

    def put_back(self, block_hashes: Sequence[int]) -> None:
        assert not block_hashes

    def stored(self) -> list[tuple[int, int]]:
        return []

    def check_invariants(self, device_hashes: set[int]) -> None:
        with self._lock:
            assert self._num_pending_blocks == len(self._pending) <= self.max_pending_saves, "save queue miscounted"

    # ---- loads (engine thread) ------------------------------------------------------------------
    def acquire(self, job: LoadJob) -> None:
        self._tasks.put(("acquire", job))

    def copy_in(self, job: LoadJob) -> None:
        self._tasks.put(("copy", job))

    def acquire_and_copy(self, job: LoadJob) -> None:
        """`acquire`, then at once `copy_in` into the device blocks the job already holds (one per block asked
        for; the first len(slots) get the blocks the node has): one trip through the engine's step loop, not two."""
        self._tasks.put(("acquire_copy", job))

    def copy_now(self, job: LoadJob) -> bool:
        """The load, begun on the calling (engine) thread, for an engine with nothing else to step or load: an unleased
        read of the chain into the job's device blocks. When it brings the whole chain its result is queued at once
        as the IO thread's would be (no thread hand-off, and the copy runs on the thread that waits for it: on this
        2-core host the IO thread's copies ran 10-20 % slower, timed by hand; a large one split with `copy_threads`
        - 1 helper threads, as nothing else of this engine runs meanwhile); otherwise the IO thread goes on from
        the blocks it brought (asking the node for what it may hold past them, then the other nodes: `_rest`) and
        queues the result. The node is told of the uses by the IO thread. False, nothing done, when unleased reads
        are off or the node's slots are not mapped (or its node is gone): the job then goes to the IO thread as
        usual (`acquire_and_copy`). The IO thread meanwhile may only save or end an earlier load (the engine calls
        this with no load in flight), which touches neither the mapping nor a load's counters."""
        mapping = self._mapping
        if not self.unleased_reads or mapping is None or not mapping.node_alive():
            return False
        num, ask_node, seconds, lookup_s = self._copy_unleased(job, job.block_hashes, job.device_block_ids,
                                                                self.copy_threads)
        if num:
            self._count_unleased(job, num, seconds, lookup_s)
        self.num_loads_now += 1
        whole = num == len(job.block_hashes)
        if whole:
            self._results.put(("copied", job))  # before the touch wakes the IO thread
        if num:  # before the rest: the node counts these uses before it makes room for what the rest brings
            self._tasks.put(("touch", (job.namespace, list(job.block_hashes[:num]))))
        if not whole:
            self._tasks.put(("rest", (job, ask_node)))
        return True

    def _rest(self, link: StoreLink, job: LoadJob, ask_node: bool) -> None:
        """A load `copy_now` began: on from its `num_copied` blocks, from the own node (`ask_node`: it may hold more,
        on disk, or moved a block meanwhile) and the other nodes, as `_walk` goes."""
        self._walk(link, job, first=0 if ask_node else 1)

    def release(self, job: LoadJob) -> None:
        if job.lease:
            self._tasks.put(("release", job.lease))
            job.lease = 0

    def take_results(self, wait_s: float = 0.0) -> list[tuple[str, LoadJob]]:
        """("acquired" | "copied" | "failed", job) for each load step done since the last call; with `wait_s`, waits
        up to that long for the first (the GIL let go meanwhile: an engine with nothing but loads to run would
        otherwise spin in Python while this thread waits its turn for the interpreter to finish them)."""
        results = []
        if wait_s > 0:
            try:
                results.append(self._results.get(timeout=wait_s))
            except queue.Empty:
                return results
        while True:
            try:
                results.append(self._results.get_nowait())
            except queue.Empty:
                return results

    @property
    def num_cached_blocks(self) -> int:
        """Blocks held for this worker elsewhere (the store node counts them, not the worker)."""
        return 0

    @property
    def num_pending_saves(self) -> int:
        return self._num_pending_blocks

    def close(self) -> None:
        self._tasks.put(("stop", None))
        self._thread.join(timeout=10)
        if self._copy_helpers is not None:
            self._copy_helpers.shutdown(wait=True)

    # ---- the IO thread --------------------------------------------------------------------------
    def _cancel(self, job: _SaveJob | None) -> None:
        if job is None or job.cancelled:
            return
        job.cancelled = True
        self.num_cancelled_saves += len(job.block_hashes)
        self._unlist(job)

    def _unlist(self, job: _SaveJob) -> None:
        for block_id in job.device_block_ids:
            if self._pending.get(block_id) is job:
                del self._pending[block_id]
        self._num_pending_blocks -= len(job.block_hashes)

    def _run(self) -> None:
        link = self._create_link()
        try:
            while True:
                kind, item = self._tasks.get()
                if kind == "stop":
                    return
                try:
                    if kind == "save":
                        self._save(link, item)
                    elif kind == "acquire":
                        self._acquire_own(link, item)
                        self._results.put(("acquired", item))
                    elif kind == "acquire_copy":
                        self._finish(link, item, self._acquire_copy)
                    elif kind == "copy":  # its load's time counts from its acquire's start
                        since = time.perf_counter() - item.acquire_s
                        self._finish(link, item, lambda link, job: self._copy_then_walk(link, job, since))
                    elif kind == "release":
                        link.release(item)
                    elif kind == "touch":  # the uses of a load the engine thread read unleased (`copy_now`)
                        link.touch(*item)
                    elif kind == "clear":  # after the saves queued before it: the link sends them first
                        self._clear(link, item)
                    elif kind == "rest":  # a load `copy_now` began, on from the blocks it brought
                        job, ask_node = item
                        self._finish(link, job, lambda link, job: self._rest(link, job, ask_node))
                except (StoreUnavailable, OSError, ValueError) as exc:
                    if kind in ("acquire", "copy", "acquire_copy", "rest"):
                        job = item[0] if kind == "rest" else item
                        job.error = str(exc)
                        self.num_failed_loads += 1
                        self._results.put(("failed", job))
        finally:
            link.close()

    @staticmethod
    def _clear(link: StoreLink, answer: queue.Queue) -> None:
        try:
            answer.put(link.clear())
        except (StoreUnavailable, OSError, ValueError) as exc:
            answer.put(StoreUnavailable(f"the store node was not cleared: {exc}"))

    def _finish(self, link: StoreLink, job: LoadJob, copy: Callable[[StoreLink, LoadJob], None]) -> None:
        """Run a load's copy step, hand its result to the engine, and only then release its lease (whatever happened):
        the release is a message not waited for, but a send still costs its syscall (on the control socket, where a
        release goes once the TCP link broke, the first send after a pause cost this host ~0.5 ms: the zmq IO
        thread's wake-up and encryption run before the sender goes on), which no load should wait on."""
        try:
            copy(link, job)
        except BaseException:
            lease, job.lease = job.lease, 0
            if lease:
                link.release(lease)
            self._send_touches()
            raise
        lease, job.lease = job.lease, 0  # before the engine sees the job: it releases nothing twice
        self._results.put(("copied", job))
        if lease:
            link.release(lease)
        self._send_touches()

    def _send_touches(self) -> None:
        """Tell the nodes of the blocks a load copied unleased (their uses): after its result, which no send delays."""
        touches, self._touches = self._touches, []
        for node, namespace, block_hashes in touches:
            node.touch(namespace, block_hashes)

    def _count_load(self, num_blocks: int, seconds: float, round_trip_s: float) -> None:
        if num_blocks:
            num_bytes, total_s, num_loads, total_round_trip_s = self.load_totals
            self.load_totals = (num_bytes + num_blocks * self._block_bytes, total_s + seconds,
                                num_loads + 1, total_round_trip_s + min(round_trip_s, seconds))

    def _payloads(self, job: _SaveJob) -> list:
        kv = self.kv_cache
        return [kv[:, :, block_id].contiguous().cpu().view(torch.uint8).reshape(-1).numpy()
                for block_id in job.device_block_ids]

    def _save(self, link: StoreLink, job: _SaveJob) -> None:
        with self._lock:
            if job.cancelled:
                return
            payloads = job.payloads
            if payloads is None:
                payloads = self._payloads(job)
                self._unlist(job)
        if link.put(job.namespace, job.parent_hash, job.block_hashes, [memoryview(p) for p in payloads], job.replica):
            self.num_saved_blocks += len(payloads)
        else:
            self.num_dropped_saves += len(payloads)

    def _acquire_own(self, link: StoreLink, job: LoadJob) -> None:
        """The split path's first step (the pool had no room for the whole chain): pin what the own node holds and,
        with other nodes, ask them how far they hold the chain past it (`num_elsewhere`, nothing pinned there): the
        engine evicts cached blocks only for what some node holds, and `copy` goes on to them. With other nodes, an
        own node that fails pins nothing rather than failing the load, as in `_acquire_copy`."""
        started = time.perf_counter()
        job.more_nodes = bool(link.remote_nodes)
        try:
            job.lease, job.slots, job.shm_path = link.acquire(job.namespace, job.block_hashes)
        except StoreUnavailable:
            if not job.more_nodes:
                raise
            job.lease, job.slots = 0, []
        job.acquire_s = time.perf_counter() - started
        if job.more_nodes and len(job.slots) < len(job.block_hashes):
            job.num_elsewhere = self._held_elsewhere(link, job, len(job.slots))

    def _held_elsewhere(self, link: StoreLink, job: LoadJob, start: int) -> int:
        """How far past `start` the nodes hold the chain, asked in turn from the first other one as `_walk` asks them
        (each continuing where the chain stopped); a node that fails counts as holding none."""
        reached, _ = _in_turn(link, 1, start, len(job.block_hashes),
                              lambda node, local, at: node.held(job.namespace, job.block_hashes[at:]))  # type: ignore
        return reached - start

    def _copy_then_walk(self, link: StoreLink, job: LoadJob, since: float) -> None:
        """The split path's copy: the own node's leased slots into the first device blocks; given more blocks than
        those (other nodes), on from the others for the rest of them, as `_acquire_copy` goes on."""
        job.num_copied = 0
        if job.slots:
            self._copy_leased(link, job, job.device_block_ids[: len(job.slots)], since)
        if job.more_nodes and job.num_copied < len(job.device_block_ids):
            self._walk(link, job, first=1)

    def _acquire_copy(self, link: StoreLink, job: LoadJob) -> None:
        """Load the chain into the job's first device blocks from the worker's own node, then, with several nodes
        (`link.remote_nodes`), on from the others for what it lacks: the nodes in turn, each continuing where the
        chain stopped (a chain extended by workers on several hosts lies on several nodes), until every node has
        been asked past the last block brought. A node that fails is passed over (one timeout, then its
        down-window); the load fails only when nothing came and a node failed. With one node: one ask, as before.
        The own node's lease stays with the job (`_finish` releases it)."""
        job.num_copied = 0
        self._walk(link, job)

    def _walk(self, link: StoreLink, job: LoadJob, first: int = 0) -> None:
        """Load the chain from the job's `num_copied` on into its device blocks from the nodes in turn from `first`
        (0: the own one), until the blocks are full or every node was asked past the last block brought; raises
        when nothing came and a node failed."""
        job.num_copied, error = _in_turn(link, first, job.num_copied, len(job.device_block_ids),
                                         lambda node, local, start: self._load_from(node, job, start, local))
        if error is not None and not job.num_copied:
            raise error

    def _load_from(self, node: StoreLink, job: LoadJob, start: int, local: bool) -> int:
        """The leading blocks `node` holds of the job's chain from `start`, into its device blocks from `start`;
        their number. The own node on the same host: acquire, copy from its slots (the lease is released after the
        engine has the result). Another node, or the own one over TCP: one trip on its TCP port (it acquires,
        streams and releases). One acquire for the whole chain: acquiring it in pieces, to copy one while the node
        pins the next, measured slower here (each piece's rows fall under glibc's streaming-copy threshold, and the
        first answer's round trip, which no pipelining hides, stays)."""
        hashes, block_ids = job.block_hashes[start : len(job.device_block_ids)], job.device_block_ids[start:]
        if local:
            if self._mapping is not None and not self._mapping.node_alive():
                self._detach()  # the node stopped: its file's index says so; a hello finds the one it runs now
            self._attach(node)
        if not local or self.transport == "tcp":
            if local and job.prefetch is not None:  # not to be: the node went over to TCP since it was sent
                token, job.prefetch = job.prefetch, None
                try:
                    node.release(node.end_acquire(token)[0])  # type: ignore[attr-defined]
                except StoreUnavailable:
                    pass  # its pin, if any, expires with its lease
            started = time.perf_counter()
            answered = [started]  # when the node's header came (the round trip), before its bytes

            def buffers_for(num: int) -> list[memoryview]:
                answered[0] = time.perf_counter()
                return self._receive_buffers(block_ids[:num])
            copies: list[int] | None = None if local else []
            try:
                num = node.load_into(job.namespace, hashes, buffers_for, copies)
                self._finish_receive(block_ids[:num])
                job.copies.extend(hashes[i] for i in copies or ())
            finally:
                self.copy_in_s += time.perf_counter() - started
            self._count_load(num, time.perf_counter() - started, answered[0] - started)
            self.num_loaded_blocks += num
            return num
        unleased = 0
        if self.unleased_reads and job.prefetch is None:
            unleased, ask_node, seconds, lookup_s = self._copy_unleased(job, hashes, block_ids)
            if unleased:
                self._count_unleased(job, unleased, seconds, lookup_s)
                self._touches.append((node, job.namespace, list(hashes[:unleased])))  # sent after the result
            if not ask_node:
                return unleased
            hashes, block_ids = hashes[unleased:], block_ids[unleased:]  # the rest: on disk, or moved meanwhile
        if job.lease:  # the own node asked again, past another node's blocks: its first lease is done with
            lease, job.lease = job.lease, 0
            node.release(lease)
        acquired = time.perf_counter()  # after `_attach`: mapping the node's slots once is no load's time
        token, job.prefetch = job.prefetch, None
        if token is not None and start == 0:  # sent while the load before it copied: its answer is here already
            job.lease, job.slots, job.shm_path = node.end_acquire(token)  # type: ignore[attr-defined]
            self.num_prefetched_acquires += 1
        else:
            job.lease, job.slots, job.shm_path = node.acquire(job.namespace, hashes)
        job.acquire_s = time.perf_counter() - acquired
        if not job.slots:
            return unleased
        self._prefetch_next(node)
        self._copy_leased(node, job, block_ids[: len(job.slots)], acquired)
        return unleased + len(job.slots)

    def _copy_unleased(self, job: LoadJob, hashes: Sequence[int], block_ids: Sequence[int], threads: int = 1
                       ) -> tuple[int, bool, float, float]:
        """The leading blocks of `hashes` the node's slot index shows in DRAM, copied into `block_ids` without a lease
        (no round trip: `kvbaton.transfer.store_slots`): how many of them are good (their slots' generations the same
        after the copy as when looked up: a block the node moved or freed meanwhile ends the run there), and whether
        the node must be asked for the rest (one moved meanwhile, or the node has blocks on disk, which only an
        acquire brings back; else the chain stops where its DRAM does), and the seconds of the whole read and of its
        lookup. Counts nothing (`_count_unleased` does, for the blocks the load keeps); the caller has the node told
        of the uses after (`touch`, not waited for)."""
        mapping = self._mapping
        started = time.perf_counter()
        slots, generations = mapping.lookup(hashes, job.namespace)
        on_disk = mapping.num_disk_blocks > 0
        if not slots:
            return 0, on_disk, 0.0, 0.0
        looked_up = time.perf_counter()
        self._copy_rows(slots, block_ids[: len(slots)], threads)
        num = mapping.still_held(slots, generations)
        ended = time.perf_counter()
        return num, num < len(slots) or (len(slots) < len(hashes) and on_disk), ended - started, looked_up - started

    def _count_unleased(self, job: LoadJob, num: int, seconds: float, lookup_s: float) -> None:
        """A load kept `num` blocks an unleased read copied in `seconds`: counted as loads are, its lookup as the
        fixed part (`load_totals`' round trip)."""
        self._count_load(num, seconds, lookup_s)
        self.copy_in_s += seconds - lookup_s
        self.num_loaded_blocks += num
        self.num_unleased_blocks += num
        job.num_copied = num

    def _prefetch_next(self, node: StoreLink) -> None:
        """Before this load copies, send the next queued load's acquire to the same node (the node's answer waits on
        the link for it): a burst of loads waits on one round trip, not one each. Only a load that starts at this
        node over shared memory takes it (`_load_from`); the IO thread's next task is that load's first step."""
        begin = getattr(node, "begin_acquire", None)
        if begin is None or self.unleased_reads:  # the next load reads unleased, most likely: nothing to wait on
            return
        with self._tasks.mutex:
            upcoming = self._tasks.queue[0] if self._tasks.queue else None
        if upcoming is None or upcoming[0] != "acquire_copy" or upcoming[1].prefetch is not None:
            return
        job = upcoming[1]
        job.prefetch = begin(job.namespace, job.block_hashes)

    def _copy_leased(self, link: StoreLink, job: LoadJob, block_ids: Sequence[int], since: float) -> None:
        """The job's leased slots into `block_ids` (the lease stays with the job: `_finish` releases it); the load is
        counted with the seconds from `since` (its acquire's start) to the copy's end, `job.acquire_s` of them its
        acquire's round trip."""
        started = time.perf_counter()
        try:
            self._copy(link, job.lease, job.slots, job.shm_path, block_ids)
        finally:
            self.copy_in_s += time.perf_counter() - started
        self._count_load(len(block_ids), time.perf_counter() - since, job.acquire_s)
        self.num_loaded_blocks += len(block_ids)
        job.num_copied = len(block_ids)

    def _copy(self, link: StoreLink, lease: int, slots: list[int], shm_path: str, block_ids: Sequence[int]) -> None:
        """`slots` (pinned under `lease`) into device blocks `block_ids`. Same host: each run of consecutive slots into
        consecutive device blocks in one copy from the node's mapping (the slots are laid out as the pool is,
        `[layers, 2, slots, ...]`, so one memcpy per row; on the CPU through numpy views in 8-byte words: torch's
        strided bf16 copy runs at a third of memcpy's speed). Over TCP: the node streams the lease's rows and the
        socket scatters them into the pool's rows (on an accelerator, through a host buffer)."""
        self._attach(link)
        if self.transport == "tcp":
            self._read(link, lease, block_ids)
            return
        if self._mapping is not None and self._mapping.path != shm_path:
            self._detach()  # the node restarted: its slots are in a new file
        self._attach(link)
        if self._mapping.path != shm_path:
            raise StoreUnavailable(f"the store node's slots moved from {shm_path} to {self._mapping.path}")
        self._copy_rows(slots, block_ids)

    def _copy_rows(self, slots: Sequence[int], block_ids: Sequence[int], threads: int = 1) -> None:
        """The mapped node's `slots` into device blocks `block_ids`, a run of consecutive ones per copy. With `threads`
        > 1 and at least SPLIT_COPY_BYTES to copy through the numpy rows, the rows (each layer's K and V) are split
        in as many even parts, one copied on this thread and the others on helper threads, and this returns when
        all are copied (numpy lets the GIL go while it copies)."""
        kv, rows, slot_view = self.kv_cache, self._rows, self._slots
        runs = block_runs(slots, block_ids)
        if rows is None:
            for slot, block_id, num in runs:
                kv[:, :, block_id : block_id + num].copy_(slot_view[:, :, slot : slot + num])
            return
        pool, node = rows
        num_rows = pool.shape[0]
        threads = min(threads, num_rows)
        if threads < 2 or len(slots) * self._block_bytes < SPLIT_COPY_BYTES:
            _copy_runs(pool, node, runs, 0, num_rows)
            return
        if self._copy_helpers is None:
            self._copy_helpers = ThreadPoolExecutor(threads - 1, thread_name_prefix="kv-store-copy")
        bounds = [num_rows * i // threads for i in range(threads + 1)]
        helped = [self._copy_helpers.submit(_copy_runs, pool, node, runs, bounds[i], bounds[i + 1])
                  for i in range(1, threads)]
        try:
            _copy_runs(pool, node, runs, bounds[0], bounds[1])
        finally:
            for future in helped:
                future.result()  # every part copied (or its error raised) before the caller reads the blocks

    def _detach(self) -> None:
        """Forget the node's mapped slots (it restarted, or stopped): the next load maps what a hello names."""
        mapping, self._slots, self._mapping, self._rows = self._mapping, None, None, None
        self.unleased_reads = False
        if mapping is not None:
            mapping.close()

    def _read(self, link: StoreLink, lease: int, block_ids: Sequence[int]) -> None:
        link.read_into(lease, self._receive_buffers(block_ids))
        self._finish_receive(block_ids)

    def _receive_buffers(self, block_ids: Sequence[int]) -> list[memoryview]:
        """Where a TCP read of `block_ids` lands, in wire order: the pool's rows themselves on the CPU, else a host
        buffer (`_finish_receive` copies it to the device)."""
        kv = self.kv_cache
        num_rows = kv.shape[0] * kv.shape[1]
        if kv.device.type == "cpu":
            return row_views(kv.view(torch.uint8).view(num_rows, kv.shape[2], -1).numpy(), block_ids)
        self._staging = torch.empty((num_rows, len(block_ids), kv[0, 0, 0].numel() * kv.element_size()),
                                    dtype=torch.uint8, pin_memory=kv.device.type == "cuda")
        return row_views(self._staging.numpy(), range(len(block_ids)))

    def _finish_receive(self, block_ids: Sequence[int]) -> None:
        kv = self.kv_cache
        if kv.device.type == "cpu" or not block_ids:
            return
        pool = kv.view(torch.uint8).view(kv.shape[0] * kv.shape[1], kv.shape[2], -1)
        staging, self._staging = self._staging, None
        for start, block_id, num in block_runs(range(len(block_ids)), block_ids):
            pool[:, block_id : block_id + num].copy_(staging[:, start : start + num])

    def _attach(self, link: StoreLink) -> torch.Tensor | None:
        """Ask the node once for its slots; on the same host map them, as `[layers, 2, slots, block_size, kv_heads,
        head_dim]` (None over TCP)."""
        if self._slots is None and self.transport != "tcp":
            hello = link.hello()
            kv = self.kv_cache
            expected = kv[:, :, 0].numel() * kv.element_size()
            if hello["block_bytes"] != expected or hello["num_rows"] != kv.shape[0] * kv.shape[1]:
                raise StoreUnavailable(f"the store node's blocks are {hello['block_bytes']} bytes in "
                                       f"{hello['num_rows']} rows, this worker's {expected} in "
                                       f"{kv.shape[0] * kv.shape[1]}")
            self.transport = hello["transport"]
            if self.transport == "tcp":
                return None
            self.unleased_reads = bool(hello.get("unleased_reads", False))
            shape = (kv.shape[0], kv.shape[1], hello["num_slots"], *kv.shape[3:])
            self._mapping = StoreSlots.attach(hello["shm_path"], hello["block_bytes"], hello["num_slots"],
                                              hello["num_rows"])
            self._slots = torch.frombuffer(self._mapping.buffer, dtype=kv.dtype).view(shape)
            self._rows = _word_rows(kv, self._mapping) if kv.device.type == "cpu" else None
        return self._slots


def _in_turn(link: StoreLink, first: int, start: int, end: int,
             ask: Callable[[StoreLink, bool, int], int]) -> tuple[int, StoreUnavailable | None]:
    """Ask the nodes (`link`, the own one, then `link.remote_nodes`) in turn from index `first`, each
    `ask(node, is_own, from)` for the chain from where the last stopped, until `end` or every node has been asked
    past the last block one brought (from `first` 1: the own node counts as asked). Returns how far the chain got
    and the last failure: with other nodes a node that fails is passed over; with none it raises."""
    nodes = (link, *link.remote_nodes)
    error: StoreUnavailable | None = None
    misses, index, reached = min(first, 1), first % len(nodes), start
    while misses < len(nodes) and reached < end:
        node, local = nodes[index], index == 0
        index = (index + 1) % len(nodes)
        try:
            num = ask(node, local, reached)
        except StoreUnavailable as exc:
            if len(nodes) == 1:
                raise
            error, num = exc, 0
        reached += num
        misses = 1 if num else misses + 1  # the node that brought blocks holds none past them
    return reached, error


def _copy_runs(pool: np.ndarray, node: np.ndarray, runs: Sequence[tuple[int, int, int]], first_row: int,
               end_row: int) -> None:
    """Rows `first_row` to `end_row` of each run of node slots (first slot, first device block, length) into the
    pool's: one copy per run, each a memcpy per row."""
    for slot, block_id, num in runs:
        np.copyto(pool[first_row:end_row, block_id : block_id + num], node[first_row:end_row, slot : slot + num])


def block_runs(slots: Sequence[int], block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first slot, first device block, length) of each stretch where both lists count up by one."""
    runs: list[tuple[int, int, int]] = []
    for slot, block_id in zip(slots, block_ids):
        if runs and slot == runs[-1][0] + runs[-1][2] and block_id == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((slot, block_id, 1))
    return runs


def _word_rows(kv: torch.Tensor, mapping: StoreSlots) -> tuple[np.ndarray, np.ndarray] | None:
    """The KV pool as `[layers x 2, blocks, words]` and the slots as `[layers x 2, slots, words]` (numpy, no copy),
    words of 8 bytes where a block's row divides into them."""
    num_rows = kv.shape[0] * kv.shape[1]
    row_bytes = kv[0, 0, 0].numel() * kv.element_size()
    word = np.int64 if row_bytes % 8 == 0 else np.uint8
    pool = kv.view(torch.uint8).numpy().reshape(num_rows, kv.shape[2], row_bytes).view(word)
    return pool, mapping.rows.view(word)
