"""Block hash -> radix segment lookups for the global prefix index, built lazily off the routing path.

Routing only walks the tree by segment (first hash of each child), so looking a block up by hash is
needed only by the readers that name an arbitrary block: KV events (the parent of a stored run, an
evicted block, the first block of a run stored with no parent named: is it indexed elsewhere?) and the
`holders`/`num_routed` accessors. Those blocks are almost always where a segment ends: a cache evicts its
deepest block first, and a stored run's parent is where the worker's previous run ended, which its event
split the index at. So `BlockLookup` answers in three steps, cheapest first:
- the segment a block ends, from `_tails` (one entry per segment, kept exact as segments are created,
  split, trimmed and deleted), or the segment it begins, from the tree's own map of first hashes;
- else whether the block is indexed at all: the first `_SCANS_BEFORE_MEMBERS` times by a scan of the
  segments (the Mooncake trace asks once in a whole run), then from `_members`, a set of every indexed
  block's hash built then and kept (the routing path only queues the segments it creates: their hashes
  join the set, in bulk, at the next lookup; nothing is added when a split moves blocks, as membership
  does not change);
- else, a block inside a segment, from the per-block map (`LazyBlockMap`), built the first time such a
  lookup comes and kept from then on. The Mooncake trace and `sim_speed`'s workloads never build it; a
  stored run's parent inside a segment does (seen on an 800-block pool under heavy eviction).
Each step is exact, so the answers are those of a per-block map. `LazyBlockMap`'s invariants:
- every live segment is either queued or has all its blocks mapped to it;
- an entry that names a live segment names one holding that block: blocks that leave a segment
  are either forgotten (`forget`: a trimmed tail, a deleted segment never mapped) or queued in
  their new segment (a split's moved part), which is mapped before any lookup; so a lookup checks
  only that the segment is live, in O(1), not that it still holds the block (a scan of its run);
- entries naming deleted segments are dropped once they outnumber the live blocks, so memory stays
  O(live blocks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from itertools import repeat
from typing import Generic, Protocol, TypeVar


class _HasHashes(Protocol):
    hashes: list[int]


SegmentT = TypeVar("SegmentT", bound=_HasHashes)

_MIN_STALE_ENTRIES = 4096  # below this many stale entries a rebuild is not worth its pause
_SCANS_BEFORE_MEMBERS = 16  # membership lookups answered by a scan before the set of every hash is built and kept


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


class BlockLookup(Generic[SegmentT]):
    """The live segment holding a block hash, for `PrefixTree` (see the module docstring). The tree tells it of every
    change to a segment's run of hashes (`created`, `split`, `trimmed`, `deleted`), before it makes the change but
    for `split`, after."""

    def __init__(self, heads: Mapping[int, SegmentT]) -> None:
        self._heads = heads  # the tree's live segments by first hash (its LRU order: a live map, read only)
        self._tails: dict[int, SegmentT] = {}  # every live segment by last hash
        # Every indexed block's hash, but those of the segments queued; None until `_SCANS_BEFORE_MEMBERS` lookups
        # have scanned the tree for a block instead (nothing is queued then).
        self._members: set[int] | None = None
        self._num_scans = 0
        self._queued: dict[int, SegmentT] = {}  # segments created since the last lookup, by id: not in _members yet
        self._full: LazyBlockMap[SegmentT] | None = None  # per-block, from the first lookup inside a segment on

    def created(self, segment: SegmentT) -> None:
        self._tails[segment.hashes[-1]] = segment
        if self._members is not None:
            self._queued[id(segment)] = segment
        if self._full is not None:
            self._full.add(segment)

    def split(self, kept: SegmentT, moved: SegmentT) -> None:
        """A split moved part of `kept`'s run (its head or its tail) into the new segment `moved`."""
        tails = self._tails
        tails[kept.hashes[-1]] = kept
        tails[moved.hashes[-1]] = moved
        if id(kept) in self._queued:
            self._queued[id(moved)] = moved
        if self._full is not None:
            self._full.add(moved)  # its blocks' entries still name `kept`

    def trimmed(self, segment: SegmentT, offset: int) -> None:
        """`segment` is about to lose its blocks from `offset` (>= 1) on."""
        hashes = segment.hashes
        tails = self._tails
        if tails.get(hashes[-1]) is segment:
            del tails[hashes[-1]]
        tails[hashes[offset - 1]] = segment
        if self._members is not None and id(segment) not in self._queued:
            self._members.difference_update(hashes[offset:])
        if self._full is not None:
            self._full.forget(hashes[offset:])

    def deleted(self, segment: SegmentT) -> None:
        """`segment` leaves the tree (with its run as it is)."""
        hashes = segment.hashes
        tails = self._tails
        if tails.get(hashes[-1]) is segment:
            del tails[hashes[-1]]
        if self._queued.pop(id(segment), None) is None and self._members is not None:
            self._members.difference_update(hashes)
        if self._full is not None:
            self._full.discard(segment)

    def get(self, block_hash: int, num_live_blocks: int, live: Callable[[], Iterable[SegmentT]]) -> SegmentT | None:
        """The live segment holding `block_hash`, or None. `num_live_blocks` and `live` (all live segments) must
        describe the tree as it is now: the per-block map is built from them, and rebuilt when stale entries
        dominate it."""
        segment = self._tails.get(block_hash)
        if segment is not None:
            return segment
        segment = self._heads.get(block_hash)
        if segment is not None:
            return segment
        if not self.contains(block_hash):
            return None
        full = self._full
        if full is None:
            heads = self._heads  # a closure, not the bound `_heads_live`: no reference cycle through the map
            full = self._full = LazyBlockMap(lambda each: heads.get(each.hashes[0]) is each)
            for each in live():
                full.add(each)
        return full.get(block_hash, num_live_blocks, live)

    def contains(self, block_hash: int) -> bool:
        """Whether `block_hash` is indexed (the queued segments' hashes join the set first). The first few times,
        by a scan of the tree's segments: KV events rarely name a block that no segment ends or begins with, and a
        set of every indexed hash costs every created, trimmed and deleted segment its hashes."""
        members = self._members
        if members is None:
            self._num_scans += 1
            if self._num_scans <= _SCANS_BEFORE_MEMBERS:
                return any(block_hash in segment.hashes for segment in self._heads.values())
            members = self._members = {h for segment in self._heads.values() for h in segment.hashes}
        elif self._queued:
            for segment in self._queued.values():
                members.update(segment.hashes)
            self._queued.clear()
        return block_hash in members

    def _heads_live(self, segment: SegmentT) -> bool:
        return self._heads.get(segment.hashes[0]) is segment

    def check_invariants(self, live_segments: Iterable[SegmentT]) -> None:
        """Tails, membership and (when built) the per-block map agree with the live segments."""
        segments = list(live_segments)
        assert self._tails == {s.hashes[-1]: s for s in segments}, "tail map differs from the live segments"
        for segment in self._queued.values():
            assert self._heads_live(segment), "a deleted segment is still queued"
        queued = {h for s in self._queued.values() for h in s.hashes}
        if self._members is None:
            assert not queued, "segments queued for a membership set not built"
        else:
            assert self._members | queued == {h for s in segments for h in s.hashes}, "members differ from the tree"
        if self._full is not None:
            self._full.check_invariants(segments)
