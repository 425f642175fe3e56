"""The simulator's shortcuts give the runs their general paths give: shared prompt parts converted and hashed
once (with a memo of hashed heads bounded in tokens, and one of block-aligned parts under their prefix), arrivals
merged into the event heap from their own list."""

from __future__ import annotations

import gc

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbaton.bench.tokens import as_token_array
from kvbaton.bench.workloads import create_workload
from kvbaton.bench.workloads.base import WorkloadRequest
from kvbaton.cache.hashing import CacheKey, hash_prompt
from kvbaton.core.config import CacheConfig
from kvbaton.sim.cluster import ClusterSim
from kvbaton.sim.config import SimConfig
from kvbaton.sim.costs import ConstantCostModel
from kvbaton.sim.prompts import SimPrompts
from kvbaton.sim.spec import parse_cluster_spec


def _workload(parts_of: list[list[int]], tenants: list[str], rng: np.random.Generator) -> list[WorkloadRequest]:
    pool = [as_token_array(rng.integers(0, 5000, size=n)) for n in (5, 16, 33, 48, 70)]
    return [WorkloadRequest(i, 0.0, tuple(pool[p] for p in parts), 1, tenant=tenants[i % len(tenants)])
            for i, parts in enumerate(parts_of)]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(parts_of=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=4), min_size=1, max_size=12),
       tenants=st.sampled_from([[""], ["", "b"], ["a", "b", "c"]]), seed=st.integers(0, 3))
def test_prompt_ids_and_hashes_from_shared_parts_are_the_whole_prompts(parts_of: list[list[int]],
                                                                      tenants: list[str], seed: int) -> None:
    sim = ClusterSim(parse_cluster_spec("1xmixed"), ConstantCostModel(0.01), SimConfig(cache=CacheConfig(16, 64)))
    for wr in _workload(parts_of, tenants, np.random.default_rng(seed)) * 2:  # every part seen again
        prompt = sim.prompts.ids(wr)
        assert prompt == wr.prompt_array.tolist()
        key = sim.config.cache_key.with_tenant(wr.tenant)
        assert sim.prompts.hashed(wr, prompt) == hash_prompt(key, prompt, 16)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(parts_of=st.lists(st.lists(st.integers(0, 4), min_size=2, max_size=4), min_size=1, max_size=16),
       memo_tokens=st.sampled_from([0, 16, 48, 100]), seed=st.integers(0, 3))
def test_a_small_memo_of_hashed_heads_evicts_and_still_gives_the_whole_prompts(parts_of: list[list[int]],
                                                                             memo_tokens: int, seed: int) -> None:
    prompts = SimPrompts(CacheKey("m", "l"), 16, memo_tokens)
    for wr in _workload(parts_of, [""], np.random.default_rng(seed)) * 2:
        prompt = prompts.ids(wr)
        assert prompts.hashed(wr, prompt) == hash_prompt(CacheKey("m", "l"), prompt, 16)
        held = sum(len(blocks) * 16 for _, blocks, _ in prompts._part_hashes.values())
        assert held == prompts._memo_tokens <= memo_tokens


@settings(max_examples=60, deadline=None, derandomize=True)
@given(parts_of=st.lists(st.tuples(st.lists(st.sampled_from([1, 3]), min_size=1, max_size=5),
                                   st.integers(0, 4)), min_size=1, max_size=12),
       tenants=st.sampled_from([[""], ["", "b"]]), chain_memo_tokens=st.sampled_from([0, 16, 64, 1 << 20]),
       seed=st.integers(0, 3))
def test_block_aligned_parts_hashed_part_by_part_give_the_whole_prompts(parts_of: list[tuple[list[int], int]],
                                                                        tenants: list[str], chain_memo_tokens: int,
                                                                        seed: int) -> None:
    """Prompts of block-aligned parts (16 and 48 tokens; 5, 33, 70 are not) then any last part: `prompt` takes each
    aligned part from its memo under the hash before it (bounded in tokens, a part kept from its second sighting),
    and gives what the general path gives, in any order, under any tenant, with a memo too small to keep anything or
    every part."""
    rng = np.random.default_rng(seed)
    requests = _workload([heads + [last] for heads, last in parts_of], tenants, rng)
    prompts = SimPrompts(CacheKey("m", "l"), 16, chain_memo_tokens=chain_memo_tokens)
    once = _workload([[1, 3, 0]], [""], np.random.default_rng(seed + 10))[0]  # parts of its own, seen once
    prompts.prompt(once)
    assert not prompts._chain
    for wr in requests * 2:
        prompt, blocks = prompts.prompt(wr)
        assert prompt == wr.prompt_array.tolist()
        assert blocks == hash_prompt(CacheKey("m", "l").with_tenant(wr.tenant), prompt, 16)
        held = sum(len(part) for part, _, _, _ in prompts._chain.values())
        assert held == prompts._chain_tokens <= chain_memo_tokens
        assert sum(prompts._seen.values()) == prompts._seen_tokens <= 2 * chain_memo_tokens
        assert not prompts._seen.keys() & prompts._chain.keys()
    if chain_memo_tokens >= 1 << 20:  # every aligned head part after its prefix, seen twice, is kept once
        aligned = {(wr.tenant, tuple(map(id, wr.prompt_parts[:i + 1]))) for wr in requests
                   for i in range(len(wr.prompt_parts) - 1)}
        assert len(prompts._chain) == len(aligned)


def test_arrivals_at_the_same_time_are_served_in_the_order_given() -> None:
    rng = np.random.default_rng(0)
    requests = [WorkloadRequest(i, 0.5 if i < 4 else 0.25, (as_token_array(rng.integers(0, 5000, size=40)),), 3)
                for i in range(6)]

    def fronts(order: list[int]) -> dict[str, str]:
        sim = ClusterSim(parse_cluster_spec("3xmixed"), ConstantCostModel(0.01), SimConfig(cache=CacheConfig(16, 64)))
        return {r.request_id: r.worker_ids[0] for r in sim.run([requests[i] for i in order])}

    # Round robin over w0, w1, w2 in arrival order; the two at 0.25 s come first, ties in the order given.
    assert fronts([0, 1, 2, 3, 4, 5]) == {"req-4": "w0", "req-5": "w1", "req-0": "w2", "req-1": "w0",
                                          "req-2": "w1", "req-3": "w2"}
    assert fronts([5, 4, 3, 2, 1, 0]) == {"req-5": "w0", "req-4": "w1", "req-3": "w2", "req-2": "w0",
                                          "req-1": "w1", "req-0": "w2"}


def test_event_loop_makes_no_reference_cycles_and_restores_the_collector() -> None:
    """`ClusterSim.run` pauses the cyclic collector: sound only while the loop leaves no cyclic garbage behind
    (everything it drops is freed by reference counting). Runs that fail requests, preempt, retry handoffs,
    hand off KV, admit, reject and lend workers leave none; the collector is back as it was after each run."""
    from kvbaton.router.pools import PoolConfig
    from kvbaton.sim.run import SimSetup, build_sim

    tool_use = create_workload("tool-use", num_requests=60, seed=2, rate=40.0, num_tools=4)
    sharegpt = create_workload("sharegpt-like", num_requests=60, seed=2, rate=40.0)
    setups = [(tool_use, SimSetup(cluster="2xmixed", policy="preble", num_blocks=300, max_model_len=4096)),
              (tool_use, SimSetup(cluster="2xmixed", policy="round_robin", num_blocks=120, max_model_len=2048)),
              (tool_use, SimSetup(cluster="2P2D", policy="preble", num_blocks=250, max_model_len=4096)),
              (sharegpt, SimSetup(model="opt-13b", gpu="a100", cluster="2P2D", cost_model="distserve",
                                  num_blocks=300, max_model_len=2048, admission="predicted",
                                  admission_slo=(0.5, 0.1))),
              (tool_use, SimSetup(gpu="a100", cluster="3P1D", enable_prefix_cache=False, admission_slo=(1.0, 0.02),
                                  adaptive_pools=True, pools=PoolConfig(sustain_s=0.5, cooldown_s=1.0)))]
    statuses = set()
    for enabled in (True, False):
        for requests, setup in setups:
            sim, _, _ = build_sim(setup)
            gc.collect()
            if not enabled:
                gc.disable()
            try:
                records = sim.run(requests)
                assert gc.isenabled() is enabled
            finally:
                gc.enable()
            assert gc.collect() == 0, setup
            statuses.update(r.status for r in records)
    assert statuses == {"completed", "failed", "rejected"}


def test_simulate_frees_the_run_without_the_cyclic_collector() -> None:
    """`simulate` closes the sim (`ClusterSim.close` cuts its reference cycles) before the collector resumes: the
    whole run is freed by reference counting, whether the collector was on or off, and it is back as it was."""
    from kvbaton.sim.run import SimSetup, simulate

    tool_use = create_workload("tool-use", num_requests=60, seed=3, rate=40.0, num_tools=4)
    sharegpt = create_workload("sharegpt-like", num_requests=60, seed=3, rate=40.0)
    setups = [(tool_use, SimSetup(cluster="2xmixed", policy="preble", num_blocks=300, max_model_len=4096)),
              (tool_use, SimSetup(cluster="2P2D", policy="preble", num_blocks=250, max_model_len=4096)),
              (tool_use, SimSetup(cluster="2P2D", policy="longest_prefix", reserve_ahead_tokens=512)),
              (sharegpt, SimSetup(model="opt-13b", gpu="a100", cluster="2P2D", cost_model="distserve",
                                  num_blocks=300, max_model_len=2048, admission="predicted",
                                  admission_slo=(0.5, 0.1)))]
    for enabled in (True, False):
        for requests, setup in setups:
            gc.collect()
            if not enabled:
                gc.disable()
            try:
                result = simulate(requests, setup)
                assert gc.isenabled() is enabled
            finally:
                gc.enable()
            assert gc.collect() == 0, setup
            assert len(result.records) == len(requests)
