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
