"""Global prefix index: a radix tree over chained block hashes recording which workers hold each prefix.

Fed optimistically by routing decisions (`on_routed`) and corrected by the workers' KV events.
A node (`_Segment`) is a run of consecutive blocks with one holder set, so a decision costs
O(segments on the path), not O(blocks). Invariants (checked by `check_invariants`):
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
looking a block up by hash (KV events, `holders`) goes through `LazyBlockMap`, which the routing
path feeds whole segments, not blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvbaton.cache.events import KVEvent, KVEventKind
from kvbaton.core.errors import InvalidRequestError
from kvbaton.router.base import WorkerId
from kvbaton.router.block_map import LazyBlockMap


class _Segment:
    __slots__ = ("hashes", "parent", "children", "workers", "num_routed")

    def __init__(self, hashes: list[int], parent: _Segment | None, workers: set[WorkerId], num_routed: int) -> None:
        self.hashes = hashes  # consecutive blocks; the block before hashes[0] is parent.hashes[-1]
        self.parent = parent
        self.children: dict[int, _Segment] = {}  # keyed by the child's first hash
        self.workers = workers
        self.num_routed = num_routed  # requests routed through this run of blocks: its reuse count


class GlobalPrefixIndex:
    def __init__(self, max_blocks: int = 1_000_000) -> None:
        if max_blocks <= 0:
            raise InvalidRequestError(f"max_blocks must be positive, got {max_blocks}")
        self.max_blocks = max_blocks
        self._roots: dict[int, _Segment] = {}  # segments whose first block has no known parent
        # Heads of the roots a KV event created. Only these can recur inside another chain: a root
        # that routing created starts at a prompt's first block, which no other block hash equals.
        self._event_roots: set[int] = set()
        # Roots created by a KV event under a parent block not indexed then, keyed both ways: parent
        # hash -> first hashes of the roots waiting on it, and root's first hash -> its parent hash.
        # Invariant: no waiting parent is indexed; the moment one is, its orphans are attached under it.
        self._orphans: dict[int, dict[int, None]] = {}
        self._orphan_parent: dict[int, int] = {}
        self._num_blocks = 0
        self._lru: OrderedDict[int, _Segment] = OrderedDict()  # every segment by first hash, least recent first
        # block hash -> segment. Its liveness test reads `_lru` through a closure, not the bound `_is_live`: the
        # index and its map then hold no reference cycle (see `close`).
        lru = self._lru
        self._blocks: LazyBlockMap[_Segment] = LazyBlockMap(lambda segment: lru.get(segment.hashes[0]) is segment)
        self._worker_lru: dict[WorkerId, OrderedDict[int, None]] = {}  # per worker, segments it holds
        self._last_seq: dict[WorkerId, int] = {}  # last KV event seq applied per worker
        self._num_mutations = 0  # bumped by every change; lets callers cache derived estimates
        # The last `match` of a tuple: (that tuple, num_mutations then, it as a list, segments matched
        # whole). Valid while the index is unchanged; `on_routed` of the same tuple starts from there.
        self._last_walk: tuple[tuple[int, ...], int, list[int], list[_Segment]] | None = None
        self.num_evicted_blocks = 0  # blocks dropped to respect max_blocks

    # ---- reads -------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def workers(self) -> list[WorkerId]:
        return sorted(self._worker_lru)

    @property
    def num_mutations(self) -> int:
        """Changes so far; an estimate computed at one value stays valid while it is unchanged."""
        return self._num_mutations

    def num_worker_blocks(self, worker: WorkerId) -> int:
        lru = self._worker_lru.get(worker, {})
        return sum(len(self._lru[h].hashes) for h in lru)

    def holders(self, block_hash: int) -> frozenset[WorkerId]:
        segment = self._segment_of(block_hash)
        return frozenset(segment.workers) if segment is not None else frozenset()

    def num_routed(self, block_hash: int) -> int:
        segment = self._segment_of(block_hash)
        return segment.num_routed if segment is not None else 0

    def match(self, block_hashes: Sequence[int]) -> dict[WorkerId, int]:
        """Matched leading blocks per worker (workers matching nothing are absent). Does not modify the index."""
        matched: dict[WorkerId, int] = {}
        if not block_hashes:
            return matched
        request_hashes = block_hashes
        if not isinstance(block_hashes, list):
            block_hashes = list(block_hashes)  # slices must be lists to compare equal to a segment's run
        segment = self._roots.get(block_hashes[0])
        holders: set[WorkerId] | None = None
        depth = 0
        total = len(block_hashes)
        walked: list[_Segment] = []  # the segments matched whole, from the root
        while segment is not None:
            run = segment.hashes
            end = depth + len(run)
            if end <= total and block_hashes[depth:end] == run:
                matched_end = end
            else:
                matched_end = depth
                for block_hash in run:
                    if matched_end >= total or block_hashes[matched_end] != block_hash:
                        break
                    matched_end += 1
            workers = segment.workers
            if holders is not None and len(workers) != len(holders):
                for worker in holders:  # subset invariant: a size change means exactly these dropped out
                    if worker not in workers:
                        matched[worker] = depth
            holders, depth = workers, matched_end
            if matched_end != end:
                break
            walked.append(segment)
            if end >= total:
                break
            segment = segment.children.get(block_hashes[end])
        if holders is not None:
            matched.update(dict.fromkeys(holders, depth))  # none of them is in yet (they held every segment)
        if type(request_hashes) is tuple:  # immutable: `on_routed` may resume this walk (see there)
            self._last_walk = (request_hashes, self._num_mutations, block_hashes, walked)
        return matched

    def coldest(self, worker: WorkerId, max_num_blocks: int) -> list[tuple[int, int]]:
        """(num blocks, reuse count) of the worker's least recently routed segments, up to `max_num_blocks` blocks."""
        out: list[tuple[int, int]] = []
        budget = max_num_blocks
        for first_hash in self._worker_lru.get(worker, ()):
            if budget <= 0:
                break
            segment = self._lru[first_hash]
            num_blocks = min(budget, len(segment.hashes))
            out.append((num_blocks, segment.num_routed))
            budget -= num_blocks
        return out

    # ---- routing feedback ----------------------------------------------------------------------
    def on_routed(self, worker: WorkerId, block_hashes: Sequence[int]) -> None:
        """The worker was chosen for a prompt with these blocks: it will hold all of them."""
        if block_hashes:
            walk, self._last_walk = self._last_walk, None
            if walk is not None and walk[0] is block_hashes and walk[1] == self._num_mutations:
                path = self._insert(worker, None, walk[2], count_routed=True, walked=walk[3])  # one walk, not two
            else:
                path = self._insert(worker, None, block_hashes, count_routed=True)
            self._num_mutations += 1
            self._touch(worker, path)
            self._enforce_bound()

    # ---- KV events -----------------------------------------------------------------------------
    def on_kv_events(self, worker: WorkerId, events: Iterable[KVEvent]) -> bool:
        """Apply the worker's events in order; False at the first seq gap (the rest is not applied).

        On False the caller must fetch a snapshot from the worker and call `apply_snapshot`.
        Events at or below the last applied seq are duplicates and are skipped.
        """
        for event in events:
            last = self._last_seq.get(worker, 0)
            if event.seq <= last:
                continue
            if event.seq != last + 1:
                return False
            self._apply(worker, event)
            self._last_seq[worker] = event.seq
        return True

    def apply_snapshot(self, worker: WorkerId, events: Iterable[KVEvent]) -> None:
        """Replace everything known about the worker with a snapshot: STORED events describing its whole cache.

        Seq numbers inside the snapshot need not be contiguous; the highest one becomes the point
        from which `on_kv_events` continues.
        """
        self._num_mutations += 1
        self._drop_worker(worker)
        self._worker_lru.setdefault(worker, OrderedDict())
        last_seq = self._last_seq.get(worker, 0)
        for event in events:
            self._apply(worker, event)
            last_seq = max(last_seq, event.seq)
        self._last_seq[worker] = last_seq

    def last_seq(self, worker: WorkerId) -> int:
        return self._last_seq.get(worker, 0)

    def remove_worker(self, worker: WorkerId) -> None:
        """Purge a worker that left the cluster."""
        self._num_mutations += 1
        self._drop_worker(worker)
        self._worker_lru.pop(worker, None)
        self._last_seq.pop(worker, None)

    def close(self) -> None:
        """The index is being dropped: unlink every segment from its parent (the tree's only reference cycles), so
        that it is freed by reference counting alone, not by a pass of the cyclic collector over every segment
        (the simulator drops one per run with the collector paused). Nothing may use the index afterwards."""
        for segment in self._lru.values():
            segment.parent = None

    # ---- internals -----------------------------------------------------------------------------
    def _is_live(self, segment: _Segment) -> bool:
        return self._lru.get(segment.hashes[0]) is segment

    def _segment_of(self, block_hash: int) -> _Segment | None:
        return self._blocks.get(block_hash, self._num_blocks, self._lru.values)

    def _apply(self, worker: WorkerId, event: KVEvent) -> None:
        self._num_mutations += 1
        if event.kind is KVEventKind.CLEARED:
            self._drop_worker(worker)
        elif event.kind is KVEventKind.EVICTED:
            for block_hash in event.block_hashes:
                self._evict_from(worker, block_hash)
        elif event.block_hashes:
            parent = self._segment_ending_at(event.parent_hash) if event.parent_hash is not None else None
            if parent is not None:
                self._add_worker_upwards(parent, worker)  # the worker's cache is prefix-closed
            path = self._insert(worker, parent, event.block_hashes, count_routed=False)
            if parent is None and event.parent_hash is not None and path and path[0].parent is None:
                self._register_orphan(path[0].hashes[0], event.parent_hash)
            self._touch(worker, path)
            self._enforce_bound()

    def _insert(
        self,
        worker: WorkerId,
        start: _Segment | None,
        block_hashes: Sequence[int],
        count_routed: bool,
        walked: list[_Segment] | None = None,
    ) -> list[_Segment]:
        """Add `worker` along block_hashes below `start` (None: from the roots); returns the segments on the path.

        `walked`: the leading segments already known to match block_hashes whole (from `match`,
        index unchanged since), taken without comparing again.
        """
        if not isinstance(block_hashes, list):
            block_hashes = list(block_hashes)  # slices must be lists to compare equal to a segment's run
        worker_lru = self._worker_lru.setdefault(worker, OrderedDict())
        path: list[_Segment] = []
        parent = start
        depth = 0
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
                if not count_routed and self._segment_of(head) is not None:
                    break  # a worker reported a block indexed elsewhere: never fork a chain's hash
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
                    self._split(segment, common)
                depth += common
            self._visit(segment, worker, worker_lru, count_routed)
            path.append(segment)
            parent = segment
        return path

    @staticmethod
    def _visit(segment: _Segment, worker: WorkerId, worker_lru: OrderedDict[int, None], count_routed: bool) -> None:
        """`worker` holds `segment` (newly: it enters the worker's LRU); a routed insert counts a reuse."""
        if worker not in segment.workers:
            segment.workers.add(worker)
            worker_lru[segment.hashes[0]] = None
        if count_routed:
            segment.num_routed += 1

    def _create(self, hashes: list[int], parent: _Segment | None, worker: WorkerId) -> _Segment:
        segment = _Segment(hashes, parent, set(), 0)
        (parent.children if parent is not None else self._roots)[hashes[0]] = segment
        self._num_blocks += len(hashes)
        self._lru[hashes[0]] = segment
        self._blocks.add(segment)
        return segment

    def _split(self, segment: _Segment, offset: int) -> _Segment:
        """Cut `segment` after `offset` blocks; the tail becomes its only child. Returns the tail."""
        tail_hashes = segment.hashes[offset:]
        del segment.hashes[offset:]
        tail = _Segment(tail_hashes, segment, set(segment.workers), segment.num_routed)
        tail.children = segment.children
        for child in tail.children.values():
            child.parent = tail
        segment.children = {tail_hashes[0]: tail}
        key = tail_hashes[0]
        self._lru[key] = tail
        self._blocks.add(tail)  # its blocks' entries still name `segment`
        self._lru.move_to_end(segment.hashes[0])  # keep the ancestor more recent than its tail
        for worker in tail.workers:
            worker_lru = self._worker_lru[worker]
            worker_lru[key] = None
            worker_lru.move_to_end(segment.hashes[0])
        return tail

    def _adopt(self, parent: _Segment, orphan: _Segment) -> _Segment:
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

    def _segment_ending_at(self, block_hash: int) -> _Segment | None:
        segment = self._segment_of(block_hash)
        if segment is None:
            return None
        offset = segment.hashes.index(block_hash)
        if offset + 1 < len(segment.hashes):
            self._split(segment, offset + 1)
        return segment

    def _add_worker_upwards(self, segment: _Segment | None, worker: WorkerId) -> None:
        worker_lru = self._worker_lru.setdefault(worker, OrderedDict())
        while segment is not None and worker not in segment.workers:
            segment.workers.add(worker)
            worker_lru[segment.hashes[0]] = None
            segment = segment.parent  # subset invariant: stop at the first ancestor that has it

    def _touch(self, worker: WorkerId, path: list[_Segment]) -> None:
        lru = self._lru
        worker_lru = self._worker_lru[worker]
        for segment in reversed(path):  # deepest first: ancestors end up more recent
            key = segment.hashes[0]
            lru.move_to_end(key)
            worker_lru.move_to_end(key)

    def _evict_from(self, worker: WorkerId, block_hash: int) -> None:
        segment = self._segment_of(block_hash)
        if segment is None or worker not in segment.workers:
            return
        offset = segment.hashes.index(block_hash)
        if offset and not segment.children and len(segment.workers) == 1:
            self._num_blocks -= len(segment.hashes) - offset  # sole holder of a leaf: cut its tail in place
            del segment.hashes[offset:]
            return
        if offset:
            segment = self._split(segment, offset)
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

    def _delete_subtree(self, segment: _Segment) -> None:
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
            self._blocks.discard(current)
            del self._lru[key]
            for worker in current.workers:
                self._worker_lru[worker].pop(key, None)
            stack.extend(current.children.values())

    def _enforce_bound(self) -> None:
        while self._num_blocks > self.max_blocks:
            coldest = next(iter(self._lru.values()))
            overflow = self._num_blocks - self.max_blocks
            if not coldest.children and len(coldest.hashes) > overflow:
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
        live: list[_Segment] = []
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
