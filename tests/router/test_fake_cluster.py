"""Routing quality in a deterministic fake cluster: Zipf-1.1 prefix popularity over 8 workers.

Each fake worker is a FIFO server with an LRU block cache (leaf-first eviction, like a radix
cache) that publishes real KV events and heartbeats to the router; service time comes from the
same prefill-time model the router uses plus a fixed decode cost. Per policy we measure the
cache-hit ratio (cached / prompt tokens, from the workers' own caches) and the busiest worker's
busy time over the mean. Target (issue): preble keeps >= 0.95x longest_prefix's hit ratio while its
busiest worker stays <= 1.15x the mean; longest_prefix shows the hotspot. The run lasts ~215
simulated seconds, so the load and TTFT windows are scaled down from Preble's 180 s. About 5 s of
CPU (4 policies x 6000 requests); run with -s to see the figures.
"""

from __future__ import annotations

import heapq
import random
from collections import OrderedDict
from dataclasses import dataclass

from kvbaton.cache.events import KVEvent, KVEventKind
from kvbaton.cache.hashing import CacheKey, hash_block_tokens
from kvbaton.router.base import RouteRequest
from kvbaton.router.load import LoadTracker, WorkerStats
from kvbaton.router.policies import create_policy
from kvbaton.router.preble import PrebleConfig
from kvbaton.router.prefill_model import PrefillTimeModel
from kvbaton.router.prefix_index import GlobalPrefixIndex
from kvbaton.router.state import RouterState

BLOCK_SIZE = 16
NUM_WORKERS = 8
NUM_PREFIXES = 64
PREFIX_BLOCKS = 32  # 512 shared tokens
SUFFIX_BLOCKS = 4  # 64 unique tokens: a hit covers far more than it misses (exploit)
OUTPUT_TOKENS = 16
DECODE_S_PER_TOKEN = 0.01
CACHE_BLOCKS = 512  # per worker
ARRIVAL_RATE = 28.0  # requests/s, ~65% of the cluster when prefixes hit
NUM_REQUESTS = 6000
HEARTBEAT_S = 0.1
WINDOW_S = 30.0  # load window; Preble uses 180 s, this run lasts ~215 s
TTFT_WINDOW_S = 10.0  # hot-prefix TTFT trend window, scaled like the load window
KEY = CacheKey("fake-model", "paged-16")
MODEL = PrefillTimeModel()


@dataclass(frozen=True, slots=True)
class Served:
    ttft_s: float
    first_token_at: float
    finished_at: float
    num_cached_tokens: int


class FakeWorker:
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.cache: OrderedDict[int, int | None] = OrderedDict()  # hash -> parent hash, least recent first
        self.free_at = 0.0
        self.busy_s = 0.0
        self.seq = 0
        self.in_flight: list[tuple[float, float, int]] = []  # (prefill done at, finished at, prefill tokens)

    def serve(self, request: RouteRequest, arrival_at: float) -> tuple[Served, list[KVEvent]]:
        hashes = request.block_hashes
        num_cached = 0
        while num_cached < len(hashes) and hashes[num_cached] in self.cache:
            num_cached += 1
        cached_tokens = num_cached * BLOCK_SIZE
        prefill_s = MODEL.predict(request.num_prompt_tokens - cached_tokens, cached_tokens)
        start = max(arrival_at, self.free_at)
        first_token_at = start + prefill_s
        self.free_at = first_token_at + request.num_output_tokens * DECODE_S_PER_TOKEN
        self.busy_s += self.free_at - start
        self.in_flight.append((first_token_at, self.free_at, request.num_prompt_tokens - cached_tokens))
        events: list[KVEvent] = []
        if num_cached < len(hashes):
            parent = hashes[num_cached - 1] if num_cached else KEY.root_hash
            for i in range(num_cached, len(hashes)):
                self.cache[hashes[i]] = hashes[i - 1] if i else None
            self.seq += 1
            events.append(KVEvent(self.seq, KVEventKind.STORED, tuple(hashes[num_cached:]), parent, BLOCK_SIZE))
        for block_hash in reversed(hashes):  # leaf first: ancestors stay more recent, leaves go first
            self.cache.move_to_end(block_hash)
        evicted: list[int] = []
        while len(self.cache) > CACHE_BLOCKS:
            evicted.append(self.cache.popitem(last=False)[0])
        if evicted:
            self.seq += 1
            events.append(KVEvent(self.seq, KVEventKind.EVICTED, tuple(evicted), None, BLOCK_SIZE))
        return Served(first_token_at - arrival_at, first_token_at, self.free_at, cached_tokens), events

    def stats(self, now: float) -> WorkerStats:
        self.in_flight = [f for f in self.in_flight if f[1] > now]
        queued = sum(tokens for prefill_done, _, tokens in self.in_flight if prefill_done > now)
        used = len(self.in_flight) * (PREFIX_BLOCKS + SUFFIX_BLOCKS + 1)
        return WorkerStats(self.worker_id, queued, used, CACHE_BLOCKS - len(self.cache), block_size=BLOCK_SIZE)


def zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (rank**s) for rank in range(1, n + 1)]


def make_workload(seed: int) -> list[tuple[float, RouteRequest]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(30_000) for _ in range(PREFIX_BLOCKS * BLOCK_SIZE)] for _ in range(NUM_PREFIXES)]
    weights = zipf_weights(NUM_PREFIXES, 1.1)
    now = 0.0
    workload = []
    for i in range(NUM_REQUESTS):
        now += rng.expovariate(ARRIVAL_RATE)
        prefix = rng.choices(prefixes, weights)[0]
        tokens = prefix + [rng.randrange(30_000) for _ in range(SUFFIX_BLOCKS * BLOCK_SIZE)]
        hashes = tuple(hash_block_tokens(KEY, tokens, BLOCK_SIZE))
        workload.append((now, RouteRequest(f"r{i}", hashes, len(tokens), OUTPUT_TOKENS)))
    return workload


def simulate(policy_name: str, workload: list[tuple[float, RouteRequest]], seed: int) -> dict[str, float]:
    state = RouterState(
        block_size=BLOCK_SIZE,
        index=GlobalPrefixIndex(max_blocks=100_000),
        load=LoadTracker(window_s=WINDOW_S),
        prefill_model=MODEL,
        decode_s_per_token=DECODE_S_PER_TOKEN,
    )
    config = PrebleConfig(ttft_window_s=TTFT_WINDOW_S)
    policy = create_policy(policy_name, state, random.Random(seed), config if policy_name == "preble" else None)
    workers = {f"w{i}": FakeWorker(f"w{i}") for i in range(NUM_WORKERS)}
    worker_ids = sorted(workers)
    feedback: list[tuple[float, int, str, str, float]] = []  # (at, seq, kind, request id, ttft)
    cached_tokens = prompt_tokens = 0
    next_heartbeat_at = 0.0
    for seq, (arrival_at, request) in enumerate(workload):
        while feedback and feedback[0][0] <= arrival_at:
            at, _, kind, request_id, ttft_s = heapq.heappop(feedback)
            if kind == "first":
                policy.on_first_token(request_id, ttft_s, at)
            else:
                policy.on_finished(request_id, at)
        if arrival_at >= next_heartbeat_at:  # periodic, like real workers; pending load covers the gaps
            for worker in workers.values():
                state.load.on_stats(worker.stats(arrival_at), arrival_at)
            next_heartbeat_at = arrival_at + HEARTBEAT_S
        decision = policy.choose(request, worker_ids, arrival_at)
        served, events = workers[decision.worker_id].serve(request, arrival_at)
        assert state.index.on_kv_events(decision.worker_id, events)
        heapq.heappush(feedback, (served.first_token_at, 2 * seq, "first", request.request_id, served.ttft_s))
        heapq.heappush(feedback, (served.finished_at, 2 * seq + 1, "done", request.request_id, 0.0))
        cached_tokens += served.num_cached_tokens
        prompt_tokens += request.num_prompt_tokens
    state.index.check_invariants()
    busy = [w.busy_s for w in workers.values()]
    return {"hit_ratio": cached_tokens / prompt_tokens, "max_over_mean_load": max(busy) / (sum(busy) / len(busy))}


def test_preble_balances_load_while_keeping_the_hit_ratio() -> None:
    workload = make_workload(seed=11)
    results = {name: simulate(name, workload, seed=5) for name in ("round_robin", "least_load", "longest_prefix", "preble")}
    for name, figures in results.items():
        print(f"{name:15s} hit_ratio={figures['hit_ratio']:.3f} busiest/mean={figures['max_over_mean_load']:.3f}")
    preble, locality = results["preble"], results["longest_prefix"]
    assert locality["max_over_mean_load"] > 1.3  # the hotspot locality-only routing creates
    assert preble["hit_ratio"] >= 0.95 * locality["hit_ratio"]
    assert preble["max_over_mean_load"] <= 1.15
