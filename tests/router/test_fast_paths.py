"""The router's hot-path shortcuts decide exactly what the plain formulas decide.

- `PrebleE2Policy._least_cost` (one pass over dict reads, inlined eviction-price cache) against the
  per-worker reference formula, in lockstep on random clusters: same worker, costs, reasons.
- `LoadTracker`'s flat per-worker mirror (`cost_lookup`) stays equal to `window_load_s`/`free_blocks`.
- `GlobalPrefixIndex._insert` finds an orphan root inside a new run (it probes KV-event roots only).
- `on_routed` right after `match` of the same tuple resumes match's walk: same index as a fresh walk.
- The lazily built block map answers lookups by block hash exactly and drops its stale entries.
- `LoadTracker.move_group` reads the group's own entries, oldest first, and keeps window order.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from kvbaton.cache.events import KVEvent, KVEventKind
from kvbaton.cache.hashing import CacheKey, hash_block_tokens
from kvbaton.router.base import CostTerms, RouteRequest, WorkerId
from kvbaton.router.load import LoadTracker, WorkerStats
from kvbaton.router.preble import PrebleConfig, PrebleE2Policy
from kvbaton.router.prefill_model import PrefillTimeModel
from kvbaton.router.prefix_index import GlobalPrefixIndex
from kvbaton.router.state import RouterState

KEY = CacheKey("m", "l")
BS = 4


class ReferencePreble(PrebleE2Policy):
    """Preble with the original scalar cost loop: per-worker `cost_inputs` and `_eviction_s_per_block` calls."""

    def _least_cost(
        self, request: RouteRequest, candidates: Sequence[WorkerId], matched: dict[WorkerId, int]
    ) -> tuple[WorkerId, CostTerms]:
        state = self.state
        predict = state.prefill_model.predict
        num_prompt = request.num_prompt_tokens
        total_blocks = state.num_blocks_needed(request, 0)
        low = high = math.inf
        tied: list[WorkerId] = []
        for worker, (load_s, free) in zip(candidates, state.load.cost_inputs(candidates)):
            num_blocks = matched.get(worker, 0)
            cached = min(num_blocks * state.block_size, num_prompt)
            total = load_s + predict(num_prompt - cached, cached)
            if free is not None and total_blocks - num_blocks > free:
                total += (total_blocks - num_blocks - free) * self._eviction_s_per_block(worker)
            if total < low:
                tolerance = 1e-9 * (total if total > 1.0 else 1.0)
                low, high, tied = total - tolerance, total + tolerance, [worker]
            elif total <= high:
                tied.append(worker)
        worker = self._break_tie(tied)
        load_s, free = state.load.cost_inputs([worker])[0]
        num_blocks = matched.get(worker, 0)
        cached = min(num_blocks * state.block_size, num_prompt)
        deficit = 0 if free is None else total_blocks - num_blocks - free
        eviction_s = deficit * self._eviction_s_per_block(worker) if deficit > 0 else 0.0
        return worker, CostTerms(load_s, eviction_s, predict(num_prompt - cached, cached))

    def _longest_live(self, matched: dict[WorkerId, int], workers: Sequence[WorkerId]) -> int:
        return max((matched.get(w, 0) for w in workers), default=0)


def _state(max_blocks: int) -> RouterState:
    return RouterState(block_size=BS, index=GlobalPrefixIndex(max_blocks=max_blocks), load=LoadTracker(window_s=5.0),
                       prefill_model=PrefillTimeModel(0.002, 0.001, 0.0, 1e-6), decode_s_per_token=0.001)


def _request(rng: random.Random, i: int, num_systems: int) -> RouteRequest:
    system = [1000 + rng.randrange(num_systems)] * (BS * rng.randrange(1, 6))
    tail = [rng.randrange(50) for _ in range(rng.randrange(0, 4 * BS))]
    return RouteRequest.from_tokens(f"r{i}", system + tail, KEY, BS, num_output_tokens=rng.randrange(1, 12))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 9), st.integers(8, 200), st.integers(1, 4))
def test_preble_fast_cost_loop_decides_like_the_reference(seed: int, num_workers: int, max_blocks: int,
                                                           refresh: int) -> None:
    config = PrebleConfig(warmup_decisions=4, rebalance_every=3, eviction_refresh_mutations=refresh,
                          max_sampled_victims=8)
    fast_state, ref_state = _state(max_blocks), _state(max_blocks)
    fast = PrebleE2Policy(fast_state, random.Random(seed), config)
    ref = ReferencePreble(ref_state, random.Random(seed), config)
    rng = random.Random(seed)
    workers = [f"w{i}" for i in range(num_workers)]
    now = 0.0
    for i in range(60):
        live = [w for w in workers if rng.random() < 0.9] or workers[:1]
        if rng.random() < 0.3:  # a heartbeat; some workers never send one (free blocks unknown), ties are common
            worker = rng.choice(workers[1:] or workers)
            stats = WorkerStats(worker, rng.randrange(64), rng.randrange(16), rng.randrange(-4, 24))
            fast_state.load.on_stats(stats, now)
            ref_state.load.on_stats(stats, now)
        request = _request(rng, i, 4)
        assert fast.choose(request, live, now) == ref.choose(request, live, now)
        if rng.random() < 0.3:
            ttft_s = rng.random()
            fast.on_first_token(request.request_id, ttft_s, now)
            ref.on_first_token(request.request_id, ttft_s, now)
        now += rng.choice((0.01, 0.2, 1.0))
    assert fast.num_moved_groups == ref.num_moved_groups and fast.num_replications == ref.num_replications
    fast_state.index.check_invariants()
    fast_state.load.check_invariants()


load_ops = st.lists(st.tuples(st.sampled_from(("stats", "assign", "prune", "move", "remove")),
                              st.sampled_from(("w0", "w1", "w2")), st.integers(0, 40), st.integers(0, 3)),
                    max_size=40)


@settings(max_examples=100, deadline=None)
@given(load_ops)
def test_load_tracker_mirrors_match_its_reads(operations: list[tuple[str, str, int, int]]) -> None:
    load = LoadTracker(window_s=3.0)
    now = 0.0
    for i, (kind, worker, amount, group) in enumerate(operations):
        now += 0.5
        if kind == "stats":
            load.on_stats(WorkerStats(worker, amount, amount // 2, 40 - amount), now)
        elif kind == "assign":
            load.on_assigned(worker, f"r{i}", now, amount, amount // 4, amount * 0.01, group or None)
        elif kind == "prune":
            load.prune(now)
        elif kind == "move":
            load.move_group(group, worker, "w0", fraction=0.5)
        else:
            load.remove_worker(worker)
        load.check_invariants()
        cost_lookup = load.cost_lookup()
        for w in ("w0", "w1", "w2", "unknown"):
            assert cost_lookup(w, (0.0, None)) == (load.window_load_s(w), load.free_blocks(w))


def test_routing_a_new_run_stops_at_an_orphan_root_inside_it_and_adopts_it() -> None:
    index = GlobalPrefixIndex()
    a = hash_block_tokens(KEY, [t for b in (1, 2, 3, 4, 5, 6) for t in [b] * BS], BS)
    stored = KVEvent(1, KVEventKind.STORED, tuple(a[3:5]), a[2], BS)  # parent a[2] unknown: a root
    assert index.on_kv_events("w1", [stored])
    index.on_routed("w0", a)
    assert index.match(a) == {"w0": 6, "w1": 5}
    assert index.holders(a[0]) == {"w0", "w1"}  # w1 holds the adopted root's ancestors too
    index.check_invariants()


def _index_view(index: GlobalPrefixIndex, paths: list[list[int]], workers: list[str]) -> object:
    """Everything observable about an index along the given paths: matches, holders, reuse, recency, size."""
    return (
        [index.match(p) for p in paths],
        [(index.holders(h), index.num_routed(h)) for p in paths for h in p],
        [(index.coldest(w, 1000), index.num_worker_blocks(w)) for w in workers],
        index.num_blocks,
        index.num_evicted_blocks,
    )


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(("w0", "w1", "w2")), st.lists(st.integers(0, 3), min_size=1, max_size=6),
                          st.booleans()), max_size=30),
       st.integers(3, 30))
def test_routing_after_match_resumes_its_walk_and_ends_where_a_fresh_walk_does(
    routes: list[tuple[str, list[int], bool]], max_blocks: int
) -> None:
    """`on_routed(t)` right after `match(t)` (tuple t) starts from match's walk; the result must not differ."""
    resumed, fresh = GlobalPrefixIndex(max_blocks=max_blocks), GlobalPrefixIndex(max_blocks=max_blocks)
    paths = []
    for i, (worker, blocks, stale) in enumerate(routes):
        hashes = tuple(hash_block_tokens(KEY, [t for b in blocks for t in [b] * BS], BS))
        paths.append(list(hashes))
        assert resumed.match(hashes) == fresh.match(list(hashes))
        if stale:  # the index changes between match and on_routed: the walk must not be reused
            other = tuple(hash_block_tokens(KEY, [9 + i % 3] * BS, BS))
            resumed.on_routed("w9", other)
            fresh.on_routed("w9", list(other))
        resumed.on_routed(worker, hashes)
        fresh.on_routed(worker, list(hashes))
        resumed.check_invariants()
    fresh.check_invariants()
    workers = ["w0", "w1", "w2", "w9"]
    assert _index_view(resumed, paths, workers) == _index_view(fresh, paths, workers)


def test_block_lookups_find_blocks_routing_added_split_and_evicted() -> None:
    """Routing queues segments instead of mapping blocks; every lookup by block hash must still be exact."""
    index = GlobalPrefixIndex(max_blocks=8)
    a = hash_block_tokens(KEY, [t for b in (1, 2, 3, 4, 5) for t in [b] * BS], BS)
    index.on_routed("w0", a)  # one segment of 5 blocks, queued, not mapped
    assert index.holders(a[3]) == {"w0"}
    index.on_routed("w1", a[:2])  # split after block 2: the tail's blocks move to a new segment
    assert index.holders(a[1]) == {"w0", "w1"} and index.holders(a[3]) == {"w0"}
    # A KV event names a block inside the routed run as its parent: found through the lazy map.
    b = hash_block_tokens(KEY, [t for b in (1, 2, 3, 7) for t in [b] * BS], BS)
    assert index.on_kv_events("w2", [KVEvent(1, KVEventKind.STORED, (b[3],), b[2], BS)])
    assert index.match(b) == {"w0": 3, "w1": 2, "w2": 4}
    assert index.on_kv_events("w0", [KVEvent(1, KVEventKind.EVICTED, (a[4], a[3]), None, BS)])
    assert index.holders(a[4]) == frozenset() and index.match(a) == {"w0": 3, "w1": 2, "w2": 3}
    index.on_routed("w1", hash_block_tokens(KEY, [t for b in (6, 6, 6, 6, 6) for t in [b] * BS], BS))  # evicts
    assert index.num_blocks <= 8
    index.check_invariants()


def test_block_map_drops_stale_entries_once_they_dominate() -> None:
    index = GlobalPrefixIndex(max_blocks=64)
    rng = random.Random(0)
    for i in range(600):  # 9,600 blocks pass through a 64-block index: without compaction the map would keep them
        hashes = hash_block_tokens(KEY, [rng.randrange(1000) for _ in range(16 * BS)], BS)
        index.on_routed(f"w{i % 3}", hashes)
        assert index.holders(hashes[1]) == {f"w{i % 3}"}  # inside a segment: the per-block map, evicted blocks stay
    index.check_invariants()
    assert len(index._blocks._full._mapped) <= 2 * index.num_blocks + 4096


def test_block_lookups_at_a_segments_ends_need_no_per_block_map() -> None:
    """Stored runs' parents and evicted blocks are where segments end, and a run stored with no indexed parent has its
    first block looked up (is it indexed elsewhere?) by membership: none of these builds the per-block map; a block
    inside a segment does."""
    index = GlobalPrefixIndex()
    a = hash_block_tokens(KEY, [t for b in range(8) for t in [b] * BS], BS)
    index.on_routed("w0", a)
    assert index.on_kv_events("w0", [KVEvent(1, KVEventKind.STORED, tuple(a[:3]), None, BS),
                                      KVEvent(2, KVEventKind.STORED, tuple(a[3:6]), a[2], BS),
                                      KVEvent(3, KVEventKind.STORED, (a[7] + 1,), a[5], BS),  # a block routing missed
                                      KVEvent(4, KVEventKind.EVICTED, (a[7] + 1, a[5], a[4]), None, BS)])
    # w0 holds [a0 a1 a2] [a3] now: the evictions took a5 and what is below it, then a4
    assert index.holders(a[0]) == {"w0"} and index.holders(a[3]) == {"w0"}
    assert index.holders(a[5]) == frozenset() and index.holders(a[7]) == frozenset()
    assert index.match(a) == {"w0": 4} and index.holders(12345) == frozenset()
    assert index._blocks._full is None
    index.check_invariants()
    assert index.holders(a[1]) == {"w0"} and index._blocks._full is not None  # inside [a0..a3]: the map, kept
    index.on_routed("w1", a[:2])
    index.check_invariants()
    assert index.holders(a[1]) == {"w0", "w1"} and index.num_routed(a[0]) == 2


def test_moving_a_group_moves_its_oldest_entries_and_keeps_window_order() -> None:
    load = LoadTracker(window_s=10.0)
    for i, (worker, group, work_s) in enumerate([("a", 1, 1.0), ("b", 1, 2.0), ("a", 2, 4.0), ("a", 1, 8.0),
                                                 ("b", 1, 16.0), ("a", 1, 32.0)]):
        load.on_assigned(worker, f"r{i}", float(i), 0, 0, work_s, group)
    assert load.move_group(1, "a", "b", fraction=0.2) == 9.0  # 1 + 8 reach 20% of 41, oldest first
    assert load.group_loads_s("a") == {1: 32.0, 2: 4.0} and load.group_loads_s("b") == {1: 27.0}
    load.check_invariants()  # b's entries of group 1 are in window order: 1, 2, 8, 16
    load.prune(11.5)  # drops the entries assigned at 0 and 1
    assert load.group_loads_s("b") == {1: 24.0} and load.window_load_s("a") == 36.0
    assert load.move_group(1, "b", "a") == 24.0 and load.group_loads_s("b") == {}
    load.check_invariants()
