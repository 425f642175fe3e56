"""The radix prefix cache's LRU order: a logical tick and a lazy heap of its evictable leaves.

`LruLeaves` owns the recency state of one `kvbaton.cache.radix_cache.RadixCache` and nothing else:
the cache asks it which leaf is least recently used and trims that leaf itself.

LRU without clocks: a logical tick advances on every touching match and every insert (`touch`),
and marks root..node; so a parent's tick is never older than its children's. Evictable leaves
(attached, unlocked, childless) sit in a lazy min-heap keyed by (tick, node serial); stale entries
are skipped when popped and the heap is rebuilt from the tree when it grows past twice the node
count, so finding k victims costs O(k log n) rather than a scan of the tree.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Mapping

from kvbaton.cache.hashing import CacheKey
from kvbaton.cache.radix_node import RadixNode


class LruLeaves:
    """Recency marks on a radix tree and the heap of its evictable leaves, least recently used first."""

    def __init__(self, roots: Mapping[CacheKey, RadixNode]) -> None:
        self.tick = 0  # the logical LRU clock: advanced by every `touch`
        self._roots = roots  # the cache's roots (its own dict, read on a rebuild; no reference back to the cache)
        self._pushes = itertools.count()  # unique third heap field: entries never compare nodes
        self._heap: list[tuple[int, int, int, RadixNode]] = []

    def touch(self, node: RadixNode, num_nodes: int) -> None:
        """Mark root..node as just used; `num_nodes` is the tree's non-root node count."""
        self.tick += 1
        tick = self.tick
        current: RadixNode | None = node
        while current is not None:
            current.last_access = tick
            current = current.parent
        self.offer(node, num_nodes)

    def offer(self, node: RadixNode, num_nodes: int) -> None:
        """Enter `node` in the heap if it is evictable now (a leaf that changed: unlocked, trimmed child...)."""
        if node.parent is None or node.children or node.lock_ref > 0 or not node.attached:
            return
        heapq.heappush(self._heap, (node.last_access, node.serial, next(self._pushes), node))
        if len(self._heap) > 2 * num_nodes + 64:
            self._rebuild()

    def _rebuild(self) -> None:
        """The heap anew from the tree's evictable leaves (which are below the roots, never roots)."""
        heap = []
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node.parent is not None and node.lock_ref == 0:
                heap.append((node.last_access, node.serial, next(self._pushes), node))
        heapq.heapify(heap)
        self._heap = heap

    def least_recent(self) -> RadixNode | None:
        """The least recently used evictable leaf, dropping stale heap entries on the way; None if none."""
        heap = self._heap
        while heap:
            tick, _, _, node = heap[0]
            if node.attached and not node.children and node.lock_ref == 0 and node.last_access == tick:
                return node
            heapq.heappop(heap)
        return None

    def entries(self) -> set[tuple[int, int]]:
        """(tick, serial) of every heap entry, stale ones included: for the cache's invariant check."""
        return {(tick, node.serial) for tick, _, _, node in self._heap}
