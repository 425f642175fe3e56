"""The conductor policy: least predicted queue + store load + prefill, with exact costs on hand-built clusters."""

from __future__ import annotations

import random

import pytest

from kvbaton.cache.hashing import CacheKey
from kvbaton.cache.kv_store import DISK, DRAM, StoreEvent
from kvbaton.cache.store_directory import StoreDirectory
from kvbaton.cache.store_prices import StorePrices
from kvbaton.router.base import RouteRequest
from kvbaton.router.load import LoadTracker, WorkerStats
from kvbaton.router.placement import ClusterPlacement, PlacementConfig
from kvbaton.router.policies import create_policy
from kvbaton.router.prefill_model import PrefillTimeModel
from kvbaton.router.prefix_index import GlobalPrefixIndex
from kvbaton.router.state import RouterState

KEY = CacheKey("m", "l")
BS = 4
WORKERS = ["w0", "w1", "w2"]
# one block = 1e6 bytes: 1 ms over a 1 GB/s host link, 10 ms over a 0.1 GB/s NIC, 100 ms from a 0.01 GB/s disk
PRICES = StorePrices(block_bytes=1_000_000, host_bytes_per_s=1e9, nic_bytes_per_s=1e8, disk_bytes_per_s=1e7,
                     latency_s=0.0)


def make_state(prices: StorePrices | None = PRICES) -> RouterState:
    # 0.01 s per prompt token: a block (4 tokens) costs 40 ms to recompute
    state = RouterState(block_size=BS, index=GlobalPrefixIndex(), load=LoadTracker(window_s=100.0),
                        prefill_model=PrefillTimeModel(0.0, 0.01, 0.0, 0.0), decode_s_per_token=0.0)
    if prices is not None:
        state.store, state.store_prices = StoreDirectory(), prices
    return state


def req(request_id: str, *blocks: int) -> RouteRequest:
    tokens = [t for b in blocks for t in [b] * BS] + [99]  # a partial block: every full block may hit
    return RouteRequest.from_tokens(request_id, tokens, KEY, BS, num_output_tokens=4)


def heartbeat(state: RouterState, worker: str, queued: int = 0) -> None:
    state.load.on_stats(WorkerStats(worker, queued, 0, 1000, block_size=BS), now=0.0)


def store_holds(state: RouterState, node: str, hashes, tier: str = DRAM) -> None:
    directory = state.store
    assert directory is not None
    seq = directory.last_seq(node) + 1
    assert directory.on_events(node, [StoreEvent(seq, "stored", tuple(hashes), tier)])


def test_without_any_cache_the_least_queued_worker_wins():
    state = make_state()
    for worker, queued in zip(WORKERS, (30, 10, 20)):
        heartbeat(state, worker, queued)
    decision = create_policy("conductor", state, random.Random(0)).choose(req("a", 1, 2, 3), WORKERS, now=1.0)
    assert decision.worker_id == "w1" and decision.num_matched_tokens == 0
    assert decision.costs.load_s == pytest.approx(0.10) and decision.costs.prefill_s == pytest.approx(0.13)


def test_a_store_load_from_another_node_beats_recomputing_and_a_long_queue():
    state = make_state()
    request = req("a", 1, 2, 3, 4)  # 17 tokens
    state.index.on_routed("w0", request.block_hashes)  # w0's device holds the whole prefix...
    heartbeat(state, "w0", queued=100)  # ...behind 1 s of queue
    heartbeat(state, "w1", queued=0)
    store_holds(state, "w0", request.block_hashes)  # the store holds it in w0's DRAM
    decision = create_policy("conductor", state, random.Random(0)).choose(request, ["w0", "w1"], now=1.0)
    # w0: 1.0 queue + 0.01 prefill; w1: 4 blocks over the NIC (40 ms) + 0.01 prefill
    assert decision.worker_id == "w1" and decision.num_matched_tokens == 16
    assert decision.costs.num_store_remote_blocks == 4 and decision.costs.num_store_dram_blocks == 0
    assert decision.costs.store_load_s == pytest.approx(0.04) and decision.costs.prefill_s == pytest.approx(0.01)
    # the load tracker books only the token left to prefill on w1
    assert state.load.queued_prefill_tokens("w1") == 1


def test_the_previous_turn_stays_where_its_kv_is_when_queues_are_even():
    state = make_state()
    request = req("a", 1, 2, 3)
    state.index.on_routed("w2", request.block_hashes)
    for worker in WORKERS:
        heartbeat(state, worker)
    store_holds(state, "w2", request.block_hashes)
    decision = create_policy("conductor", state, random.Random(0)).choose(request, WORKERS, now=1.0)
    assert decision.worker_id == "w2" and decision.costs.store_load_s == 0.0


def test_local_dram_beats_remote_and_a_slow_disk_is_recomputed():
    state = make_state()
    request = req("a", 1, 2)
    for worker in WORKERS:
        heartbeat(state, worker)
    store_holds(state, "w1", request.block_hashes)  # in w1's DRAM: 1 ms a block there, 10 ms elsewhere
    decision = create_policy("conductor", state, random.Random(0)).choose(request, WORKERS, now=1.0)
    assert decision.worker_id == "w1" and decision.costs.store_load_s == pytest.approx(0.002)
    assert (decision.costs.num_store_dram_blocks, decision.costs.num_store_disk_blocks,
            decision.costs.num_store_remote_blocks) == (2, 0, 0)  # the cost terms name the tier
    state = make_state()
    for worker in WORKERS:
        heartbeat(state, worker)
    store_holds(state, "w1", request.block_hashes, DISK)  # 100 ms a block from disk: recomputing (40 ms) wins
    decision = create_policy("conductor", state, random.Random(0)).choose(request, WORKERS, now=1.0)
    assert decision.num_matched_tokens == 0 and decision.costs.store_load_s == 0.0


def test_without_a_store_it_prices_the_device_match_alone():
    state = make_state(prices=None)
    request = req("a", 1, 2, 3)
    state.index.on_routed("w0", request.block_hashes)
    heartbeat(state, "w0", queued=5)  # 0.05 s of queue < 0.12 s of recompute elsewhere
    heartbeat(state, "w1")
    decision = create_policy("conductor", state, random.Random(0)).choose(request, ["w0", "w1"], now=1.0)
    assert decision.worker_id == "w0" and decision.num_matched_tokens == 12


def test_ties_break_by_the_seed_and_the_placement_feeds_the_directory():
    placement = ClusterPlacement(PlacementConfig(policy="conductor", block_size=BS, store_prices=PRICES,
                                                 prefill_model=PrefillTimeModel(0.0, 0.01, 0.0, 0.0)))
    for worker in WORKERS:
        placement.add_worker(worker, "mixed")
        placement.on_stats(WorkerStats(worker, 0, 0, 1000, block_size=BS), 0.0)
    request = req("a", 1, 2)
    assert placement.on_store_events("w0", [StoreEvent(1, "stored", request.block_hashes, DRAM)])
    assert not placement.on_store_events("w0", [StoreEvent(3, "evicted", request.block_hashes[:1])])  # a gap
    placement.apply_store_snapshot("w0", [StoreEvent(3, "stored", request.block_hashes, DRAM)])
    assert placement.state.store.locations(request.block_hashes[0]) == {"w0": DRAM}
    picks = {ClusterPlacement(PlacementConfig(policy="conductor", block_size=BS, seed=seed)).policy.choose(
        req(f"r{seed}", 5), WORKERS, now=0.0).worker_id for seed in range(12)}
    assert len(picks) > 1  # identical workers: the seed spreads ties


def test_preble_prices_store_loads_in_its_prefill_term():
    state = make_state()
    request = req("a", 1, 2, 3, 4)  # 17 tokens: 0.17 s cold
    for worker in WORKERS:
        heartbeat(state, worker)
    store_holds(state, "w2", request.block_hashes)  # w2's DRAM: 4 ms to load, 0.01 s left to prefill
    decision = create_policy("preble", state, random.Random(0)).choose(request, WORKERS, now=1.0)
    assert decision.reason == "explore" and decision.worker_id == "w2" and decision.num_matched_tokens == 16
    assert decision.costs.store_load_s == pytest.approx(0.004) and decision.costs.prefill_s == pytest.approx(0.01)
    assert state.load.queued_prefill_tokens("w2") == 1
    plain = make_state(prices=None)
    for worker in WORKERS:
        heartbeat(plain, worker)
    decision = create_policy("preble", plain, random.Random(0)).choose(request, WORKERS, now=1.0)
    assert decision.num_matched_tokens == 0 and decision.costs.store_load_s == 0.0


def test_a_busy_mixed_worker_is_priced_by_the_kv_its_steps_read():
    state = make_state()
    state.kv_read_s_per_token, state.step_tokens = 1e-4, 8
    request = req("a", 1, 2, 3, 4)  # 17 tokens, 16 on w0's device and in its node's DRAM
    state.index.on_routed("w0", request.block_hashes)
    store_holds(state, "w0", request.block_hashes)
    state.load.on_stats(WorkerStats("w0", 0, 250, 750, block_size=BS), now=0.0)  # 1,000 KV tokens in use
    heartbeat(state, "w1")
    decision = create_policy("conductor", state, random.Random(0)).choose(request, ["w0", "w1"], now=1.0)
    # w0: 1,000 tokens x 1e-4 s x 1 step = 0.1 s + 0.01 prefill; w1: 0.04 s over the NIC + 0.01 prefill
    assert decision.worker_id == "w1" and decision.costs.store_load_s == pytest.approx(0.04)
    state.kv_read_s_per_token = 0.0  # unpriced: the device match wins
    decision = create_policy("conductor", state, random.Random(0)).choose(req("b", 1, 2, 3, 4), ["w0", "w1"], 1.0)
    assert decision.worker_id == "w0"


def test_live_workers_sharing_their_hosts_store_node_read_it_at_the_host_links_price():
    state = make_state()
    state.store_node = "host-a"  # live: one store node per host, every worker of the host reads it locally
    request = req("a", 1, 2)
    for worker in WORKERS:
        heartbeat(state, worker)
    store_holds(state, "host-a", request.block_hashes)
    decision = create_policy("conductor", state, random.Random(0)).choose(request, WORKERS, now=1.0)
    assert decision.num_matched_tokens == 8 and decision.costs.store_load_s == pytest.approx(0.002)
