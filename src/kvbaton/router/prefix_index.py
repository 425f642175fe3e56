"""Global prefix index: which workers hold each prefix, as the router reads and feeds it.

Fed optimistically by routing decisions (`on_routed`) and corrected by the workers' KV events
(applied in seq order; a gap asks for a snapshot). The tree, its invariants and its mutations live
in the base class `kvbaton.router.prefix_tree.PrefixTree`; this module holds the queries (`match`,
`holders`, `coldest`, ...), the routing feedback and the event/snapshot/worker-removal feed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvbaton.cache.events import KVEvent, KVEventKind
from kvbaton.router.base import WorkerId
from kvbaton.router.prefix_tree import PrefixTree, Segment


class GlobalPrefixIndex(PrefixTree):
    """The router's prefix index over a `PrefixTree`; see the module docstring."""

    def __init__(self, max_blocks: int = 1_000_000) -> None:
        super().__init__(max_blocks)
        self._last_seq: dict[WorkerId, int] = {}  # last KV event seq applied per worker
        self._num_mutations = 0  # bumped by every change; lets callers cache derived estimates
        # The last `match` of a tuple: (that tuple, num_mutations then, it as a list, segments matched
        # whole). Valid while the index is unchanged; `on_routed` of the same tuple starts from there.
        self._last_walk: tuple[tuple[int, ...], int, list[int], list[Segment]] | None = None

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
        return sum(len(self._lru[h].hashes) for h in self._worker_lru.get(worker, ()))

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
        walked: list[Segment] = []  # the segments matched whole, from the root
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

    # ---- internals -----------------------------------------------------------------------------
    def _apply(self, worker: WorkerId, event: KVEvent) -> None:
        self._num_mutations += 1
        if event.kind is KVEventKind.CLEARED:
            self._drop_worker(worker)
        elif event.kind is KVEventKind.EVICTED:
            self._evict_from(worker, event.block_hashes)
        elif event.block_hashes:
            parent = self._segment_ending_at(event.parent_hash) if event.parent_hash is not None else None
            if parent is not None:
                self._add_worker_upwards(parent, worker)  # the worker's cache is prefix-closed
            path = self._insert(worker, parent, event.block_hashes, count_routed=False,
                                after_unindexed=event.parent_hash is not None)
            if parent is None and event.parent_hash is not None and path and path[0].parent is None:
                self._register_orphan(path[0].hashes[0], event.parent_hash)
            self._touch(worker, path)
            self._enforce_bound()
