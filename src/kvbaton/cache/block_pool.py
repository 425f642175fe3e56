"""KV block ids and reference counts, with an O(1) least-recently-freed free queue; no tensors.

Ownership model (shared with `kvbaton.cache.radix_cache`): every holder of a block owns one
reference. A request holds one reference on each block of its block table; the prefix cache holds
exactly one reference on each block it caches. A block whose count drops to 0 is free and goes to
the TAIL of the free queue; `allocate` takes from the HEAD, so the block freed longest ago is reused
first. A free block can never be referenced (`ref` refuses it), so blocks only ever leave the queue
at its head: the queue is a plain FIFO, the never-allocated ids `_next_fresh..num_blocks-1` (in
order, where a new pool's queue starts) followed by an int list read from a head index
(`_free[_head:]`), so a pool of any size is built without listing its ids. Allocating k blocks is
one C-level slice (or range), freeing appends; the consumed prefix is cut off once it outgrows the
live part, so the list stays O(num_blocks) and every operation is amortised O(1) per block. The
order is a pure function of the call sequence (no timestamps).

Misuse (unknown ids, taking a reference on a free block, releasing a free block) raises ValueError
with nothing changed (`ref` and `release` check as they update, and undo a pass that meets a bad
id): the pool is never left half-updated.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from operator import length_hint

from kvbaton.core.errors import CapacityError

_MIN_COMPACT_BLOCKS = 1024  # consumed queue entries kept before a compaction is worth its copy


class BlockPool:
    """Reference counts over block ids 0..num_blocks-1 and the queue of free ones."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts: list[int] = [0] * num_blocks
        # The free queue is range(_next_fresh, num_blocks) (ids never allocated), then `_free[_head:]` (ids freed,
        # in the order they were), head (next to allocate) first; entries before `_head` were allocated and are dead.
        self._next_fresh = 0
        self._free: list[int] = []
        self._head = 0

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self._next_fresh + len(self._free) - self._head

    @property
    def num_used_blocks(self) -> int:
        return self._next_fresh - (len(self._free) - self._head)

    def can_allocate(self, num_blocks: int) -> bool:
        return 0 <= num_blocks <= self.num_blocks - self._next_fresh + len(self._free) - self._head

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks from the head of the free queue, each with ref count 1."""
        if num_blocks < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({num_blocks})")
        head = self._head
        next_fresh = self._next_fresh
        num_fresh = self.num_blocks - next_fresh
        num_free = num_fresh + len(self._free) - head
        if num_blocks > num_free:
            raise CapacityError(f"need {num_blocks} KV blocks but only {num_free} are free")
        if num_blocks == 0:
            return []
        if num_fresh:  # the never-allocated ids come first
            if num_blocks <= num_fresh:
                self._next_fresh = next_fresh + num_blocks
                self._ref_counts[next_fresh : next_fresh + num_blocks] = [1] * num_blocks
                return list(range(next_fresh, next_fresh + num_blocks))
            self._next_fresh = self.num_blocks
            self._ref_counts[next_fresh:] = [1] * num_fresh
            return list(range(next_fresh, self.num_blocks)) + self._take_freed(num_blocks - num_fresh)
        return self._take_freed(num_blocks)

    def _take_freed(self, num_blocks: int) -> list[int]:
        """`allocate` from the freed part of the queue, which holds at least `num_blocks` (> 0) ids."""
        head = self._head
        free = self._free
        block_ids = free[head : head + num_blocks]
        head += num_blocks
        if head >= _MIN_COMPACT_BLOCKS and head * 2 >= len(free):
            del free[:head]  # drop the consumed prefix: at most twice the live queue is ever kept
            head = 0
        self._head = head
        ref_counts = self._ref_counts
        for block_id in block_ids:
            ref_counts[block_id] = 1
        return block_ids

    def ref(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each listed block (a block listed twice gets two); all must be held."""
        block_ids = list(block_ids)
        if not block_ids:
            return
        ref_counts = self._ref_counts
        # One pass that validates as it goes (the common case: all held); a bad id undoes the pass, then raises.
        # The pass runs on an explicit iterator: what is left in it after a bad id tells how many were done. A
        # negative id would index from the end, so the pass stops on one before writing (cheaper than a min()).
        ids = iter(block_ids)
        try:
            for block_id in ids:
                count = ref_counts[block_id]
                if not count or block_id < 0:
                    break
                ref_counts[block_id] = count + 1
            else:
                return
        except IndexError:
            pass
        num_done = len(block_ids) - length_hint(ids) - 1  # the bad id was taken from the iterator too
        for block_id in block_ids[:num_done]:
            ref_counts[block_id] -= 1
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks or ref_counts[block_id] == 0:
                self._raise_bad_ref(block_id)

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each listed block; blocks reaching 0 join the free-queue tail in order."""
        block_ids = list(block_ids)
        if not block_ids:
            return
        ref_counts = self._ref_counts
        free = self._free
        num_free = len(free)
        # One pass that validates as it goes; a bad id (out of range, or more releases than references) undoes
        # the pass, then `_release_with_duplicates` raises the detailed error. As in `ref`, the explicit
        # iterator tells how far the pass got, and a negative id stops it before any write.
        ids = iter(block_ids)
        try:
            # The leading run of last references (every id, when a request with no cached blocks ends) is
            # zeroed here and queued with one extend: the same queue order as appending each as it hits 0.
            # An id listed twice in the run sees 0 the second time and leaves the run as a bad id.
            for block_id in ids:
                if ref_counts[block_id] != 1 or block_id < 0:
                    break
                ref_counts[block_id] = 0
            else:
                free += block_ids
                return
            num_zeroed = len(block_ids) - length_hint(ids) - 1
            if num_zeroed:
                free += block_ids[:num_zeroed]
            # The general pass, from the id that ended the run (its count is not 1): an id listed twice is
            # released twice and queued when its count reaches 0, as `_release_with_duplicates` does.
            count = ref_counts[block_id] - 1
            if count > 0 and block_id >= 0:
                ref_counts[block_id] = count
                for block_id in ids:
                    count = ref_counts[block_id] - 1
                    if count <= 0:
                        if count or block_id < 0:
                            break
                        free.append(block_id)
                    elif block_id < 0:
                        break
                    ref_counts[block_id] = count
                else:
                    return
        except IndexError:
            pass
        num_done = len(block_ids) - length_hint(ids) - 1
        for block_id in block_ids[:num_done]:
            ref_counts[block_id] += 1
        del free[num_free:]
        self._release_with_duplicates(block_ids)

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
                self._free.append(block_id)

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def free_block_ids(self) -> list[int]:
        """The free queue from head (next to be allocated) to tail; O(num_free_blocks), for tests and debugging."""
        return list(range(self._next_fresh, self.num_blocks)) + self._free[self._head :]

    def check_invariants(self) -> None:
        """Raise AssertionError if the counts and the free queue disagree."""
        assert 0 <= self._head <= len(self._free), f"queue head {self._head} outside 0..{len(self._free)}"
        assert 0 <= self._next_fresh <= self.num_blocks, f"fresh ids start at {self._next_fresh}"
        for block_id in self._free[self._head :]:
            assert block_id < self._next_fresh, f"never-allocated block {block_id} is queued as freed"
        queued: set[int] = set()
        for block_id in self.free_block_ids():
            assert 0 <= block_id < self.num_blocks, f"free queue holds invalid id {block_id}"
            assert block_id not in queued, f"block {block_id} is queued twice"
            assert self._ref_counts[block_id] == 0, f"queued block {block_id} has ref {self._ref_counts[block_id]}"
            queued.add(block_id)
        for block_id, count in enumerate(self._ref_counts):
            assert count >= 0, f"block {block_id} has negative ref count {count}"
            if count == 0:
                assert block_id in queued, f"block {block_id} has ref 0 but is not in the free queue"
        assert self.num_free_blocks <= self.num_blocks, "free queue longer than the pool"

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is outside 0..{self.num_blocks - 1}")
