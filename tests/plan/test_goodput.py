"""Goodput search: grid bisection (pure), and simulated probes that stop once the target is out of reach."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbaton.bench.metrics import SLO
from kvbaton.plan.goodput import (STOPPED_REASON, SearchSettings, distserve_bisection, largest_passing, probe, scaled,
                                  search_goodput)
from kvbaton.plan.planner import PlanRequest, plan_requests
from kvbaton.sim.run import SimSetup


@settings(max_examples=300, deadline=None)
@given(threshold=st.integers(0, 200), floor=st.integers(0, 220), ceiling=st.integers(1, 40),
       extra=st.integers(0, 160))
def test_largest_passing_finds_the_threshold_whatever_the_floor(threshold: int, floor: int, ceiling: int,
                                                                extra: int) -> None:
    limit = ceiling + extra
    calls: list[int] = []

    def met(k: int) -> bool:
        assert 1 <= k <= limit, "probes stay on the grid"
        calls.append(k)
        return k <= threshold

    k, pruned, capped = largest_passing(met, floor, ceiling, limit)
    truth = min(threshold, limit)
    if min(floor, limit) > truth:
        assert (k, pruned, capped) == (0, True, False)
        assert len(calls) == 1  # pruned after a single probe at the floor
    else:
        assert (k, pruned, capped) == (truth, False, truth == limit)
    assert len(calls) <= 3 + 2 * limit.bit_length()


def test_largest_passing_gives_up_once_another_search_passed_above_its_failures() -> None:
    calls: list[int] = []

    def met(k: int) -> bool:
        calls.append(k)
        return k <= 7

    floors = iter([0, 12, 12, 12])
    # ceiling 20 fails; the first bisection probe (10) fails; then another search has passed 12 >= 10.
    assert largest_passing(met, 0, 20, floor_now=lambda: next(floors)) == (0, True, False)
    assert calls == [20, 10]
    assert largest_passing(met, 0, 20, floor_now=lambda: 7) == (7, False, False)  # a tie is not pruned
    calls.clear()
    assert largest_passing(lambda k: calls.append(k) or k <= 45, 0, 5, 80) == (45, False, False)
    assert calls[:5] == [5, 10, 20, 40, 80]  # the bracket top doubles while it passes


def test_largest_passing_examples() -> None:
    assert largest_passing(lambda k: k <= 7, 0, 20) == (7, False, False)
    assert largest_passing(lambda k: k <= 7, 5, 20) == (7, False, False)
    assert largest_passing(lambda k: k <= 7, 9, 20) == (0, True, False)
    assert largest_passing(lambda k: True, 0, 20) == (20, False, True)
    assert largest_passing(lambda k: True, 0, 5, 20) == (20, False, True)
    assert largest_passing(lambda k: k <= 30, 25, 5, 80) == (30, False, False)
    assert largest_passing(lambda k: False, 0, 20) == (0, False, False)


def test_distserve_bisection_reports_the_last_passing_midpoint() -> None:
    # DistServe's README case: the true threshold anywhere in [1.5625, 1.71875) prints as 1.56.
    probed: list[float] = []

    def met(rate: float) -> bool:
        probed.append(rate)
        return rate <= 1.6

    assert distserve_bisection(met) == 1.5625
    assert probed == [2.5, 1.25, 1.875, 1.5625, 1.71875]
    assert distserve_bisection(lambda r: r <= 2.4) == 2.34375
    assert distserve_bisection(lambda r: False) == 0.0
    assert distserve_bisection(lambda r: True) == 4.84375  # never reaches the top: hi - lo < esp first


def _requests(n: int = 60) -> list:
    request = PlanRequest("opt-13b", "a100", 1, SearchSettings(SLO(0.2, 0.1)), num_requests=n, cost_model="distserve")
    return plan_requests(request, 2048)


SETUP = SimSetup(model="opt-13b", gpu="a100", cluster="1xmixed:tp=1,pp=1", cost_model="distserve",
                 max_model_len=2048, enable_prefix_cache=False, heartbeat_s=1.0, max_num_batched_tokens=512)


def test_plan_requests_fit_the_context_and_arrive_at_rate_one() -> None:
    requests = _requests(200)
    assert len(requests) == 200
    assert [r.index for r in requests] == list(range(200))
    assert all(r.num_prompt_tokens + r.output_tokens <= 2048 for r in requests)
    assert 150 < requests[-1].arrival_s < 260  # Poisson at 1 req/s
    doubled = scaled(requests, 2.0)
    assert doubled[10].arrival_s == pytest.approx(requests[10].arrival_s / 2)


def test_probe_passes_when_light_and_stops_early_when_overloaded() -> None:
    requests = _requests()
    target = SearchSettings(SLO(0.2, 0.1), attainment=0.9)
    light = probe(requests, SETUP, 1, 0.2, target)
    assert light.met and not light.stopped_early
    assert light.ttft_attainment >= 0.9 and light.tpot_attainment >= 0.9
    heavy = probe(requests, SETUP, 1, 50.0, target)
    assert not heavy.met and heavy.stopped_early
    assert min(heavy.ttft_attainment, heavy.tpot_attainment) < 0.9
    assert STOPPED_REASON.startswith("planner probe stopped")


def test_search_goodput_is_the_same_from_any_floor_that_passes() -> None:
    requests = _requests()
    target = SearchSettings(SLO(0.2, 0.1), attainment=0.9, step_rps=1.0, max_per_gpu_rps=48.0, ceiling_rps=8.0)
    from_zero = search_goodput(requests, SETUP, 1, target)
    assert 0 < from_zero.per_gpu_rps < 48.0 and not from_zero.pruned and not from_zero.capped
    passing = [p for p in from_zero.probes if p.met]
    assert max(p.per_gpu_rps for p in passing) == from_zero.per_gpu_rps
    from_floor = search_goodput(requests, SETUP, 1, target, floor_rps=from_zero.per_gpu_rps - 3.0)
    assert from_floor.per_gpu_rps == from_zero.per_gpu_rps
    above = search_goodput(requests, SETUP, 1, target, floor_rps=from_zero.per_gpu_rps + 1.0)
    assert above.pruned and above.per_gpu_rps == 0.0
    assert [p.per_gpu_rps for p in above.probes] == [p.per_gpu_rps for p in from_zero.probes][:len(above.probes)]


def test_floors_prune_but_never_move_the_probes_of_a_non_monotone_search() -> None:
    # Passes at 1..9 and at the island 12, fails elsewhere. A floor that moved the bisection (started it at
    # the floor) would probe other midpoints and could land on 9 instead.
    def run(floor: int) -> tuple[tuple[int, bool, bool], list[int]]:
        probed: list[int] = []

        def met(k: int) -> bool:
            probed.append(k)
            return k <= 9 or k == 12

        return largest_passing(met, 0, 16, floor_now=lambda: floor), probed

    (answer, pruned, _), probed = run(0)
    assert (answer, pruned) == (12, False) and probed == [16, 8, 12, 14, 13]  # the largest rate it passed
    for floor in (3, 8, 11, 13):  # any floor under the answer: the same probes, the same answer
        assert run(floor) == run(0)
    assert run(14)[0] == (0, True, False)  # a floor over it: given up, as it cannot win
