"""Time one routing decision (match + cost + commit) with 64 workers and 100,000 indexed blocks.

Prints one JSON line: p50/p99 microseconds per `choose` call (index walk, costs, tie-break and the
commit to index and load tracker) for `preble` and `round_robin`. The index is full, so every
commit also evicts. Prompt hashing happens beforehand (the router hashes each prompt once, outside
the decision). Half the requests continue an indexed conversation (exploit), half share only its
system prompt (explore over all workers). `calibration_dict_get_64_us` times a trivial 64-step
loop so figures from different (or busy) machines can be compared.
The index maps block hash -> segment lazily (only KV events and `holders` need it), so routing
leaves that per-block work to the next lookup; a live router pays it when the workers' KV events
arrive. `p50/mean_deferred_block_map_us` time it after each decision, outside the decision figures.
Usage: python benchmarks/router_decision.py [--workers 64 --index-blocks 100000 --decisions 3000]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from kvbaton.cache.hashing import CacheKey, hash_block_tokens
from kvbaton.router.base import RouteRequest
from kvbaton.router.load import LoadTracker, WorkerStats
from kvbaton.router.policies import create_policy
from kvbaton.router.prefix_index import GlobalPrefixIndex
from kvbaton.router.state import RouterState

BLOCK_SIZE = 16


def _tokens(rng: random.Random, num_blocks: int) -> list[int]:
    return [rng.randrange(50_000) for _ in range(num_blocks * BLOCK_SIZE)]


def build_state(num_workers: int, num_index_blocks: int, seed: int) -> tuple[RouterState, list[str], list[list[int]]]:
    """An index of shared system prompts (32 blocks) each with continuations (32 blocks), spread over workers."""
    rng = random.Random(seed)
    key = CacheKey("bench", "paged-16")
    state = RouterState(block_size=BLOCK_SIZE, index=GlobalPrefixIndex(max_blocks=num_index_blocks), load=LoadTracker())
    workers = [f"w{i:02d}" for i in range(num_workers)]
    conversations: list[list[int]] = []
    num_systems = max(1, num_index_blocks // (32 * 16))
    while state.index.num_blocks < num_index_blocks:
        system = _tokens(rng, 32)
        for _ in range(15):
            prompt = system + _tokens(rng, 32)
            conversations.append(prompt)
            hashes = hash_block_tokens(key, prompt, BLOCK_SIZE)
            for worker in rng.sample(workers, 2):
                state.index.on_routed(worker, hashes)
        num_systems -= 1
    for worker in workers:
        state.load.on_stats(WorkerStats(worker, rng.randrange(4096), rng.randrange(2048), rng.randrange(4096)), 0.0)
    return state, workers, conversations


def bench(policy_name: str, num_workers: int, num_index_blocks: int, num_decisions: int, seed: int) -> dict[str, float]:
    state, workers, conversations = build_state(num_workers, num_index_blocks, seed)
    rng = random.Random(seed + 1)
    key = CacheKey("bench", "paged-16")
    requests: list[RouteRequest] = []
    for i in range(num_decisions):
        base = rng.choice(conversations)
        # Half continue a known conversation (exploit), half share only its system prompt (explore).
        prompt = base + _tokens(rng, 8) if i % 2 == 0 else base[: 32 * BLOCK_SIZE] + _tokens(rng, 48)
        requests.append(RouteRequest.from_tokens(f"r{i}", prompt, key, BLOCK_SIZE, num_output_tokens=64))
    timed = _TimedCommitState(state.block_size, state.index, state.load, state.prefill_model, state.decode_s_per_token)
    policy = create_policy(policy_name, timed, random.Random(seed))
    samples_us: list[float] = []
    commit_us: list[float] = []
    deferred_us: list[float] = []
    now = 1.0
    for request in requests:
        start = time.perf_counter_ns()
        policy.choose(request, workers, now)
        samples_us.append((time.perf_counter_ns() - start) / 1000.0)
        commit_us.append(timed.last_commit_ns / 1000.0)
        start = time.perf_counter_ns()
        state.index.holders(request.block_hashes[-1])  # a lookup by block hash maps what routing queued
        deferred_us.append((time.perf_counter_ns() - start) / 1000.0)
        now += 0.01
    skip = len(samples_us) // 10  # warm-up
    decide_us = sorted(total - commit for total, commit in zip(samples_us[skip:], commit_us[skip:]))
    samples_us = sorted(samples_us[skip:])
    return {
        "p50_us": round(statistics.median(samples_us), 2),
        "p99_us": round(samples_us[int(0.99 * (len(samples_us) - 1))], 2),
        "p50_commit_us": round(statistics.median(commit_us[skip:]), 2),
        "p50_without_commit_us": round(statistics.median(decide_us), 2),
        "p50_deferred_block_map_us": round(statistics.median(deferred_us[skip:]), 2),
        "mean_deferred_block_map_us": round(statistics.mean(deferred_us[skip:]), 2),
        "index_blocks": state.index.num_blocks,
    }


class _TimedCommitState(RouterState):
    """RouterState that records how long its last commit (index + load update) took."""

    last_commit_ns = 0

    def commit(
        self,
        request: RouteRequest,
        worker: str,
        num_matched_blocks: int,
        now: float,
        group: int | None = None,
        prefill_s: float | None = None,
    ) -> None:
        start = time.perf_counter_ns()
        RouterState.commit(self, request, worker, num_matched_blocks, now, group, prefill_s)
        self.last_commit_ns = time.perf_counter_ns() - start


def calibration_us() -> float:
    """Median time of a 64-step dict-lookup loop: relates this machine's Python speed to another's."""
    table = {i: i for i in range(64)}
    keys = list(range(64))
    samples = []
    for _ in range(2000):
        start = time.perf_counter_ns()
        for key in keys:
            table.get(key, 0)
        samples.append((time.perf_counter_ns() - start) / 1000.0)
    return round(statistics.median(samples), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--index-blocks", type=int, default=100_000)
    parser.add_argument("--decisions", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    result: dict[str, object] = {
        "num_workers": args.workers,
        "num_index_blocks": args.index_blocks,
        "calibration_dict_get_64_us": calibration_us(),
    }
    for name in ("preble", "round_robin"):
        result[name] = bench(name, args.workers, args.index_blocks, args.decisions, args.seed)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
