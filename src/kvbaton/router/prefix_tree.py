"""The global prefix index's tree: runs of chained block hashes (segments) and the workers holding each.

`PrefixTree` is the base class of `kvbaton.router.prefix_index.GlobalPrefixIndex`, which adds what
the router asks and tells (matches, routing feedback, KV events in seq order); this module keeps the
tree itself: inserting a worker along a path, splitting, orphans, a worker's evictions, deletions,
the block bound, and the structural check. A node (`Segment`) is a run of consecutive blocks with
one holder set, so a decision costs O(segments on the path), not O(blocks). Invariants (checked by
`check_invariants`):
- every segment is held by at least one worker (an emptied segment is deleted with its subtree);
- a child's holders are a subset of its parent's. This mirrors the workers' radix caches, which
  only evict leaves, and it lets `match` read every worker's matched depth off one walk;
- every indexed block is in exactly one segment; at most `max_blocks` blocks are indexed, past
  that the least recently routed subtrees go (recency is an insertion-ordered dict touched
  deepest-first, so ancestors stay more recent than descendants; no clocks).
- blocks a KV event stores under a parent block not indexed start a root segment (an orphan),
  remembered by parent hash; no orphan's parent is indexed: the segment that indexes it (routed
  or stored, whatever walks there next) ends at it and takes its orphans as children.
Block hashes along one path are distinct (they are chained), so routing walks by segment heads only;
looking a block up by hash (KV events, `holders`) goes through `BlockLookup`, told of each segment's
changes, which answers from the segments' last and first hashes where it can (`block_map`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvbaton.core.errors import InvalidRequestError
from kvbaton.router.base import WorkerId
from kvbaton.router.block_map import BlockLookup


class Segment:
    """A run of consecutive indexed blocks and the workers holding all of them (a tree node)."""

    __slots__ = ("hashes", "parent", "children", "workers", "num_routed")

    def __init__(self, hashes: list[int], parent: Segment | None, workers: set[WorkerId], num_routed: int) -> None:
        self.hashes = hashes  # consecutive blocks; the block before hashes[0] is parent.hashes[-1]
        self.parent = parent
        self.children: dict[int, Segment] = {}  # keyed by the child's first hash
        self.workers = workers
        self.num_routed = num_routed  # requests routed through this run of blocks: its reuse count


class PrefixTree:
    """Which workers hold which runs of blocks; `GlobalPrefixIndex` is the router-facing subclass."""

    def __init__(self, max_blocks: int) -> None:
        if max_blocks <= 0:
            raise InvalidRequestError(f"max_blocks must be positive, got {max_blocks}")
        self.max_blocks = max_blocks
        self._roots: dict[int, Segment] = {}  # segments whose first block has no known parent
        # Heads of the roots a KV event created. Only these can recur inside another chain: a root
        # that routing created starts at a prompt's first block, which no other block hash equals.
        self._event_roots: set[int] = set()
        # Roots created by a KV event under a parent block not indexed then, keyed both ways: parent
        # hash -> first hashes of the roots waiting on it, and root's first hash -> its parent hash.
        # Invariant: no waiting parent is indexed; the moment one is, its orphans are attached under it.
        self._orphans: dict[int, dict[int, None]] = {}
        self._orphan_parent: dict[int, int] = {}
        self._num_blocks = 0
        self._lru: OrderedDict[int, Segment] = OrderedDict()  # every segment by first hash, least recent first
        # block hash -> segment; it reads `_lru` as the map of first hashes (and holds no reference to the index)
        self._blocks: BlockLookup[Segment] = BlockLookup(self._lru)
        self._worker_lru: dict[WorkerId, OrderedDict[int, None]] = {}  # per worker, segments it holds
        self.num_evicted_blocks = 0  # blocks dropped to respect max_blocks

    def _is_live(self, segment: Segment) -> bool:
        return self._lru.get(segment.hashes[0]) is segment

    def _segment_of(self, block_hash: int) -> Segment | None:
        return self._blocks.get(block_hash, self._num_blocks, self._lru.values)

    def _insert(
        self,
        worker: WorkerId,
        start: Segment | None,
        block_hashes: Sequence[int],
        count_routed: bool,
        walked: list[Segment] | None = None,
        after_unindexed: bool = False,
    ) -> list[Segment]:
        """Add `worker` along block_hashes below `start` (None: from the roots); returns the segments on the path.

        `walked`: the leading segments already known to match block_hashes whole (from `match`,
        index unchanged since), taken without comparing again. `after_unindexed`: with no `start`, the block
        before block_hashes[0] is named and known not to be indexed (a KV event's parent that is not).
        """
        if not isinstance(block_hashes, list):
            block_hashes = list(block_hashes)  # slices must be lists to compare equal to a segment's run
        worker_lru = self._worker_lru.setdefault(worker, OrderedDict())
        path: list[Segment] = []
        parent = start
        depth = 0
        segment: Segment | None
        for segment in walked or ():
            self._visit(segment, worker, worker_lru, count_routed)
            path.append(segment)
            parent = segment
            depth += len(segment.hashes)
        total = len(block_hashes)
        while depth < total:
            head = block_hashes[depth]
            segment = (parent.children if parent is not None else self._roots).get(head)
            if segment is None and parent is not None and head in self._roots:
                segment = self._adopt(parent, self._roots[head])  # a root whose parent no event named
            if segment is None:
                # A worker reported a block indexed elsewhere: never fork a chain's hash. Where the block before it is
                # known (this parent's last block, or one that is not indexed), the block can be indexed only as a
                # root's head, taken above: anywhere else, that block before it would be indexed there (twice, or
                # at all). So only a run stored with no parent named has its first block looked up.
                if (not count_routed and parent is None and not after_unindexed
                        and self._segment_of(head) is not None):
                    break
                # Only a root's head can be indexed further on: hashes are chained, so an indexed block
                # has the same predecessor in the tree as here, and every indexed block but a root's head
                # has an indexed predecessor. Such a root is an orphan waiting on the block before it
                # (unless an event left its parent unnamed), so the run ends at the first block orphans
                # wait on, they are attached beneath it and the next round walks into them; and it stops
                # before any root's head (one a KV event created: see `_event_roots`) in any case.
                # Scanned in C; both sets are empty in a routing-only index.
                known = None
                if self._event_roots:
                    rest = block_hashes[depth + 1 :]
                    known = next(filter(self._event_roots.__contains__, rest), None)
                end = total if known is None else block_hashes.index(known, depth + 1)
                waited = None
                if self._orphans:
                    waited = next(filter(self._orphans.__contains__, block_hashes[depth:end]), None)
                    if waited is not None:
                        end = block_hashes.index(waited, depth) + 1
                segment = self._create(block_hashes[depth:end], parent, worker)
                if parent is None and not count_routed:
                    self._event_roots.add(segment.hashes[0])
                if waited is not None:
                    for orphan_head in list(self._orphans[waited]):
                        self._adopt(segment, self._roots[orphan_head])
                depth = end
            else:
                run = segment.hashes
                if block_hashes[depth : depth + len(run)] == run:  # the common case, compared in C
                    common = len(run)
                else:
                    common = 0
                    limit = min(len(run), total - depth)
                    while common < limit and run[common] == block_hashes[depth + common]:
                        common += 1
                    segment = self._split(segment, common)[0]
                depth += common
            self._visit(segment, worker, worker_lru, count_routed)
            path.append(segment)
            parent = segment
        return path

    @staticmethod
    def _visit(segment: Segment, worker: WorkerId, worker_lru: OrderedDict[int, None], count_routed: bool) -> None:
        """`worker` holds `segment` (newly: it enters the worker's LRU); a routed insert counts a reuse."""
        if worker not in segment.workers:
            segment.workers.add(worker)
            worker_lru[segment.hashes[0]] = None
        if count_routed:
            segment.num_routed += 1

    def _create(self, hashes: list[int], parent: Segment | None, worker: WorkerId) -> Segment:
        segment = Segment(hashes, parent, set(), 0)
        (parent.children if parent is not None else self._roots)[hashes[0]] = segment
        self._num_blocks += len(hashes)
        self._lru[hashes[0]] = segment
        self._blocks.created(segment)
        return segment

    def _split(self, segment: Segment, offset: int) -> tuple[Segment, Segment]:
        """Cut `segment` after `offset` blocks; the tail becomes the head's only child. Returns (head, tail).

        The shorter part moves into a new segment and the longer one keeps the object, so only the moved blocks
        are copied (and remapped, once `BlockLookup` keeps a per-block map): cutting a long run again and again
        near one end (a prompt's chunks stored one by one) costs the chunks, not the run each time. Keys, orders
        and contents are the same whichever part moves.
        """
        hashes = segment.hashes
        head_key, tail_key = hashes[0], hashes[offset]
        if 2 * offset <= len(hashes):  # the head moves; the tail keeps its children
            head = Segment(hashes[:offset], segment.parent, set(segment.workers), segment.num_routed)
            del hashes[:offset]
            tail = segment
            tail.parent = head
            head.children = {tail_key: tail}
            (head.parent.children if head.parent is not None else self._roots)[head_key] = head
            self._lru[head_key] = head  # an existing key: its place in the order stays
            moved = head
        else:
            tail = Segment(hashes[offset:], segment, set(segment.workers), segment.num_routed)
            del hashes[offset:]
            head = segment
            tail.children = head.children
            for child in tail.children.values():
                child.parent = tail
            head.children = {tail_key: tail}
            moved = tail
        self._lru[tail_key] = tail
        self._blocks.split(segment, moved)
        self._lru.move_to_end(head_key)  # keep the ancestor more recent than its tail
        for worker in tail.workers:
            worker_lru = self._worker_lru[worker]
            worker_lru[tail_key] = None
            worker_lru.move_to_end(head_key)
        return head, tail

    def _adopt(self, parent: Segment, orphan: Segment) -> Segment:
        """Attach a root segment under its now-known parent block; its holders hold the parent too."""
        del self._roots[orphan.hashes[0]]
        self._event_roots.discard(orphan.hashes[0])
        self._unregister_orphan(orphan.hashes[0])
        orphan.parent = parent
        parent.children[orphan.hashes[0]] = orphan
        for worker in orphan.workers:
            self._add_worker_upwards(parent, worker)
        return orphan

    def _register_orphan(self, head: int, parent_hash: int) -> None:
        """Record that the root starting at `head` follows the (unindexed) block `parent_hash`."""
        if head not in self._orphan_parent:  # a root's head, hence its parent, never changes
            self._orphan_parent[head] = parent_hash
            self._orphans.setdefault(parent_hash, {})[head] = None

    def _unregister_orphan(self, head: int) -> None:
        parent_hash = self._orphan_parent.pop(head, None)
        if parent_hash is not None:
            waiting = self._orphans[parent_hash]
            del waiting[head]
            if not waiting:
                del self._orphans[parent_hash]

    def _segment_ending_at(self, block_hash: int) -> Segment | None:
        if block_hash in self._orphans:  # orphans wait on it, so it is not indexed (a cache key's root hash, mostly)
            return None
        segment = self._segment_of(block_hash)
        if segment is None:
            return None
        offset = segment.hashes.index(block_hash)
        if offset + 1 < len(segment.hashes):
            segment = self._split(segment, offset + 1)[0]
        return segment

    def _add_worker_upwards(self, segment: Segment | None, worker: WorkerId) -> None:
        worker_lru = self._worker_lru.setdefault(worker, OrderedDict())
        while segment is not None and worker not in segment.workers:
            segment.workers.add(worker)
            worker_lru[segment.hashes[0]] = None
            segment = segment.parent  # subset invariant: stop at the first ancestor that has it

    def _touch(self, worker: WorkerId, path: list[Segment]) -> None:
        lru = self._lru
        worker_lru = self._worker_lru[worker]
        for segment in reversed(path):  # deepest first: ancestors end up more recent
            key = segment.hashes[0]
            lru.move_to_end(key)
            worker_lru.move_to_end(key)

    def _evict_from(self, worker: WorkerId, block_hashes: Sequence[int]) -> None:
        """The worker evicted these blocks, in this order: each one and what it holds below it leaves the worker."""
        index, num_hashes = 0, len(block_hashes)
        while index < num_hashes:
            block_hash = block_hashes[index]
            index += 1
            segment = self._segment_of(block_hash)
            if segment is None or worker not in segment.workers:
                continue
            hashes = segment.hashes
            # A cache evicts its deepest block first, usually the last of the segment: found without a scan.
            offset = len(hashes) - 1 if hashes[-1] == block_hash else hashes.index(block_hash)
            if offset and not segment.children and len(segment.workers) == 1:
                # Sole holder of a leaf: cut its tail in place, with the blocks before it that come next in the
                # event (a run evicted deepest first) in the same cut: one at a time each would cut here again.
                while offset > 1 and index < num_hashes and block_hashes[index] == hashes[offset - 1]:
                    offset -= 1
                    index += 1
                self._num_blocks -= len(hashes) - offset
                self._blocks.trimmed(segment, offset)
                del hashes[offset:]
            else:
                self._evict_segment(worker, segment, offset)

    def _evict_segment(self, worker: WorkerId, segment: Segment, offset: int) -> None:
        """The worker no longer holds `segment` from `offset` on, nor anything below it."""
        if offset:
            segment = self._split(segment, offset)[1]
        worker_lru = self._worker_lru[worker]
        stack = [segment]
        while stack:
            current = stack.pop()
            current.workers.discard(worker)
            worker_lru.pop(current.hashes[0], None)
            if not current.workers:
                self._delete_subtree(current)  # descendants' holders are a subset: all empty too
            else:
                stack.extend(c for c in current.children.values() if worker in c.workers)

    def _drop_worker(self, worker: WorkerId) -> None:
        worker_lru = self._worker_lru.get(worker)
        if not worker_lru:
            return
        segments = [self._lru[h] for h in worker_lru]
        worker_lru.clear()
        for segment in segments:
            segment.workers.discard(worker)
        for segment in segments:
            if not segment.workers and self._is_live(segment):
                self._delete_subtree(segment)

    def _delete_subtree(self, segment: Segment) -> None:
        if segment.parent is not None:
            del segment.parent.children[segment.hashes[0]]
        else:
            del self._roots[segment.hashes[0]]
            self._event_roots.discard(segment.hashes[0])
            self._unregister_orphan(segment.hashes[0])  # descendants are never roots
        stack = [segment]
        while stack:
            current = stack.pop()
            # Unlinked from its parent: the deleted subtree holds no parent <-> child reference cycle, so it is
            # freed by reference counting (the simulator runs with the cyclic collector paused).
            current.parent = None
            key = current.hashes[0]
            self._num_blocks -= len(current.hashes)
            self._blocks.deleted(current)
            del self._lru[key]
            for worker in current.workers:
                self._worker_lru[worker].pop(key, None)
            stack.extend(current.children.values())

    def _enforce_bound(self) -> None:
        while self._num_blocks > self.max_blocks:
            coldest = next(iter(self._lru.values()))
            overflow = self._num_blocks - self.max_blocks
            if not coldest.children and len(coldest.hashes) > overflow:
                self._blocks.trimmed(coldest, len(coldest.hashes) - overflow)
                del coldest.hashes[-overflow:]  # the leaf's deepest blocks only
                self._num_blocks -= overflow
                self.num_evicted_blocks += overflow
                return
            before = self._num_blocks
            self._delete_subtree(coldest)
            self.num_evicted_blocks += before - self._num_blocks

    def check_invariants(self) -> None:
        """Raise AssertionError if the index's structure is inconsistent."""
        assert self._num_blocks <= self.max_blocks
        seen: set[int] = set()
        held: dict[WorkerId, set[int]] = {w: set() for w in self._worker_lru}
        stack = list(self._roots.values())
        for segment in stack:
            assert segment.parent is None
        live: list[Segment] = []
        while stack:
            segment = stack.pop()
            live.append(segment)
            key = segment.hashes[0]
            assert segment.hashes and segment.workers, f"segment {key} is empty or has no holder"
            for block_hash in segment.hashes:
                assert block_hash not in seen, f"block {block_hash} indexed twice"
                seen.add(block_hash)
            for worker in segment.workers:
                assert worker in held, f"holder {worker} of {key} is not tracked"
                held[worker].add(key)
            for first, child in segment.children.items():
                assert child.hashes[0] == first and child.parent is segment
                assert child.workers <= segment.workers, f"segment {first} holders not a subset of its parent's"
                stack.append(child)
        assert len(seen) == self._num_blocks, "block count differs from the tree"
        assert {h: id(s) for h, s in self._lru.items()} == {s.hashes[0]: id(s) for s in live}, "lru != tree segments"
        self._blocks.check_invariants(live)
        for worker, lru in self._worker_lru.items():
            assert set(lru) == held[worker], f"worker {worker} segment list differs from the tree"
        assert self._event_roots <= self._roots.keys(), "an event root is not a root"
        for head, parent_hash in self._orphan_parent.items():
            assert head in self._roots, f"orphan {head} is not a root"
            assert parent_hash not in seen, f"orphan {head} was not attached under its indexed parent"
            assert head in self._orphans.get(parent_hash, {}), f"orphan {head} missing under {parent_hash}"
        assert sum(map(len, self._orphans.values())) == len(self._orphan_parent), "orphan maps disagree"
        assert all(self._orphans.values()), "empty orphan list kept"

    def close(self) -> None:
        """The index is being dropped: unlink every segment from its parent (the tree's only reference cycles), so
        that it is freed by reference counting alone, not by a pass of the cyclic collector over every segment
        (the simulator drops one per run with the collector paused). Nothing may use the index afterwards."""
        for segment in self._lru.values():
            segment.parent = None
