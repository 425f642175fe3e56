"""The pooled bound: one LRU cache at block granularity, arrival order, chained block ids."""

from __future__ import annotations

import pytest

from kvbaton.bench.pooled import (capacity_blocks_for, pooled_lru_hit_ratio, pooled_lru_hit_ratio_of_blocks,
                                  pooled_lru_hit_ratio_of_trace)
from kvbaton.bench.tokens import as_token_array
from kvbaton.bench.workloads import create_workload
from kvbaton.bench.workloads.base import WorkloadRequest
from kvbaton.core.errors import InvalidRequestError


def _bound(prompts, capacity, block_size=4):
    return pooled_lru_hit_ratio_of_blocks(prompts, capacity, block_size)


def test_unlimited_memory_hits_every_repeated_leading_block():
    # 3 blocks of 4 tokens, then the same prefix of 2 blocks + a new one, then a 9-token prompt repeating 2 blocks
    prompts = [([1, 2, 3], 12), ([1, 2, 9], 12), ([1, 2, 3], 9)]
    bound = _bound(prompts, None)
    assert (bound.num_hit_tokens, bound.num_prompt_tokens) == (8 + 8, 33)
    assert bound.hit_ratio == pytest.approx(16 / 33)


def test_the_last_token_is_always_computed():
    # a prompt of exactly 2 full blocks seen before can hit only its first block, as a worker's cache would
    bound = _bound([([5, 6], 8), ([5, 6], 8)], None)
    assert bound.num_hit_tokens == 4


def test_a_hit_stops_at_the_first_missing_block():
    bound = _bound([([1, 2, 3], 12), ([7, 2, 3], 12)], None)
    assert bound.num_hit_tokens == 0


def test_lru_evicts_the_least_recently_used_prompt_tail_first():
    # capacity 3: prompt A (1,2,3) then B (4): A's tail block 3 is the oldest, so it goes; A's head 1,2 stay
    bound = _bound([([1, 2, 3], 13), ([4], 5), ([1, 2, 3], 13)], 3)
    assert bound.num_hit_tokens == 8
    # capacity 0 never hits
    assert _bound([([1], 5), ([1], 5)], 0).num_hit_tokens == 0


def test_workload_requests_are_hashed_per_tenant():
    tokens = as_token_array(list(range(20, 36)))
    same = [WorkloadRequest(i, float(i), (tokens,), 1) for i in range(2)]
    other = [WorkloadRequest(0, 0.0, (tokens,), 1, tenant="a"), WorkloadRequest(1, 1.0, (tokens,), 1, tenant="b")]
    assert pooled_lru_hit_ratio(same, None, 4).num_hit_tokens == 12
    assert pooled_lru_hit_ratio(other, None, 4).num_hit_tokens == 0


def test_trace_rows_use_the_trace_block_size_and_match_the_workload():
    rows = [{"hash_ids": [0, 1], "input_length": 1000}, {"hash_ids": [0, 1, 2], "input_length": 1100},
            {"hash_ids": [3], "input_length": 10}]
    bound = pooled_lru_hit_ratio_of_trace(rows, None, 512)
    assert (bound.num_hit_tokens, bound.num_prompt_tokens) == (512, 2110)
    assert pooled_lru_hit_ratio_of_trace(rows, 512, 512).num_hit_tokens == 512  # one block of memory
    assert pooled_lru_hit_ratio_of_trace(rows, 511, 512).num_hit_tokens == 0


def test_more_memory_never_hits_less_on_a_real_workload():
    requests = create_workload("agent", num_requests=60, seed=1)
    ratios = [pooled_lru_hit_ratio(requests, capacity, 16).hit_ratio for capacity in (0, 50, 200, 1000, None)]
    assert ratios == sorted(ratios) and ratios[0] == 0.0 and ratios[-1] > 0.3


def test_capacity_from_bytes_and_bad_arguments():
    assert capacity_blocks_for(256e9, 131072, 64) == 30517
    with pytest.raises(InvalidRequestError):
        capacity_blocks_for(1e9, 0, 16)
    with pytest.raises(InvalidRequestError):
        _bound([], -1)
