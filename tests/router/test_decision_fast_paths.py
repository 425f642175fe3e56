"""Per-decision shortcuts in the router compute exactly what the plain formulas compute.

- `TtftTrend.is_rising` (halves split by bisection, summed in place) against the list-based rule.
- `LoadTracker.on_stats`/`on_assigned` keep the flat cost mirror and the per-group sums equal to the
  tracker's own reads.
- `RouterState.commit` records what `matched_tokens`/`num_blocks_needed`/`predicted_work_s` say.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvbaton.router.base import RouteRequest
from kvbaton.router.load import LoadTracker, WorkerStats
from kvbaton.router.preble import TtftTrend
from kvbaton.router.state import RouterState


def _reference_is_rising(samples: list[tuple[float, float]], now: float, trend: TtftTrend) -> bool:
    kept = [(at, t) for at, t in samples if at >= now - trend.window_s]
    middle = now - trend.window_s / 2
    first = [t for at, t in kept if at < middle]
    second = [t for at, t in kept if at >= middle]
    if len(first) < trend.min_samples or len(second) < trend.min_samples:
        return False
    return sum(second) / len(second) >= trend.rise_ratio * (sum(first) / len(first))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 60), st.sampled_from([1, 2, 3]))
def test_is_rising_matches_the_list_rule(seed: int, num_samples: int, min_samples: int) -> None:
    rng = random.Random(seed)
    trend = TtftTrend(window_s=10.0, rise_ratio=1.5, min_samples=min_samples)
    samples: list[tuple[float, float]] = []
    now = 0.0
    for _ in range(num_samples):
        now += rng.choice([0.0, 0.05, 0.5, 2.0])  # repeated instants too: ties at the split point
        ttft_s = rng.choice([0.1, 0.2, 0.3]) * rng.uniform(0.5, 4.0)
        samples.append((now, ttft_s))
        trend.add(7, "w", now, ttft_s)
        probe = now + rng.choice([0.0, 0.0, 1.0, 5.0])
        if rng.random() < 0.3:
            probe = now + 5.0  # exactly the window's middle lands on a sample
        assert trend.is_rising(7, "w", probe) == _reference_is_rising(samples, probe, trend)
        samples = [(at, t) for at, t in samples if at >= probe - trend.window_s]
        now = probe


def test_is_rising_detects_a_rise_and_an_exact_split() -> None:
    trend = TtftTrend(window_s=10.0, rise_ratio=2.0, min_samples=2)
    for at, ttft_s in [(0.0, 1.0), (1.0, 1.0), (5.0, 2.0), (6.0, 2.0)]:
        trend.add(1, "w", at, ttft_s)
    assert trend.is_rising(1, "w", 10.0)  # middle 5.0: the sample at 5.0 is in the second half
    assert not trend.is_rising(1, "w", 10.5)  # the sample at 0.0 left the window: one in the first half
    assert not trend.is_rising(2, "w", 10.0)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_updates_keep_the_tracker_consistent(seed: int) -> None:
    rng = random.Random(seed)
    tracker = LoadTracker(window_s=5.0, pending_grace_s=rng.choice([0.0, 0.3]))
    workers = ["a", "b", "c", "d"]
    now = 0.0
    for step in range(60):
        now += rng.choice([0.0, 0.1, 0.7])
        worker = rng.choice(workers[:3])  # "d" is never seen: default reads
        if rng.random() < 0.4:
            stats = WorkerStats(worker, rng.randrange(500), rng.randrange(50), rng.randrange(80), block_size=8)
            tracker.on_stats(stats, now)
        else:
            tracker.prune(now)
            tracker.on_assigned(worker, f"r{step}", now, rng.randrange(300), rng.randrange(20), rng.uniform(0.0, 2.0),
                                rng.choice([None, 1, 2]))
        tracker.check_invariants()


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 400), st.integers(0, 64), st.integers(0, 40), st.booleans())
def test_commit_records_the_formulas(num_prompt: int, num_output: int, num_matched: int, pass_prefill: bool) -> None:
    state = RouterState(block_size=16)
    hashes = tuple(range(1000, 1000 + num_prompt // 16))
    request = RouteRequest("r", hashes, num_prompt, num_output)
    num_matched = min(num_matched, len(hashes) + 2)  # may exceed the hashed blocks: matched_tokens clamps
    prefill_s = state.prefill_model.predict(num_prompt - state.matched_tokens(request, num_matched),
                                            state.matched_tokens(request, num_matched))
    state.commit(request, "w", num_matched, 1.0, group=5, prefill_s=prefill_s if pass_prefill else None)
    assert state.load.window_load_s("w") == state.predicted_work_s(request, num_matched)
    assert state.load.load_tokens("w") == num_prompt - state.matched_tokens(request, num_matched)
    assert state.load.free_blocks("w") is None
    state.load.on_stats(WorkerStats("w", 0, 0, 1000), 0.5)  # before the decision: it stays pending
    assert state.load.free_blocks("w") == 1000 - state.num_blocks_needed(request, num_matched)
    assert state.load.group_loads_s("w") == {5: state.predicted_work_s(request, num_matched)}
    assert state.load.assignment("r") == ("w", 5)
    if hashes:
        assert state.index.match(hashes) == {"w": len(hashes)}
    state.load.check_invariants()
