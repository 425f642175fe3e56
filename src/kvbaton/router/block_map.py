"""Block hash -> radix segment lookups for the global prefix index, built lazily off the routing path.

Routing only walks the tree by segment (first hash of each child), so a per-block map is needed
only by the readers that name an arbitrary block: KV events (the parent of a stored run, an evicted
block) and the `holders`/`num_routed` accessors. Keeping that map exact on every routing decision
cost a random-access dict write per new block and a pop per evicted block (about 0.2 µs each at
100,000 blocks, most of a decision); here the writer only queues whole segments, and the per-block
work happens at the next lookup, in bulk. Invariants:
- every live segment is either queued or has all its blocks mapped to it;
- a mapped entry may be stale (its segment was deleted, trimmed or split after mapping): `get`
  checks the segment is live and still holds the block, and a split queues the tail, whose blocks
  are remapped before any lookup;
- stale entries are dropped once they outnumber the live blocks, so memory stays O(live blocks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import repeat
from typing import Generic, Protocol, TypeVar


class _HasHashes(Protocol):
    hashes: list[int]


SegmentT = TypeVar("SegmentT", bound=_HasHashes)

_MIN_STALE_ENTRIES = 4096  # below this many stale entries a rebuild is not worth its pause


class LazyBlockMap(Generic[SegmentT]):
    def __init__(self, is_live: Callable[[SegmentT], bool]) -> None:
        self._is_live = is_live  # True while the segment is in the tree (not deleted)
        self._mapped: dict[int, SegmentT] = {}  # block hash -> segment, possibly stale (see module doc)
        self._queued: dict[int, SegmentT] = {}  # segments whose blocks are not mapped yet, by first hash

    def add(self, segment: SegmentT) -> None:
        """A new segment (or a split's tail): its blocks are mapped before the next lookup."""
        self._queued[segment.hashes[0]] = segment

    def discard(self, segment: SegmentT) -> None:
        """A deleted segment: forget it if still queued (mapped entries go stale and are checked on read)."""
        if self._queued.get(segment.hashes[0]) is segment:
            del self._queued[segment.hashes[0]]

    def get(self, block_hash: int, num_live_blocks: int, live: Callable[[], Iterable[SegmentT]]) -> SegmentT | None:
        """The live segment holding `block_hash`, or None.

        `num_live_blocks` and `live` (all live segments) let it rebuild the map when stale entries
        dominate; both must describe the tree as it is now.
        """
        if self._queued:
            self._map_queued(num_live_blocks, live)
        segment = self._mapped.get(block_hash)
        if segment is None or not self._is_live(segment) or block_hash not in segment.hashes:
            return None
        return segment

    def _map_queued(self, num_live_blocks: int, live: Callable[[], Iterable[SegmentT]]) -> None:
        mapped = self._mapped
        for segment in self._queued.values():
            mapped.update(zip(segment.hashes, repeat(segment)))
        self._queued.clear()
        if len(mapped) > 2 * num_live_blocks + _MIN_STALE_ENTRIES:
            self._mapped = {h: s for s in live() for h in s.hashes}

    def check_invariants(self, live_segments: Iterable[SegmentT]) -> None:
        """Every live block resolves to its segment (maps the queue first)."""
        for segment in self._queued.values():
            assert self._is_live(segment), "a deleted segment is still queued"
        segments = list(live_segments)
        num_blocks = sum(len(s.hashes) for s in segments)
        for segment in segments:
            for block_hash in segment.hashes:
                assert self.get(block_hash, num_blocks, lambda: segments) is segment, f"block {block_hash} misplaced"
