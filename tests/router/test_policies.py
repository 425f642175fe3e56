"""Exact decisions of every placement policy on small hand-built clusters."""

from __future__ import annotations

import random

import pytest

from kvbaton.cache.hashing import CacheKey
from kvbaton.core.errors import CapacityError, InvalidRequestError
from kvbaton.router.base import RouteRequest
from kvbaton.router.load import LoadTracker, WorkerStats
from kvbaton.router.policies import create_policy, local_queue_policy
from kvbaton.router.preble import PrebleConfig, PrebleE2Policy
from kvbaton.router.prefill_model import PrefillTimeModel
from kvbaton.router.prefix_index import GlobalPrefixIndex
from kvbaton.router.state import RouterState

KEY = CacheKey("m", "l")
BS = 4
WORKERS = ["w0", "w1", "w2"]


def make_state() -> RouterState:
    # 0.01 s per prompt token, nothing else: costs are easy to compute by hand.
    return RouterState(
        block_size=BS,
        index=GlobalPrefixIndex(),
        load=LoadTracker(window_s=100.0),
        prefill_model=PrefillTimeModel(0.0, 0.01, 0.0, 0.0),
        decode_s_per_token=0.0,
    )


def req(request_id: str, *blocks: int, output: int = 4) -> RouteRequest:
    tokens = [t for b in blocks for t in [b] * BS]
    return RouteRequest.from_tokens(request_id, tokens, KEY, BS, num_output_tokens=output)


def heartbeat(state: RouterState, worker: str, queued: int = 0, used: int = 0, free: int = 1000) -> None:
    state.load.on_stats(WorkerStats(worker, queued, used, free, block_size=BS), now=0.0)


def test_round_robin_cycles_and_reports_matches() -> None:
    state = make_state()
    policy = create_policy("round_robin", state, random.Random(0))
    decisions = [policy.choose(req(f"r{i}", 1, 2), WORKERS, now=float(i)) for i in range(4)]
    assert [d.worker_id for d in decisions] == ["w0", "w1", "w2", "w0"]
    assert [d.num_matched_tokens for d in decisions] == [0, 0, 0, 8]
    assert decisions[0].reason == "round_robin"


def test_least_load_counts_tokens_not_requests() -> None:
    state = make_state()
    heartbeat(state, "w0", queued=100)
    heartbeat(state, "w1", queued=10)
    heartbeat(state, "w2", used=4)  # 16 KV tokens in use
    policy = create_policy("least_load", state, random.Random(0))
    first = policy.choose(req("a", 1, 2), WORKERS, now=1.0)  # 8 prompt tokens
    second = policy.choose(req("b", 3), WORKERS, now=1.0)
    third = policy.choose(req("c", 4), WORKERS, now=1.0)
    assert (first.worker_id, first.load_tokens) == ("w1", 18)
    assert (second.worker_id, second.load_tokens) == ("w2", 20)
    assert third.worker_id == "w1"


def test_longest_prefix_prefers_locality_then_load() -> None:
    state = make_state()
    state.index.on_routed("w0", req("x", 1, 2).block_hashes)
    state.index.on_routed("w1", req("y", 1, 2, 3).block_hashes)
    state.index.on_routed("w2", req("z", 1, 2, 3).block_hashes)
    heartbeat(state, "w0")
    heartbeat(state, "w1", queued=50)
    heartbeat(state, "w2", queued=40)
    policy = create_policy("longest_prefix", state, random.Random(0))
    hit = policy.choose(req("a", 1, 2, 3, 4), WORKERS, now=1.0)
    assert (hit.worker_id, hit.num_matched_tokens, hit.reason) == ("w2", 12, "longest_prefix")
    miss = policy.choose(req("b", 9), WORKERS, now=1.0)
    assert (miss.worker_id, miss.num_matched_tokens) == ("w0", 0)


def test_ties_are_seeded_and_independent_of_worker_order() -> None:
    def run(order: list[str], seed: int) -> list[str]:
        policy = create_policy("least_load", make_state(), random.Random(seed))
        return [policy.choose(req(f"r{i}", i + 1), order, now=0.0).worker_id for i in range(6)]

    assert run(WORKERS, 7) == run(list(reversed(WORKERS)), 7)
    assert run(WORKERS, 7) == run(WORKERS, 7)
    assert len({tuple(run(WORKERS, s)) for s in range(6)}) > 1  # the seed matters


def test_preble_exploit_explore_boundary() -> None:
    state = make_state()
    state.index.on_routed("w0", req("x", 1, 2, 3).block_hashes)
    state.load.on_assigned("w0", "busy", now=0.0, num_prefill_tokens=0, num_blocks=0, work_s=5.0)
    policy = create_policy("preble", state, random.Random(0))
    # 8 cached of 16 prompt tokens: cached is not > missed, so explore; w0 is busy.
    explore = policy.choose(req("a", 1, 2, 7, 8), WORKERS, now=1.0)
    assert explore.reason == "explore" and explore.worker_id in ("w1", "w2")
    assert explore.costs is not None
    assert explore.costs.load_s == 0.0 and explore.costs.prefill_s == pytest.approx(0.16)
    # 12 of 16 cached: exploit, and only w0 qualifies although it is far busier.
    exploit = policy.choose(req("b", 1, 2, 3, 9), WORKERS, now=1.0)
    assert (exploit.worker_id, exploit.reason, exploit.num_matched_tokens) == ("w0", "exploit", 12)
    assert exploit.costs is not None
    assert exploit.costs.load_s == pytest.approx(5.0) and exploit.costs.prefill_s == pytest.approx(0.04)


def test_preble_exploit_picks_least_cost_holder() -> None:
    state = make_state()
    for worker in ("w0", "w1"):
        state.index.on_routed(worker, req("x", 1, 2, 3).block_hashes)
    state.load.on_assigned("w0", "busy", now=0.0, num_prefill_tokens=0, num_blocks=0, work_s=1.0)
    policy = create_policy("preble", state, random.Random(0))
    decision = policy.choose(req("a", 1, 2, 3, 4), WORKERS, now=1.0)
    assert (decision.worker_id, decision.reason) == ("w1", "exploit")


def test_preble_explore_prices_eviction() -> None:
    state = make_state()
    for _ in range(3):
        state.index.on_routed("w1", req("x", 5, 6).block_hashes)  # 2 blocks, each routed 3 times
    heartbeat(state, "w0", free=1000)
    heartbeat(state, "w1", free=0)
    policy = create_policy("preble", state, random.Random(0))
    # 16 prompt + 4 output tokens need 5 blocks; w1 must evict 5, each priced at
    # block prefill (0.04 s) x reuses beyond the first (2) = 0.08 s.
    only_w1 = policy.choose(req("a", 1, 2, 3, 4), ["w1"], now=1.0)
    assert only_w1.costs is not None and only_w1.costs.eviction_s == pytest.approx(0.4)
    choice = policy.choose(req("b", 7, 8, 9, 10), ["w0", "w1"], now=1.0)
    assert choice.worker_id == "w0" and choice.costs is not None and choice.costs.eviction_s == 0.0


def test_preble_spreads_identical_requests_instead_of_herding() -> None:
    def run(seed: int) -> list[str]:
        policy = create_policy("preble", make_state(), random.Random(seed))
        workers = [f"w{i}" for i in range(8)]
        return [policy.choose(req(f"r{i}", 100 + i, 200 + i), workers, now=0.0).worker_id for i in range(8)]

    assert sorted(run(1)) == [f"w{i}" for i in range(8)]
    assert run(1) == run(1)


def _loaded_cluster(heavy_groups: dict[int, float], heavy_free_s: float, light_s: float) -> tuple[RouterState, PrebleE2Policy]:
    """w0 holds prefixes (blocks g, g+1, g+2) with window work per group; w1 has light_s of ungrouped work."""
    state = make_state()
    for first, work_s in heavy_groups.items():
        prefix = req("p", first, first + 1, first + 2).block_hashes
        state.index.on_routed("w0", prefix)
        num_chunks = max(1, round(work_s / 0.5))  # several entries, so half a group can move
        for i in range(num_chunks):
            state.load.on_assigned("w0", f"g{first}-{i}", 0.0, 0, 0, work_s / num_chunks, group=prefix[-1])
    if heavy_free_s:
        state.load.on_assigned("w0", "free", 0.0, 0, 0, heavy_free_s)
    state.load.on_assigned("w1", "light", 0.0, 0, 0, light_s)
    config = PrebleConfig(warmup_decisions=0, rebalance_every=1, ttft_window_s=10.0, min_ttft_samples=2)
    return state, PrebleE2Policy(state, random.Random(0), config)


def test_rebalancing_triggers_at_one_and_a_half_times_the_lightest() -> None:
    state, policy = _loaded_cluster({10: 0.1}, heavy_free_s=1.39, light_s=1.0)
    assert not policy.rebalance(["w0", "w1"], now=1.0)  # 1.49 < 1.5 x 1.0
    state, policy = _loaded_cluster({10: 0.1}, heavy_free_s=1.4, light_s=1.0)
    assert policy.rebalance(["w0", "w1"], now=1.0)  # 1.5 >= 1.5 x 1.0: the cheap group moves
    group = req("p", 10, 11, 12).block_hashes[-1]
    assert policy.allocation_of(group) == {"w1"}
    assert state.load.window_load_s("w1") == pytest.approx(1.1)
    decision = policy.choose(req("a", 10, 11, 12, 99), ["w0", "w1"], now=1.0)
    assert (decision.worker_id, decision.reason) == ("w1", "rebalanced")


def test_rebalancing_moves_cheapest_groups_without_overshooting() -> None:
    state, policy = _loaded_cluster({10: 1.0, 20: 3.0}, heavy_free_s=0.0, light_s=2.0)
    assert policy.rebalance(["w0", "w1"], now=1.0)
    assert policy.allocation_of(req("p", 10, 11, 12).block_hashes[-1]) == {"w1"}  # 4-1 >= 2+1: moved
    assert policy.allocation_of(req("p", 20, 21, 22).block_hashes[-1]) == frozenset()  # 3-3 < 3+3: stays
    assert policy.num_moved_groups == 1


def test_hot_prefix_is_replicated_only_when_its_ttft_keeps_rising() -> None:
    state, policy = _loaded_cluster({10: 3.0}, heavy_free_s=0.0, light_s=1.0)
    group = req("p", 10, 11, 12).block_hashes[-1]
    assert not policy.rebalance(["w0", "w1"], now=1.0)  # one group too big to move, no TTFT trend yet
    for i, (at, ttft) in enumerate([(0.5, 0.1), (1.0, 0.1), (6.0, 0.3), (7.0, 0.4)]):
        state.load.on_assigned("w0", f"t{i}", 0.0, 0, 0, 0.0, group=group)
        policy.on_first_token(f"t{i}", ttft, now=at)
    assert policy.rebalance(["w0", "w1"], now=8.0)
    assert policy.allocation_of(group) == {"w0", "w1"} and policy.num_replications == 1
    assert state.load.window_load_s("w1") == pytest.approx(2.5)  # half the group's work followed
    decision = policy.choose(req("a", 10, 11, 12, 99), ["w0", "w1"], now=8.0)
    assert decision.reason == "replicated"
    policy.on_worker_removed("w1")
    assert policy.allocation_of(group) == {"w0"}
    assert state.index.match(req("a", 10, 11, 12).block_hashes) == {"w0": 3}


def test_flat_ttft_does_not_replicate() -> None:
    state, policy = _loaded_cluster({10: 3.0}, heavy_free_s=0.0, light_s=1.0)
    group = req("p", 10, 11, 12).block_hashes[-1]
    for i, at in enumerate([0.5, 1.0, 6.0, 7.0]):
        state.load.on_assigned("w0", f"t{i}", 0.0, 0, 0, 0.0, group=group)
        policy.on_first_token(f"t{i}", 0.2, now=at)
    assert not policy.rebalance(["w0", "w1"], now=8.0)


def test_factory_and_errors() -> None:
    state = make_state()
    for name in ("round_robin", "least_load", "longest_prefix", "preble"):
        policy = create_policy(name, state, random.Random(0))
        assert policy.name == name
        with pytest.raises(CapacityError):
            policy.choose(req("a", 1), [], now=0.0)
    with pytest.raises(InvalidRequestError):
        create_policy("nope", state, random.Random(0))
    assert local_queue_policy("preble") == "preble" and local_queue_policy("round_robin") == "fcfs"


def test_finished_requests_release_their_assignment() -> None:
    state = make_state()
    policy = create_policy("preble", state, random.Random(0))
    policy.choose(req("a", 1, 2), WORKERS, now=0.0)
    assert state.load.assignment("a") is not None
    policy.on_finished("a", now=1.0)
    policy.on_finished("a", now=1.0)
    assert state.load.assignment("a") is None


def test_tenants_never_share_cached_prefixes() -> None:
    state = make_state()
    policy = create_policy("longest_prefix", state, random.Random(0))
    tokens = [1] * 8
    first = RouteRequest.from_tokens("a", tokens, KEY, BS, tenant="t1")
    other = RouteRequest.from_tokens("b", tokens, KEY, BS, tenant="t2")
    policy.choose(first, ["w0", "w1"], now=0.0)
    assert state.index.match(first.block_hashes) == {first_worker(state, first): 2}
    assert state.index.match(other.block_hashes) == {}


def first_worker(state: RouterState, request: RouteRequest) -> str:
    assignment = state.load.assignment(request.request_id)
    assert assignment is not None
    return assignment[0]


def test_every_policy_expires_old_window_work() -> None:
    state = make_state()  # 100 s window
    policy = create_policy("round_robin", state, random.Random(0))
    policy.choose(req("old", 1, 2), ["w0"], now=0.0)
    policy.choose(req("new", 3), ["w0"], now=150.0)
    assert state.load.window_load_s("w0") == pytest.approx(0.04)  # only the 4-token prompt is left


def test_preble_sweep_forgets_allocations_of_quiet_groups() -> None:
    state, policy = _loaded_cluster({10: 0.1}, heavy_free_s=1.4, light_s=1.0)
    group = req("p", 10, 11, 12).block_hashes[-1]
    assert policy.rebalance(["w0", "w1"], now=1.0) and policy.allocation_of(group) == {"w1"}
    state.load.prune(now=500.0)
    policy.sweep(now=500.0)
    assert policy.allocation_of(group) == frozenset()
