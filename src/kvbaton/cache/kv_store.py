"""The cluster KV store's policy core (Mooncake): which node keeps which block, in which tier, and what it evicts.

Plain Python over metadata: blocks are named by their chained hash (`kvbaton.cache.hashing`), which chains
from the worker cache key's root hash (model revision, KV layout with its parallelism, tenant salt), and
each entry also keeps that key (`namespace`) so a lookup under another key never matches, whatever two
64-bit hashes share. The bytes live elsewhere (shared memory, files, a simulated link); this decides.

- **Nodes and tiers.** Every store node has a host-DRAM tier and a local-disk tier, each with a capacity in
  blocks (from GB: `capacity_blocks`). A block is in at most one tier of a node. New blocks go to DRAM;
  DRAM's victim moves to disk (while the disk has room or evicts its own victim), disk's victim leaves the
  node. A hit on disk promotes the block back to DRAM.
- **One copy by default.** `put` of a block already held anywhere stores nothing: the cluster holds each
  block once, on the writer's node (the worker that computed it, so its next turn reads it locally), or
  on the node with the most free DRAM when the writer's node is not a store node.
- **Hot blocks replicate** by one rule (`on_loaded`): a block read across the network by a reader on another
  node for the `replicate_after_remote_loads`-th time (default 2) gets a copy on the reader's node; each copy
  written by a worker grants at most `max_replicas - 1` copies (default 2 copies in all) and a copy grants none.
  One copy of a cold block, a second near a second hot reader. The rule reads only the source copy's own counts,
  so a live node, which keeps its own store and knows no other node's copies, decides as the simulator's
  cluster-wide store does: it names the blocks due a copy to the reader, whose worker writes them to its own
  node (`put(..., replica=True)`).
- **Eviction: GDSF** (greedy-dual size-frequency) per node and tier. A block's priority is
  `H = L + uses x recompute_s / size`, all blocks one size; `uses` counts the times it was stored or read,
  `recompute_s` is what recomputing it would cost (the caller prices it: its prefill at its depth), and
  `L`, the tier's inflation clock, rises to each victim's H so blocks not touched for long lose to
  newer ones (aging, no wall clock). A block's H is capped at its parent's when the parent is in the same
  tier, and ties go to the deepest block, so eviction trims prefixes from their end. Pinned blocks (a
  load in flight, `pin` / `unpin`) are never evicted.
- **Events.** Each node numbers its changes 1, 2, 3, ...: STORED (block now in `tier` of the node, a move
  included) and EVICTED (gone from the node), and CLEARED when the node is lost; `snapshot` rebuilds a
  node's content. `kvbaton.cache.store_directory.StoreDirectory` replays them; any number of routers may
  each keep one, so nothing here assumes a single reader.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from kvbaton.core.errors import InvalidRequestError

DRAM, DISK = "dram", "disk"
TIERS = (DRAM, DISK)
NodeId = str


def capacity_blocks(gb: float, block_bytes: int) -> int:
    """Blocks of `block_bytes` that `gb` GB (1e9 bytes) hold."""
    if gb < 0 or block_bytes <= 0:
        raise InvalidRequestError(f"a store tier needs gb >= 0 and block_bytes > 0, got {gb}, {block_bytes}")
    return int(gb * 1e9 // block_bytes)


def choose_source(holders: dict[NodeId, str], reader: NodeId) -> tuple[NodeId, str]:
    """The copy a reader on node `reader` loads (holders: node -> tier, non-empty): its own node's, else a DRAM
    copy before a disk one, lowest node id first (deterministic)."""
    if reader in holders:
        return reader, holders[reader]
    return min(holders.items(), key=lambda item: (item[1] != DRAM, item[0]))


@dataclass(frozen=True, slots=True)
class StoreConfig:
    dram_blocks_per_node: int
    disk_blocks_per_node: int = 0
    replicate_after_remote_loads: int = 2  # 0: never replicate
    max_replicas: int = 2

    def __post_init__(self) -> None:
        if self.dram_blocks_per_node < 0 or self.disk_blocks_per_node < 0:
            raise InvalidRequestError("store capacities must be >= 0 blocks")
        if self.replicate_after_remote_loads < 0 or self.max_replicas < 1:
            raise InvalidRequestError("replicate_after_remote_loads must be >= 0 and max_replicas >= 1")


@dataclass(frozen=True, slots=True)
class StoreEvent:
    seq: int  # 1, 2, 3, ... per node; a gap tells a directory it missed events and must take a snapshot
    kind: str  # "stored" | "evicted" | "cleared"
    block_hashes: tuple[int, ...]
    tier: str = ""  # stored: the tier the blocks are now in


class _Entry:
    __slots__ = ("block_hash", "parent_hash", "namespace", "depth", "recompute_s", "tier", "uses", "priority",
                 "num_pins", "num_remote_loads", "num_copies", "replica", "version")

    def __init__(self, block_hash: int, parent_hash: int, namespace: Hashable, depth: int, recompute_s: float) -> None:
        self.block_hash = block_hash
        self.parent_hash = parent_hash
        self.namespace = namespace
        self.depth = depth  # blocks before it in its prompt
        self.recompute_s = recompute_s
        self.tier = DRAM
        self.uses = 1
        self.priority = 0.0
        self.num_pins = 0
        self.num_remote_loads = 0
        self.num_copies = 0  # copies this one granted (`on_loaded`)
        self.replica = False  # a copy made by the replication rule: it grants none
        self.version = 0  # bumped at every re-prioritisation: older heap entries are stale


class StoreNode:
    """One node's tiers: entries by hash, a GDSF heap and inflation clock per tier, its event stream."""

    def __init__(self, node_id: NodeId, capacity: dict[str, int]) -> None:
        self.node_id = node_id
        self.capacity = capacity
        self.entries: dict[int, _Entry] = {}
        self.num_in: dict[str, int] = dict.fromkeys(TIERS, 0)
        self.inflation: dict[str, float] = dict.fromkeys(TIERS, 0.0)
        self.heaps: dict[str, list[tuple[float, int, int, int, int]]] = {tier: [] for tier in TIERS}
        self.seq = 0
        self.events: list[StoreEvent] = []

    def free_blocks(self, tier: str) -> int:
        return self.capacity[tier] - self.num_in[tier]


class KVStore:
    """The store's metadata over all nodes; see the module docstring. One thread calls it (router or sim loop)."""

    def __init__(self, config: StoreConfig, node_ids: Sequence[NodeId] = ()) -> None:
        self.config = config
        self.nodes: dict[NodeId, StoreNode] = {}
        self._where: dict[int, dict[NodeId, str]] = {}  # hash -> node -> tier (authoritative)
        self._pushes = itertools.count()
        self.num_stored_blocks = self.num_evicted_blocks = self.num_replicated_blocks = 0
        self.num_dropped_puts = 0  # puts that found no room (every candidate victim pinned)
        self._lost: dict[NodeId, list[StoreEvent]] = {}  # a lost node's events not yet taken, ending CLEARED
        self._lost_seq: dict[NodeId, int] = {}  # a lost node's last seq: numbering goes on if it comes back
        for node_id in node_ids:
            self.add_node(node_id)

    # ---- nodes ---------------------------------------------------------------------------------
    def add_node(self, node_id: NodeId, dram_blocks: int | None = None, disk_blocks: int | None = None) -> None:
        if node_id in self.nodes:
            raise ValueError(f"store node {node_id!r} already exists")
        cfg = self.config
        node = self.nodes[node_id] = StoreNode(node_id, {
            DRAM: cfg.dram_blocks_per_node if dram_blocks is None else dram_blocks,
            DISK: cfg.disk_blocks_per_node if disk_blocks is None else disk_blocks})
        # A node back after a loss goes on numbering from its CLEARED, whose events (not yet taken) come first.
        node.events = self._lost.pop(node_id, [])
        node.seq = self._lost_seq.pop(node_id, 0)

    def remove_node(self, node_id: NodeId) -> list[int]:
        """The node is lost with everything on it (pins included: their loads fail and recompute); returns the
        hashes it held. Its last event, CLEARED, stays readable through `take_events` until the node is added
        again."""
        node = self.nodes.pop(node_id, None)
        if node is None:
            return []
        for block_hash in node.entries:
            holders = self._where[block_hash]
            del holders[node_id]
            if not holders:
                del self._where[block_hash]
        node.seq += 1
        self._lost[node_id] = node.events + [StoreEvent(node.seq, "cleared", ())]
        self._lost_seq[node_id] = node.seq
        return list(node.entries)

    # ---- reads ---------------------------------------------------------------------------------
    def locations(self, block_hash: int) -> dict[NodeId, str]:
        """node -> tier of every copy (a copy; empty when the cluster does not hold it)."""
        return dict(self._where.get(block_hash, ()))

    def match(self, block_hashes: Sequence[int], namespace: Hashable = None) -> int:
        """How many leading `block_hashes` the store holds under `namespace` (somewhere, in some tier)."""
        where = self._where
        nodes = self.nodes
        for i, block_hash in enumerate(block_hashes):
            holders = where.get(block_hash)
            if holders is None:
                return i
            node_id = next(iter(holders))
            if nodes[node_id].entries[block_hash].namespace != namespace:
                return i
        return len(block_hashes)

    def best_source(self, block_hash: int, reader: NodeId) -> tuple[NodeId, str] | None:
        """Where a reader on node `reader` loads the block from: its own node first, else DRAM before disk, else
        the lowest node id (deterministic)."""
        holders = self._where.get(block_hash)
        if not holders:
            return None
        return choose_source(holders, reader)

    def depth_after(self, parent_hash: int) -> int:
        """The depth of a block following the block hashed `parent_hash`: one more than the parent's, 0 when the
        store does not hold the parent."""
        holders = self._where.get(parent_hash)
        if not holders:
            return 0
        return self.nodes[next(iter(holders))].entries[parent_hash].depth + 1

    @property
    def num_blocks(self) -> int:
        """Copies held, all nodes and tiers."""
        return sum(len(node.entries) for node in self.nodes.values())

    # ---- writes --------------------------------------------------------------------------------
    def put(self, writer: NodeId, block_hashes: Sequence[int], parent_hash: int, namespace: Hashable,
            first_depth: int, recompute_s: Callable[[int], float], replica: bool = False) -> list[int]:
        """Store the chain `block_hashes` (following the block hashed `parent_hash`, the first at depth
        `first_depth` blocks) written by a worker on `writer`; blocks the cluster holds are skipped (one copy).
        `replica`: the copies another node's `on_loaded` granted (a live reader writes them; they grant none).
        `recompute_s(depth)` prices a block. Returns the positions in `block_hashes` of the blocks stored and still
        held when it returns (their bytes are to be written: a chain longer than the room may push out its own
        head)."""
        node = self._node_for(writer)
        stored = []
        parent = parent_hash
        for i, block_hash in enumerate(block_hashes):
            if block_hash not in self._where and node is not None:
                entry = _Entry(block_hash, parent, namespace, first_depth + i, recompute_s(first_depth + i))
                entry.replica = replica
                if self._insert(node, entry):
                    stored.append(i)
            parent = block_hash
        if node is not None:
            stored = [i for i in stored if block_hashes[i] in node.entries]
        self.num_stored_blocks += len(stored)
        return stored

    def pin(self, block_hashes: Sequence[int]) -> None:
        """Keep every copy of these blocks from eviction (a load of them is in flight); each needs one `unpin`."""
        for block_hash in block_hashes:
            for node_id in self._where.get(block_hash, ()):
                self.nodes[node_id].entries[block_hash].num_pins += 1

    def unpin(self, block_hashes: Sequence[int]) -> None:
        for block_hash in block_hashes:
            for node_id in self._where.get(block_hash, ()):
                entry = self.nodes[node_id].entries[block_hash]
                entry.num_pins = max(0, entry.num_pins - 1)  # a copy replicated after the pin holds none

    def on_loaded(self, reader: NodeId, sources: Sequence[tuple[int, NodeId]], reader_elsewhere: bool = False
                  ) -> list[int]:
        """A reader on node `reader` loaded these blocks, each from (hash, source node): they are used once more,
        a disk copy read is promoted to DRAM, and a block read across the network often enough is replicated on
        the reader's node. `reader_elsewhere`: the reader's node is a store node this store does not keep (a live
        node keeps only its own blocks): the copies due are not made here but returned, for the reader to write.
        Returns the hashes granted a copy."""
        cfg = self.config
        granted: list[int] = []
        for block_hash, source in sources:
            node = self.nodes.get(source)
            entry = node.entries.get(block_hash) if node is not None else None
            if entry is None:
                continue  # evicted or lost since: the load would have failed over to recompute
            entry.uses += 1
            if entry.tier == DISK and node.capacity[DRAM] > 0:
                self._move(node, entry, DRAM)
            else:
                self._prioritise(node, entry)
            if source == reader or (reader not in self.nodes and not reader_elsewhere):
                continue
            entry.num_remote_loads += 1
            if not (cfg.replicate_after_remote_loads and entry.num_remote_loads >= cfg.replicate_after_remote_loads
                    and not entry.replica and entry.num_copies < cfg.max_replicas - 1):
                continue
            if not reader_elsewhere:
                if reader in self._where[block_hash]:
                    continue
                copy = _Entry(block_hash, entry.parent_hash, entry.namespace, entry.depth, entry.recompute_s)
                copy.uses, copy.replica = entry.uses, True
                if not self._insert(self.nodes[reader], copy):
                    continue
                self.num_replicated_blocks += 1
            entry.num_copies += 1
            granted.append(block_hash)
        return granted

    def discard(self, node_id: NodeId, block_hash: int) -> bool:
        """The node's copy of the block is unusable (its bytes failed a check): it leaves the node, EVICTED, pinned
        or not (a load that pinned it finds it gone and recomputes). False when the node did not hold it."""
        node = self.nodes.get(node_id)
        entry = node.entries.get(block_hash) if node is not None else None
        if entry is None:
            return False
        self._drop(node, entry)
        return True

    def clear(self, node_id: NodeId) -> int:
        """Drop every block of the node that no load pins (an admin's reset: vLLM's `reset_prefix_cache` reaching the
        store), in one EVICTED event; returns how many. Pinned blocks stay until their loads end."""
        node = self.nodes.get(node_id)
        if node is None:
            return 0
        victims = [entry for entry in node.entries.values() if not entry.num_pins]
        for entry in victims:
            self._forget(node, entry)
        for tier in TIERS:  # only the pinned blocks' heap entries are left to keep
            node.heaps[tier] = [item for item in node.heaps[tier] if item[4] in node.entries]
            heapq.heapify(node.heaps[tier])
        if victims:
            self.num_evicted_blocks += len(victims)
            self._emit(node, StoreEvent(0, "evicted", tuple(entry.block_hash for entry in victims)))
        return len(victims)

    # ---- events --------------------------------------------------------------------------------
    def take_events(self, node_id: NodeId) -> list[StoreEvent]:
        """The node's events since the last call, in seq order (a lost node's, ending CLEARED, once)."""
        if node_id in self._lost:
            return self._lost.pop(node_id)
        node = self.nodes.get(node_id)
        if node is None:
            return []
        events, node.events = node.events, []
        return events

    def snapshot(self, node_id: NodeId) -> list[StoreEvent]:
        """STORED events rebuilding the node's content, all at its latest seq (empty for an unknown node)."""
        node = self.nodes.get(node_id)
        if node is None:
            return []
        by_tier: dict[str, list[int]] = {tier: [] for tier in TIERS}
        for block_hash, entry in sorted(node.entries.items()):
            by_tier[entry.tier].append(block_hash)
        return [StoreEvent(node.seq, "stored", tuple(hashes), tier) for tier, hashes in by_tier.items() if hashes]

    # ---- internals -----------------------------------------------------------------------------
    def _node_for(self, writer: NodeId) -> StoreNode | None:
        node = self.nodes.get(writer)
        if node is not None and node.capacity[DRAM] + node.capacity[DISK] > 0:
            return node
        candidates = [n for n in self.nodes.values() if n.capacity[DRAM] + n.capacity[DISK] > 0]
        if not candidates:
            return None
        return min(candidates, key=lambda n: (-n.free_blocks(DRAM), -n.free_blocks(DISK), n.node_id))

    def _insert(self, node: StoreNode, entry: _Entry) -> bool:
        """Place a new entry in the node's DRAM (its disk when it has no DRAM), making room; False if none."""
        tier = DRAM if node.capacity[DRAM] > 0 else DISK
        if not self._make_room(node, tier):
            self.num_dropped_puts += 1
            return False
        entry.tier = tier
        node.entries[entry.block_hash] = entry
        node.num_in[tier] += 1
        self._where.setdefault(entry.block_hash, {})[node.node_id] = tier
        self._prioritise(node, entry)
        self._emit(node, StoreEvent(0, "stored", (entry.block_hash,), tier))
        return True

    def _make_room(self, node: StoreNode, tier: str) -> bool:
        """At least one free block in `tier`: its GDSF victim moves to disk (from DRAM) or leaves the node."""
        if node.capacity[tier] <= 0:
            return False
        if node.free_blocks(tier) > 0:
            return True
        victim = self._victim(node, tier)
        if victim is None:
            return False
        node.inflation[tier] = max(node.inflation[tier], victim.priority)
        if tier == DRAM and node.capacity[DISK] > 0 and self._make_room(node, DISK):
            self._move(node, victim, DISK)
        else:
            self._drop(node, victim)
        return True

    def _victim(self, node: StoreNode, tier: str) -> _Entry | None:
        """The least-priority unpinned entry of the tier (stale heap entries dropped, pinned ones kept)."""
        heap = node.heaps[tier]
        pinned = []
        victim = None
        while heap:
            item = heapq.heappop(heap)
            entry = node.entries.get(item[4])
            if entry is None or entry.tier != tier or entry.version != item[3]:
                continue
            if entry.num_pins:
                pinned.append(item)
                continue
            victim = entry
            break
        for item in pinned:
            heapq.heappush(heap, item)
        return victim

    def _move(self, node: StoreNode, entry: _Entry, tier: str) -> None:
        """Move an entry to another tier of its node. To DRAM (a promotion) it leaves its disk slot first, which
        DRAM's victim may then take; with no room in DRAM it stays where it was."""
        source = entry.tier
        node.num_in[source] -= 1
        entry.tier = ""  # in transit: no tier's victim
        entry.version += 1
        if tier == DRAM and not self._make_room(node, DRAM):
            tier = source
        entry.tier = tier
        node.num_in[tier] += 1
        self._prioritise(node, entry)
        if tier != source:
            self._where[entry.block_hash][node.node_id] = tier
            self._emit(node, StoreEvent(0, "stored", (entry.block_hash,), tier))

    def _drop(self, node: StoreNode, entry: _Entry) -> None:
        self._forget(node, entry)
        self.num_evicted_blocks += 1
        self._emit(node, StoreEvent(0, "evicted", (entry.block_hash,)))

    def _forget(self, node: StoreNode, entry: _Entry) -> None:
        """Take an entry out of its node and the location map (its heap item goes stale); no event."""
        del node.entries[entry.block_hash]
        node.num_in[entry.tier] -= 1
        holders = self._where[entry.block_hash]
        del holders[node.node_id]
        if not holders:
            del self._where[entry.block_hash]

    def _prioritise(self, node: StoreNode, entry: _Entry) -> None:
        """H = L + uses x recompute_s, capped at the parent's H in the same tier of this node."""
        priority = node.inflation[entry.tier] + entry.uses * entry.recompute_s
        parent = node.entries.get(entry.parent_hash)
        if parent is not None and parent.tier == entry.tier:
            priority = min(priority, parent.priority)
        entry.priority = priority
        entry.version += 1
        heapq.heappush(node.heaps[entry.tier], (priority, -entry.depth, next(self._pushes), entry.version,
                                                entry.block_hash))
        if len(node.heaps[entry.tier]) > 2 * node.num_in[entry.tier] + 64:
            node.heaps[entry.tier] = [(e.priority, -e.depth, next(self._pushes), e.version, h)
                                      for h, e in node.entries.items() if e.tier == entry.tier]
            heapq.heapify(node.heaps[entry.tier])

    def _emit(self, node: StoreNode, event: StoreEvent) -> None:
        node.seq += 1
        node.events.append(StoreEvent(node.seq, event.kind, event.block_hashes, event.tier))

    def check_invariants(self) -> None:
        """Capacities hold, the location map equals the nodes' entries, copies stay within the replica limit
        and share one namespace, heaps hold every entry at its current priority, event seqs have no gap."""
        where: dict[int, dict[NodeId, str]] = {}
        for node_id, node in self.nodes.items():
            counts = dict.fromkeys(TIERS, 0)
            live = {tier: {(item[3], item[4]) for item in node.heaps[tier]} for tier in TIERS}
            for block_hash, entry in node.entries.items():
                assert entry.block_hash == block_hash and entry.tier in TIERS, "entry misfiled"
                counts[entry.tier] += 1
                where.setdefault(block_hash, {})[node_id] = entry.tier
                assert entry.num_pins >= 0 and entry.uses >= 1, "negative pins or no use"
                assert (entry.version, block_hash) in live[entry.tier], "entry missing from its tier's heap"
            assert counts == node.num_in, f"node {node_id} tier counts out of date"
            for tier in TIERS:
                assert node.num_in[tier] <= node.capacity[tier], f"node {node_id} {tier} over capacity"
            seqs = [event.seq for event in node.events]
            assert seqs == list(range(node.seq - len(seqs) + 1, node.seq + 1)), "event seqs have gaps"
        assert where == self._where, "location map out of date"
        for block_hash, holders in where.items():
            assert len(holders) <= self.config.max_replicas, f"block {block_hash} has {len(holders)} copies"
            namespaces = {self.nodes[n].entries[block_hash].namespace for n in holders}
            assert len(namespaces) == 1, "copies of one block under different keys"
