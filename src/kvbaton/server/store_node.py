"""One live KV store node: the store's policy core (`kvbaton.cache.kv_store.KVStore`, the simulator's very object)
over real bytes: DRAM slots in shared memory (`kvbaton.transfer.store_slots`) and block files on a local disk
(`kvbaton.transfer.store_disk`).

The policy core decides; this follows. Every call into the `KVStore` is followed by `_apply`, which replays
the node's new events onto the bytes in their order: STORED in DRAM takes a slot (writing the put's payload,
or reading the block's file back: a promotion), STORED on disk writes the slot (or the payload) to a file and
frees the slot, EVICTED frees the slot or removes the file. The core's own order makes that safe: a victim
moves out before the block that needs its room moves in, and a chain that pushes out its own head within one
put still finds the payload for it. A file that fails its checksum on the way back is `discard`ed from the
core (EVICTED), so the load that wanted it stops before it and recomputes the rest.

Loads go by **lease**: `acquire` matches the leading blocks a worker asks for, pins them (so no eviction or
move touches their slots), promotes the disk ones to DRAM, and answers the slots of the run that is in DRAM;
the worker copies them out and `release`s the lease. A lease not released in `lease_s` (its worker died
mid-load) is dropped by `expire`, so pins never leak. A same-host worker copies DRAM blocks without a lease where
the slot index lets it (`publish`ed as each slot is written, withdrawn as it is freed: `store_slots`), and says
so after (`touch`, a use each). `check_invariants` ties the core's metadata, the slots,
the files and the leases together. Plain Python and no socket: `kvbaton.server.store_server` serves it.
"""

from __future__ import annotations

import itertools
import secrets
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvbaton.cache.kv_store import DISK, DRAM, KVStore, StoreConfig, StoreEvent
from kvbaton.core.errors import InvalidRequestError
from kvbaton.transfer.store_disk import DiskBlockFiles
from kvbaton.transfer.store_slots import StoreSlots

Namespace = tuple[str, ...]  # (model revision, KV layout, tenant salt): the worker's cache key on the wire


def nominal_recompute_s(block_tokens: int) -> Callable[[int], float]:
    """GDSF's price of recomputing a block at `depth` blocks: its tokens' prefill, linear, plus attention over the
    context before it (a nominal 50 us per token and 2 ns per token pair; only the ratios between blocks matter)."""
    def recompute_s(depth: int) -> float:
        return block_tokens * (50e-6 + 2e-9 * depth * block_tokens)
    return recompute_s


@dataclass(slots=True)
class _Lease:
    block_hashes: list[int]
    slots: list[int]
    expires_at: float
    num_reads: int = 0  # TCP reads streaming its slots right now (`begin_read`): it does not expire meanwhile


class StoreNodeState:
    """A store node's metadata and bytes; one thread calls it (the server loop)."""

    NODE = "local"
    READER_ELSEWHERE = "elsewhere"  # the reader of a load from a worker on another store node

    def __init__(self, block_bytes: int, block_tokens: int, dram_blocks: int, disk: DiskBlockFiles | None = None,
                 lease_s: float = 30.0, slots: StoreSlots | None = None, max_log_events: int = 65536,
                 block_rows: int = 1) -> None:
        """`block_rows`: rows a block's bytes split into (layers x 2, K and V: the slots are laid out as a worker's
        KV pool, `kvbaton.transfer.store_slots`)."""
        if dram_blocks <= 0:
            raise InvalidRequestError("a live store node needs DRAM (--kv-store-gb > 0): disk blocks load through it")
        self.block_bytes = block_bytes
        self.disk = disk
        disk_blocks = disk.capacity_blocks if disk is not None else 0
        self.store = KVStore(StoreConfig(dram_blocks, disk_blocks), [self.NODE])  # the simulator's replication rule
        self.slots = slots if slots is not None else StoreSlots.create(block_bytes, dram_blocks, block_rows)
        if disk is not None:
            disk.open()
        self.lease_s = lease_s
        self._recompute_s = nominal_recompute_s(block_tokens)
        self._slot_of: dict[int, int] = {}  # hash -> DRAM slot
        self._on_disk: set[int] = set()
        self._namespace_of: dict[int, Namespace] = {}
        self._leases: dict[int, _Lease] = {}
        self._unsettled: deque[tuple[list[int], Namespace]] = deque()  # acquires whose uses `settle` counts
        # From a random start: a worker that releases a lease of the node's previous start (restarted at its address)
        # must not let go of another worker's lease of this one
        self._lease_ids = itertools.count(secrets.randbelow(1 << 48) + 1)
        self._log: deque[StoreEvent] = deque(maxlen=max_log_events)  # for readers (routers): `events_since`
        self.num_put_blocks = self.num_loaded_blocks = self.num_expired_leases = self.num_refused_puts = 0

    # ---- writes --------------------------------------------------------------------------------
    def put(self, namespace: Namespace, parent_hash: int, block_hashes: Sequence[int],
            payloads: Sequence[bytes | memoryview], replica: bool = False) -> int:
        """Store a chain of blocks computed by a worker (following the block hashed `parent_hash`); blocks held
        already are skipped. Returns how many were stored. A payload of the wrong size refuses the whole put.
        `replica`: blocks the worker loaded from another node, which granted them a copy here (they grant none)."""
        if len(payloads) != len(block_hashes) or any(len(p) != self.block_bytes for p in payloads):
            self.num_refused_puts += 1
            raise InvalidRequestError(f"a store put needs one {self.block_bytes}-byte payload per block")
        namespace = tuple(namespace)
        first_depth = self.store.depth_after(parent_hash)
        stored = self.store.put(self.NODE, list(block_hashes), parent_hash, namespace, first_depth, self._recompute_s,
                                replica)
        self._apply(dict(zip(block_hashes, payloads)), namespace)
        self.num_put_blocks += len(stored)
        return len(stored)

    # ---- loads ---------------------------------------------------------------------------------
    def acquire(self, namespace: Namespace, block_hashes: Sequence[int], now: float,
                defer_uses: bool = False, granted: list[int] | None = None) -> tuple[int, list[int]]:
        """Pin the leading blocks of `block_hashes` held under `namespace`, promoted to DRAM; returns (lease, their
        slots). Lease 0 and no slots when nothing matches. `defer_uses`: when every block matched is in DRAM already
        (nothing to promote), their uses are counted by the next `settle` instead, so the server answers first and
        prices the blocks after (the policy core's work per block is half an acquire's round trip here); the pins
        are taken at once either way. `granted` (a list): the reader is a worker on another store node; its read
        counts toward the store's replication rule (`KVStore.on_loaded`), and the hashes of the blocks leased that
        the rule grants a copy on the reader's node are appended (its worker writes them there)."""
        namespace = tuple(namespace)
        store = self.store
        run = list(block_hashes[: store.match(block_hashes, namespace)])
        if not run:
            return 0, []
        store.pin(run)
        entries = store.nodes[self.NODE].entries
        if defer_uses and granted is None and all(entries[h].tier == DRAM for h in run):
            self._unsettled.append((run, namespace))
            return self._lease(run, now)
        # a use each; disk copies move up to DRAM
        due = store.on_loaded(self.NODE if granted is None else self.READER_ELSEWHERE,
                              [(h, self.NODE) for h in run], reader_elsewhere=granted is not None)
        self._apply({}, namespace)
        entries = store.nodes[self.NODE].entries
        num = 0
        while num < len(run) and run[num] in entries and entries[run[num]].tier == DRAM:
            num += 1
        store.unpin(run[num:])
        if not num:
            return 0, []
        if granted is not None:
            leased = set(run[:num])
            granted.extend(h for h in due if h in leased)
        return self._lease(run[:num], now)

    def _lease(self, run: list[int], now: float) -> tuple[int, list[int]]:
        lease = next(self._lease_ids)
        slots = [self._slot_of[h] for h in run]
        self._leases[lease] = _Lease(run, slots, now + self.lease_s)
        self.num_loaded_blocks += len(run)
        return lease, slots

    def settle(self) -> None:
        """Count the uses `acquire(defer_uses=True)` left for later (in their order), as an eager acquire would have."""
        while self._unsettled:
            run, namespace = self._unsettled.popleft()
            self.store.on_loaded(self.NODE, [(h, self.NODE) for h in run])
            self._apply({}, namespace)

    def release(self, lease: int) -> bool:
        held = self._leases.get(lease)
        if held is None:
            return False
        if held.num_reads:  # a TCP read still streams its slots: the last `end_read` lets it go
            held.expires_at = float("-inf")
            return True
        del self._leases[lease]
        self.store.unpin(held.block_hashes)
        return True

    def begin_read(self, lease: int) -> list[int] | None:
        """A TCP read of the lease's slots starts (`kvbaton.transfer.store_tcp`): its slots, or None when there is no
        such lease (expired, released, never given). Until `end_read` neither expiry nor a release unpins it."""
        held = self._leases.get(lease)
        if held is None or held.expires_at == float("-inf"):
            return None
        held.num_reads += 1
        return list(held.slots)

    def end_read(self, lease: int) -> None:
        held = self._leases.get(lease)
        if held is None:
            return
        held.num_reads -= 1
        if not held.num_reads and held.expires_at == float("-inf"):
            self.release(lease)

    def expire(self, now: float) -> int:
        """Drop the leases whose time is up (their worker died or hung mid-load); returns how many. A lease a TCP
        read is streaming waits for the read's end (the read's socket timeout bounds it)."""
        expired = [lease for lease, held in self._leases.items() if held.expires_at <= now and not held.num_reads]
        for lease in expired:
            self.release(lease)
        self.num_expired_leases += len(expired)
        return len(expired)

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    @property
    def num_dram_blocks(self) -> int:
        return len(self._slot_of)

    @property
    def num_disk_blocks(self) -> int:
        return len(self._on_disk)

    def touch(self, namespace: Namespace, block_hashes: Sequence[int]) -> int:
        """A same-host worker copied these blocks from their slots without a lease (an unleased read, found in the
        slot index: `kvbaton.transfer.store_slots`): a use each, as an acquire counts them (only those still in DRAM
        under `namespace`: one moved since was a miss for that worker). Returns how many."""
        namespace = tuple(namespace)
        entries = self.store.nodes[self.NODE].entries
        held = [h for h in block_hashes
                if (entry := entries.get(h)) is not None and entry.tier == DRAM and entry.namespace == namespace]
        if held:
            self.store.on_loaded(self.NODE, [(h, self.NODE) for h in held])
            self._apply({}, namespace)
            self.num_loaded_blocks += len(held)
        return len(held)

    def clear(self) -> int:
        """Drop every block no lease pins, from DRAM and disk (`KVStore.clear`); returns how many."""
        num = self.store.clear(self.NODE)
        self._apply({}, ())
        return num

    # ---- readers -------------------------------------------------------------------------------
    def events_since(self, seq: int) -> tuple[list[StoreEvent], bool]:
        """The node's events after `seq`, or (when the log no longer reaches back that far) a snapshot; the flag
        says which."""
        log = self._log
        if seq >= self.store.nodes[self.NODE].seq:
            return [], False
        if log and log[0].seq <= seq + 1:
            return [event for event in log if event.seq > seq], False
        return self.store.snapshot(self.NODE), True

    # ---- bytes follow the policy core -----------------------------------------------------------
    def _apply(self, payloads: dict[int, bytes | memoryview], namespace: Namespace) -> None:
        """Replay the core's new events onto the bytes. Blocks entering DRAM take their slots at the end of the
        batch, in chain order, from the lowest free ones: on a full node each block's room is freed by a victim
        first, and victims free their slots in eviction order (a chain's from its leaf up), so slots taken as
        they came would leave a chain's blocks in descending or scattered slots, copied block by block where a
        run of ascending slots is one copy per row. A block that enters DRAM and leaves again within the batch
        never takes a slot."""
        while True:
            corrupt = []
            entering: dict[int, None] = {}  # blocks to slot at the batch's end, in order
            for event in self.store.take_events(self.NODE):
                self._log.append(event)
                for block_hash in event.block_hashes:
                    if event.kind == "stored" and event.tier == DRAM:
                        entering[block_hash] = None
                    elif event.kind == "stored":
                        if block_hash in entering:
                            del entering[block_hash]  # it never took a slot
                            if block_hash in self._on_disk:
                                continue  # promoted and moved back within the batch: its file never left
                        self._to_disk(block_hash, payloads, namespace)
                    else:
                        entering.pop(block_hash, None)
                        self._forget(block_hash)
            for block_hash in entering:
                if not self._to_dram(block_hash, payloads, namespace):
                    corrupt.append(block_hash)
            if not corrupt:
                self.slots.num_disk_blocks = len(self._on_disk)  # for same-host workers' unleased reads
                return
            for block_hash in corrupt:
                self.store.discard(self.NODE, block_hash)

    def _to_dram(self, block_hash: int, payloads: dict[int, bytes | memoryview], namespace: Namespace) -> bool:
        slot = self.slots.allocate()
        self._slot_of[block_hash] = slot
        if block_hash in self._on_disk:  # a promotion: the file comes back, checked
            self._on_disk.discard(block_hash)
            data = self.disk.read(block_hash, self._namespace_of[block_hash], self.block_bytes)
            self.disk.remove(block_hash)
            if data is None:
                return False
            self.slots.write(slot, data)
        else:
            self._namespace_of[block_hash] = namespace
            self.slots.write(slot, payloads[block_hash])
        self.slots.publish(slot, block_hash, self._namespace_of[block_hash])  # same-host workers may read it now
        return True

    def _to_disk(self, block_hash: int, payloads: dict[int, bytes | memoryview], namespace: Namespace) -> None:
        slot = self._slot_of.pop(block_hash, None)
        if slot is not None:
            self.disk.write(block_hash, self._namespace_of[block_hash], self.slots.read(slot))
            self.slots.free(slot)
        else:  # a node without DRAM room stores a new block straight to disk
            self._namespace_of[block_hash] = namespace
            self.disk.write(block_hash, namespace, payloads[block_hash])
        self._on_disk.add(block_hash)

    def _forget(self, block_hash: int) -> None:
        slot = self._slot_of.pop(block_hash, None)
        if slot is not None:
            self.slots.free(slot)
        if block_hash in self._on_disk:
            self._on_disk.discard(block_hash)
            self.disk.remove(block_hash)
        self._namespace_of.pop(block_hash, None)

    def close(self) -> None:
        self.slots.close()

    def check_invariants(self) -> None:
        """The core's invariants; DRAM entries are exactly the slotted blocks, disk entries exactly the files; slots
        are each free or held once; every pin belongs to a lease."""
        self.settle()
        store = self.store
        store.check_invariants()
        entries = store.nodes[self.NODE].entries
        assert {h for h, e in entries.items() if e.tier == DRAM} == self._slot_of.keys(), "DRAM entries != slots"
        assert {h for h, e in entries.items() if e.tier == DISK} == self._on_disk, "disk entries != files"
        assert self._namespace_of.keys() == entries.keys(), "namespaces out of date"
        assert len(set(self._slot_of.values())) == len(self._slot_of), "a slot holds two blocks"
        assert len(self._slot_of) + self.slots.num_free_slots == self.slots.num_slots, "slots leak"
        self.slots.check_index(self._slot_of)
        if self.disk is not None:
            assert self.disk.num_files() == len(self._on_disk), "block files leak"
        pins: dict[int, int] = {}
        for held in self._leases.values():
            for block_hash in held.block_hashes:
                pins[block_hash] = pins.get(block_hash, 0) + 1
        for block_hash, entry in entries.items():
            assert entry.num_pins == pins.get(block_hash, 0), f"block {block_hash} pinned by no lease"
