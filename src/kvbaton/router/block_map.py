"""Block hash -> radix segment lookups for the global prefix index, built lazily off the routing path.

Routing only walks the tree by segment (first hash of each child), so a per-block map is needed
only by the readers that name an arbitrary block: KV events (the parent of a stored run, an evicted
block) and the `holders`/`num_routed` accessors. Keeping that map exact on every routing decision
cost a random-access dict write per new block and a pop per evicted block (about 0.2 µs each at
100,000 blocks, most of a decision); here the writer only queues whole segments, and the per-block
work happens at the next lookup, in bulk. Invariants:
- every live segment is either queued or has all its blocks mapped to it;
- an entry that names a live segment names one holding that block: blocks that leave a segment
  are either forgotten (`forget`: a trimmed tail, a deleted segment never mapped) or queued in
  their new segment (a split's moved part), which is mapped before any lookup; so a lookup checks
  only that the segment is live, in O(1), not that it still holds the block (a scan of its run);
- entries naming deleted segments are dropped once they outnumber the live blocks, so memory stays
  O(live blocks).
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
        # Segments whose blocks are not mapped yet, by id: a split may move a queued segment's first hash to a
        # new segment, so the first hash does not name it for long.
        self._queued: dict[int, SegmentT] = {}

    def add(self, segment: SegmentT) -> None:
        """A new segment (or the part a split moved out): its blocks are mapped before the next lookup."""
        self._queued[id(segment)] = segment

    def discard(self, segment: SegmentT) -> None:
        """A deleted segment. Mapped, its entries name a dead segment (dropped on read); still queued, its blocks'
        entries may name the live segment it was split from, so they go now."""
        if self._queued.pop(id(segment), None) is not None:
            self.forget(segment.hashes)

    def forget(self, block_hashes: Iterable[int]) -> None:
        """These blocks left the index (a trimmed tail): drop their entries."""
        mapped = self._mapped
        for block_hash in block_hashes:
            mapped.pop(block_hash, None)

    def get(self, block_hash: int, num_live_blocks: int, live: Callable[[], Iterable[SegmentT]]) -> SegmentT | None:
        """The live segment holding `block_hash`, or None.

        `num_live_blocks` and `live` (all live segments) let it rebuild the map when stale entries
        dominate; both must describe the tree as it is now.
        """
        if self._queued:
            self._map_queued(num_live_blocks, live)
        segment = self._mapped.get(block_hash)
        if segment is None or not self._is_live(segment):
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
        """Every live block resolves to its segment and no other block to a live segment (maps the queue first)."""
        for segment in self._queued.values():
            assert self._is_live(segment), "a deleted segment is still queued"
        segments = list(live_segments)
        num_blocks = sum(len(s.hashes) for s in segments)
        for segment in segments:
            for block_hash in segment.hashes:
                assert self.get(block_hash, num_blocks, lambda: segments) is segment, f"block {block_hash} misplaced"
        held = {block_hash: segment for segment in segments for block_hash in segment.hashes}
        for block_hash, segment in self._mapped.items():
            assert not self._is_live(segment) or held.get(block_hash) is segment, f"block {block_hash} mapped stale"
