"""BlockPool.ref/release against a plain model: the one-pass updates that validate as they go either apply in
full or raise ValueError leaving every count and the free queue exactly as they were."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbaton.cache.block_pool import BlockPool

NUM_BLOCKS = 8

ids = st.lists(st.integers(-2, NUM_BLOCKS + 1), min_size=1, max_size=6)
ops = st.lists(st.one_of(st.tuples(st.just("allocate"), st.integers(0, 3)), st.tuples(st.just("ref"), ids),
                         st.tuples(st.just("release"), ids)), min_size=1, max_size=40)


def _model_release(counts: list[int], free: list[int], block_ids: list[int]) -> bool:
    """Apply a release to the model if it is valid (every id in range, no more releases than references)."""
    need = Counter(block_ids)
    if any(not 0 <= b < NUM_BLOCKS or counts[b] < n for b, n in need.items()):
        return False
    for b in block_ids:
        counts[b] -= 1
        if counts[b] == 0:
            free.append(b)
    return True


@settings(max_examples=300, deadline=None, derandomize=True)
@given(ops=ops)
def test_ref_and_release_apply_in_full_or_change_nothing(ops: list[tuple]) -> None:
    pool = BlockPool(NUM_BLOCKS)
    counts = [0] * NUM_BLOCKS
    free = list(range(NUM_BLOCKS))
    for kind, arg in ops:
        if kind == "allocate":
            if arg > len(free):
                continue
            got = pool.allocate(arg)
            assert got == free[:arg]
            del free[:arg]
            for b in got:
                counts[b] = 1
        elif kind == "ref":
            valid = all(0 <= b < NUM_BLOCKS and counts[b] > 0 for b in arg)
            if valid:
                pool.ref(arg)
                for b in arg:
                    counts[b] += 1
            else:
                with pytest.raises(ValueError):
                    pool.ref(arg)
        else:
            before = (list(counts), list(free))
            if _model_release(counts, free, arg):
                pool.release(arg)
            else:
                assert (counts, free) == before
                with pytest.raises(ValueError):
                    pool.release(arg)
        assert [pool.ref_count(b) for b in range(NUM_BLOCKS)] == counts
        assert pool.free_block_ids() == free
        pool.check_invariants()


def test_release_listing_a_block_twice_frees_it_once_its_last_reference_goes() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.ref([blocks[0]])
    pool.release([blocks[0], blocks[1], blocks[0]])
    assert pool.free_block_ids() == [2, 3, 1, 0]
    pool.allocate(4)
    pool.ref([1])
    with pytest.raises(ValueError):
        pool.release([1, 2, 1, 1])  # three releases of block 1's two references: nothing changes
    assert [pool.ref_count(b) for b in range(4)] == [1, 2, 1, 1] and pool.free_block_ids() == []


def _state(pool: BlockPool) -> tuple[list[int], list[int]]:
    return [pool.ref_count(b) for b in range(pool.num_blocks)], pool.free_block_ids()


def _outcome(call: object, block_ids: list[int]) -> str:
    try:
        call(block_ids)  # type: ignore[operator]
    except ValueError as error:
        return f"ValueError: {error}"
    return "ok"


# Counts mostly 1 (the run of last references `release` zeroes in bulk) and 2, with free blocks (0) and bad ids
# mixed in, so the run, the general pass after it and the undo of either are all reached.
release_lists = st.lists(st.one_of(st.integers(0, NUM_BLOCKS - 1), st.sampled_from([-1, -NUM_BLOCKS, NUM_BLOCKS])),
                         min_size=1, max_size=10)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(counts=st.lists(st.sampled_from([0, 1, 1, 1, 2, 3]), min_size=NUM_BLOCKS, max_size=NUM_BLOCKS),
       block_ids=release_lists)
def test_release_fast_paths_match_the_general_path(counts: list[int], block_ids: list[int]) -> None:
    """`release` (bulk run of count-1 ids, then the one-pass update) leaves the pool as the general per-id path
    does and raises the same error, nothing changed, on a bad id (out of range, negative, a free block, or
    listed more often than it is referenced)."""
    fast, general = BlockPool(NUM_BLOCKS), BlockPool(NUM_BLOCKS)
    for pool in (fast, general):
        pool.allocate(NUM_BLOCKS)
        pool.release([b for b in range(NUM_BLOCKS) if counts[b] == 0])
        pool.ref([b for b in range(NUM_BLOCKS) for _ in range(counts[b] - 1)])
    before = _state(fast)
    assert before == _state(general)
    outcome = _outcome(fast.release, block_ids)
    assert outcome == _outcome(general._release_with_duplicates, block_ids)
    assert _state(fast) == _state(general)
    if outcome != "ok":
        assert _state(fast) == before
    fast.check_invariants()


def test_release_run_of_last_references_then_shared_blocks_queues_in_list_order() -> None:
    pool = BlockPool(6)
    blocks = pool.allocate(6)
    pool.ref([blocks[2], blocks[4]])
    pool.release([5, 1, 0, 2, 3, 4])  # run 5, 1, 0; block 2 ends it (count 2); 3 queued by the general pass
    assert pool.free_block_ids() == [5, 1, 0, 3] and pool.ref_count(2) == 1 and pool.ref_count(4) == 1
    with pytest.raises(ValueError, match="block 3 has 0 references"):
        pool.release([2, 3])  # 2 reaches 0 in the run, 3 is free: undone
    assert pool.free_block_ids() == [5, 1, 0, 3] and pool.ref_count(2) == 1
    with pytest.raises(ValueError, match="outside"):
        pool.ref([4, -1])  # -1 would index the last block: refused before any write
    assert pool.ref_count(4) == 1 and pool.ref_count(5) == 0
