"""KV block ids and reference counts, with an O(1) least-recently-freed free queue; no tensors.

Ownership model (shared with `kvbaton.cache.radix_cache`): every holder of a block owns one
reference. A request holds one reference on each block of its block table; the prefix cache holds
exactly one reference on each block it caches. A block whose count drops to 0 is free and goes to
the TAIL of the free queue; `allocate` takes from the HEAD, so the block freed longest ago is reused
first. The queue is a doubly linked list threaded through two int arrays (`_prev`, `_next`) with
one sentinel slot, so taking from the head and appending to the tail cost O(1) per block and the
order is a pure function of the call sequence (no timestamps).

Misuse (unknown ids, taking a reference on a free block, releasing a free block) raises ValueError
before anything is changed: the pool is never left half-updated.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from kvbaton.core.errors import CapacityError

_NOT_QUEUED = -1  # `_prev`/`_next` value of a block that is held (not in the free queue)


class BlockPool:
    """Reference counts over block ids 0..num_blocks-1 and the queue of free ones."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts: list[int] = [0] * num_blocks
        # Slot `num_blocks` is the sentinel: `_next[sentinel]` is the head, `_prev[sentinel]` the tail.
        self._sentinel = num_blocks
        self._next: list[int] = list(range(1, num_blocks + 1)) + [0]
        self._prev: list[int] = [num_blocks] + list(range(0, num_blocks))
        self._num_free_blocks = num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self._num_free_blocks

    def can_allocate(self, num_blocks: int) -> bool:
        return 0 <= num_blocks <= self._num_free_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks from the head of the free queue, each with ref count 1."""
        if num_blocks < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({num_blocks})")
        if num_blocks > self._num_free_blocks:
            raise CapacityError(f"need {num_blocks} KV blocks but only {self._num_free_blocks} are free")
        if num_blocks == 0:
            return []
        # Cut the first `num_blocks` entries off the queue in one splice (same order as popping
        # the head one at a time), then mark each taken block as held.
        next_ids, prev_ids, ref_counts, sentinel = self._next, self._prev, self._ref_counts, self._sentinel
        block_ids: list[int] = []
        block_id = next_ids[sentinel]
        for _ in range(num_blocks):
            block_ids.append(block_id)
            block_id = next_ids[block_id]
        next_ids[sentinel] = block_id
        prev_ids[block_id] = sentinel
        for block_id in block_ids:
            prev_ids[block_id] = next_ids[block_id] = _NOT_QUEUED
            ref_counts[block_id] = 1
        self._num_free_blocks -= num_blocks
        return block_ids

    def ref(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each listed block (a block listed twice gets two); all must be held."""
        block_ids = list(block_ids)
        ref_counts, num_blocks = self._ref_counts, self.num_blocks
        for block_id in block_ids:
            if not 0 <= block_id < num_blocks or ref_counts[block_id] == 0:
                self._raise_bad_ref(block_id)
        for block_id in block_ids:
            ref_counts[block_id] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each listed block; blocks reaching 0 join the free-queue tail in order."""
        block_ids = list(block_ids)
        ref_counts, num_blocks = self._ref_counts, self.num_blocks
        # Fast path (the common case: a request's table, no id twice): validate, then update.
        if len(set(block_ids)) != len(block_ids):
            self._release_with_duplicates(block_ids)
            return
        for block_id in block_ids:
            if not 0 <= block_id < num_blocks or ref_counts[block_id] == 0:
                self._release_with_duplicates(block_ids)  # raises the detailed error, changing nothing
                return
        next_ids, prev_ids, sentinel = self._next, self._prev, self._sentinel
        tail = prev_ids[sentinel]
        num_appended = 0
        for block_id in block_ids:
            count = ref_counts[block_id] - 1
            ref_counts[block_id] = count
            if count == 0:  # append to the free-queue tail (inline `_append`)
                next_ids[tail] = block_id
                prev_ids[block_id] = tail
                tail = block_id
                num_appended += 1
        next_ids[tail] = sentinel
        prev_ids[sentinel] = tail
        self._num_free_blocks += num_appended

    def _raise_bad_ref(self, block_id: int) -> None:
        self._check_id(block_id)
        raise ValueError(f"cannot take a reference on free block {block_id}")

    def _release_with_duplicates(self, block_ids: list[int]) -> None:
        """`release` when an id may be listed more than once: a block joins the queue when its count hits 0."""
        for block_id, num_releases in Counter(block_ids).items():
            self._check_id(block_id)
            if self._ref_counts[block_id] < num_releases:
                raise ValueError(
                    f"block {block_id} has {self._ref_counts[block_id]} references, cannot release {num_releases}"
                )
        for block_id in block_ids:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._append(block_id)

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def free_block_ids(self) -> list[int]:
        """The free queue from head (next to be allocated) to tail; O(num_free_blocks), for tests and debugging."""
        block_ids: list[int] = []
        block_id = self._next[self._sentinel]
        while block_id != self._sentinel:
            block_ids.append(block_id)
            block_id = self._next[block_id]
        return block_ids

    def check_invariants(self) -> None:
        """Raise AssertionError if the counts and the free queue disagree."""
        sentinel = self._sentinel
        queued: set[int] = set()
        block_id = self._next[sentinel]
        previous = sentinel
        while block_id != sentinel:
            assert 0 <= block_id < self.num_blocks, f"free queue holds invalid id {block_id}"
            assert block_id not in queued, f"free queue has a cycle at block {block_id}"
            assert self._prev[block_id] == previous, f"block {block_id}: prev {self._prev[block_id]} != {previous}"
            assert self._ref_counts[block_id] == 0, f"queued block {block_id} has ref {self._ref_counts[block_id]}"
            queued.add(block_id)
            previous, block_id = block_id, self._next[block_id]
        assert self._prev[sentinel] == previous, f"tail {self._prev[sentinel]} != last queued block {previous}"
        assert len(queued) == self._num_free_blocks, f"{len(queued)} queued != num_free {self._num_free_blocks}"
        for block_id, count in enumerate(self._ref_counts):
            assert count >= 0, f"block {block_id} has negative ref count {count}"
            if count > 0:
                assert block_id not in queued, f"held block {block_id} is in the free queue"
                assert self._prev[block_id] == self._next[block_id] == _NOT_QUEUED, f"held block {block_id} linked"
            else:
                assert block_id in queued, f"block {block_id} has ref 0 but is not in the free queue"

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is outside 0..{self.num_blocks - 1}")

    def _append(self, block_id: int) -> None:
        tail = self._prev[self._sentinel]
        self._next[tail] = block_id
        self._prev[block_id] = tail
        self._next[block_id] = self._sentinel
        self._prev[self._sentinel] = block_id
        self._num_free_blocks += 1
