"""LRU eviction for the radix prefix cache: the logical tick, the heap of evictable leaves, `evict`, `clear`.

A mixin base of `kvbaton.cache.radix_cache.RadixCache`, which owns all the state named below and
creates it in its `__init__`; the split is by responsibility only (a base class's methods cost
nothing extra at call time, which matters: `_touch` runs on every match and insert).

LRU without clocks: a logical tick advances on every touching match and every insert (`_touch`),
and marks root..node; so a parent's tick is never older than its children's. Evictable leaves
(unlocked, childless) sit in a lazy min-heap keyed by (tick, node serial); stale entries are
skipped when popped and the heap is rebuilt when it grows past twice the node count, so
`evict(k)` costs O(k log n) rather than a scan of the tree. Eviction only ever trims blocks from
the tail of an unlocked leaf; a leaf that becomes empty leaves the tree (its parent may become
evictable).

Events: `evict` emits one EVICTED event per call listing the hashes in eviction order; `clear`
emits CLEARED when the cache ends up empty and EVICTED (with the hashes) when locked blocks survive.
With a host tier (`kvbaton.cache.host_tier`), `evict` demotes the blocks it trims there instead, and
its EVICTED event lists only the hashes that left both tiers; `clear` empties both.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator

from kvbaton.cache.block_pool import BlockPool
from kvbaton.cache.events import KVEventKind
from kvbaton.cache.host_tier import EvictedBlock, HostTier
from kvbaton.cache.radix_node import RadixNode


class RadixEviction:
    """Marks recency on the tree of a `RadixCache` (its only subclass) and evicts its least recently used leaves."""

    # State and helpers the subclass provides (see RadixCache.__init__); declared for readers and checkers.
    pool: BlockPool
    _tick: int  # the logical LRU clock: advanced by every `_touch`
    _heap_pushes: itertools.count[int]  # unique third heap field: entries never compare nodes
    _evictable_heap: list[tuple[int, int, int, RadixNode]]
    _num_nodes: int
    _num_cached_blocks: int
    _cached_block_ids: set[int]
    tier: HostTier | None  # where evicted blocks go, if anywhere
    _emit: Callable[[KVEventKind, tuple[int, ...], int | None], None]
    _iter_nodes: Callable[..., Iterator[RadixNode]]

    def evict(self, num_blocks: int) -> int:
        """Free up to `num_blocks` blocks from unlocked leaves, least recently used first; returns how many."""
        num_freed, evicted_hashes = self._evict(num_blocks)
        if evicted_hashes:
            self._emit(KVEventKind.EVICTED, tuple(evicted_hashes), None)
        return num_freed

    def clear(self) -> int:
        """Drop every unlocked block (LRU order), and the host tier's; returns how many device blocks went back
        to the free queue."""
        tier, self.tier = self.tier, None  # nothing is demoted by a clear
        try:
            num_freed, evicted_hashes = self._evict(None)
        finally:
            self.tier = tier
        if tier is not None:
            evicted_hashes.extend(tier.clear())
        if evicted_hashes:
            if self._num_cached_blocks == 0:
                self._emit(KVEventKind.CLEARED, (), None)
            else:
                self._emit(KVEventKind.EVICTED, tuple(evicted_hashes), None)
        return num_freed

    def _touch(self, node: RadixNode) -> None:
        self._tick += 1
        current: RadixNode | None = node
        while current is not None:
            current.last_access = self._tick
            current = current.parent
        self._push_if_evictable(node)

    def _push_if_evictable(self, node: RadixNode) -> None:
        if node.parent is None or node.children or node.lock_ref > 0 or not node.attached:
            return
        heapq.heappush(self._evictable_heap, (node.last_access, node.serial, next(self._heap_pushes), node))
        if len(self._evictable_heap) > 2 * self._num_nodes + 64:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        self._evictable_heap = [
            (node.last_access, node.serial, next(self._heap_pushes), node)
            for node in self._iter_nodes(ordered=False)
            if not node.children and node.lock_ref == 0
        ]
        heapq.heapify(self._evictable_heap)

    def _lru_leaf(self) -> RadixNode | None:
        """The least recently used evictable leaf, dropping stale heap entries on the way."""
        heap = self._evictable_heap
        while heap:
            tick, _, _, node = heap[0]
            if node.attached and not node.children and node.lock_ref == 0 and node.last_access == tick:
                return node
            heapq.heappop(heap)
        return None

    def _evict(self, num_blocks: int | None) -> tuple[int, list[int]]:
        """Trim LRU leaves block by block until `num_blocks` are free (None: all unlocked)."""
        num_freed = 0
        evicted_hashes: list[int] = []
        tier = self.tier
        demoted: list[EvictedBlock] = []
        while num_blocks is None or num_freed < num_blocks:
            node = self._lru_leaf()
            if node is None:
                break
            block_id = node.block_ids.pop()
            token_block = node.token_blocks.pop()
            block_hash = node.block_hashes.pop()
            self._cached_block_ids.discard(block_id)
            self._num_cached_blocks -= 1
            self.pool.release([block_id])
            num_freed += self.pool.ref_count(block_id) == 0
            if tier is None:
                evicted_hashes.append(block_hash)
            else:  # its KV stays in the freed block until the next allocation: `demote` copies it out first
                parent_hash = node.block_hashes[-1] if node.block_hashes else node.parent_hash
                demoted.append(EvictedBlock(block_hash, token_block, parent_hash, block_id, node.namespace))
            if not node.block_ids:
                self._detach(node)
        if demoted:
            evicted_hashes = tier.demote(demoted)  # type: ignore[union-attr]
        return num_freed, evicted_hashes

    def _detach(self, node: RadixNode) -> None:
        parent = node.parent
        assert parent is not None and node.key is not None
        del parent.children[node.key]
        node.attached = False
        node.parent = None
        self._num_nodes -= 1
        self._push_if_evictable(parent)
