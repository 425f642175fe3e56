"""BlockPool's array free queue: the same least-recently-freed order as a plain FIFO, across compactions."""

from __future__ import annotations

import random
from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from kvbaton.cache.block_pool import BlockPool


def _drive(num_blocks: int, seed: int, num_ops: int) -> None:
    """Random allocate/ref/release against a deque FIFO and explicit counts; every answer must agree."""
    rng = random.Random(seed)
    pool = BlockPool(num_blocks)
    fifo: deque[int] = deque(range(num_blocks))
    counts = [0] * num_blocks
    held: list[int] = []
    for _ in range(num_ops):
        op = rng.random()
        if op < 0.45 and fifo:
            k = rng.randint(1, min(len(fifo), 64))
            expected = [fifo.popleft() for _ in range(k)]
            assert pool.allocate(k) == expected
            for b in expected:
                counts[b] = 1
            held.extend(expected)
        elif op < 0.6 and held:
            extra = rng.sample(held, rng.randint(1, min(len(held), 8)))
            pool.ref(extra)
            for b in extra:
                counts[b] += 1
            held.extend(extra)
        elif held:
            rng.shuffle(held)
            k = rng.randint(1, min(len(held), 64))
            batch = []
            for b in held[:k]:
                if b not in batch:  # the fast path: no id twice in one call
                    batch.append(b)
            for b in batch:
                held.remove(b)
                counts[b] -= 1
                if counts[b] == 0:
                    fifo.append(b)
            pool.release(batch)
        assert pool.free_block_ids() == list(fifo)
        assert pool.num_free_blocks == len(fifo) and pool.num_used_blocks == num_blocks - len(fifo)
    pool.check_invariants()
    assert [pool.ref_count(b) for b in range(num_blocks)] == counts


def test_order_matches_a_fifo_through_many_compactions() -> None:
    # Thousands of allocations from a small pool push the consumed head past the compaction size
    # many times over.
    _drive(num_blocks=200, seed=7, num_ops=4000)


@settings(max_examples=30, deadline=None)
@given(num_blocks=st.integers(1, 80), seed=st.integers(0, 10**6))
def test_random_operations_match_a_fifo(num_blocks: int, seed: int) -> None:
    _drive(num_blocks, seed, num_ops=150)


def test_release_listing_a_block_twice_frees_it_once_in_order() -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    pool.ref([1])
    pool.release([1, 0, 1])  # block 1 had two references
    assert pool.free_block_ids() == [3, 0, 1]
    pool.check_invariants()


def test_allocation_spanning_never_allocated_and_freed_ids_keeps_fifo_order() -> None:
    # The queue is the ids never allocated (in order), then the freed ones: one allocation may take from both.
    pool = BlockPool(6)
    assert pool.allocate(2) == [0, 1]
    pool.release([1, 0])
    assert pool.free_block_ids() == [2, 3, 4, 5, 1, 0]
    assert pool.allocate(5) == [2, 3, 4, 5, 1]
    assert [pool.ref_count(b) for b in range(6)] == [0, 1, 1, 1, 1, 1]
    assert pool.num_free_blocks == 1 and pool.num_used_blocks == 5
    pool.check_invariants()
