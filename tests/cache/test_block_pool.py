"""BlockPool: exact allocation order, reference counting and refusal of misuse."""

from __future__ import annotations

import pytest

from kvbaton.cache.block_pool import BlockPool
from kvbaton.core.errors import CapacityError


def test_initial_free_queue_is_ids_in_order() -> None:
    pool = BlockPool(5)
    assert pool.free_block_ids() == [0, 1, 2, 3, 4]
    assert (pool.num_free_blocks, pool.num_used_blocks) == (5, 0)
    pool.check_invariants()


def test_allocate_pops_head_and_release_appends_tail() -> None:
    pool = BlockPool(6)
    assert pool.allocate(3) == [0, 1, 2]
    assert [pool.ref_count(i) for i in range(6)] == [1, 1, 1, 0, 0, 0]
    pool.release([2, 0])
    assert pool.free_block_ids() == [3, 4, 5, 2, 0]
    # Least recently freed first: the never-used blocks, then 2, then 0.
    assert pool.allocate(4) == [3, 4, 5, 2]
    assert pool.allocate(1) == [0]
    assert pool.num_free_blocks == 0
    pool.check_invariants()


def test_allocate_too_many_raises_and_allocates_nothing() -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    assert not pool.can_allocate(2)
    assert pool.can_allocate(1)
    with pytest.raises(CapacityError):
        pool.allocate(2)
    assert pool.free_block_ids() == [3]
    pool.check_invariants()


def test_ref_and_release_count_references() -> None:
    pool = BlockPool(3)
    (block_id,) = pool.allocate(1)
    pool.ref([block_id, block_id])
    assert pool.ref_count(block_id) == 3
    pool.release([block_id])
    pool.release([block_id])
    assert pool.ref_count(block_id) == 1 and pool.num_free_blocks == 2
    pool.release([block_id])
    assert pool.ref_count(block_id) == 0
    assert pool.free_block_ids() == [1, 2, 0]
    pool.check_invariants()


def test_ref_of_free_block_raises_without_partial_update() -> None:
    pool = BlockPool(3)
    pool.allocate(1)
    with pytest.raises(ValueError, match="free block 1"):
        pool.ref([0, 1])
    assert pool.ref_count(0) == 1
    pool.check_invariants()


def test_release_of_free_block_raises_without_partial_update() -> None:
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(ValueError):
        pool.release([0, 2])
    with pytest.raises(ValueError):
        pool.release([1, 1])  # held once, released twice in one call
    assert [pool.ref_count(i) for i in range(3)] == [1, 1, 0]
    assert pool.free_block_ids() == [2]
    pool.check_invariants()


def test_unknown_ids_and_bad_sizes_raise() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.ref_count(2)
    with pytest.raises(ValueError):
        pool.release([-1])
    with pytest.raises(ValueError):
        pool.allocate(-1)
    with pytest.raises(ValueError):
        BlockPool(0)


def test_check_invariants_detects_corruption() -> None:
    pool = BlockPool(3)
    pool.allocate(1)
    pool._ref_counts[1] = 1  # held by nobody's account but still queued
    with pytest.raises(AssertionError, match="queued block 1"):
        pool.check_invariants()
