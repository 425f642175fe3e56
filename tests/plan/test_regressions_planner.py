"""Regressions of the goodput planner."""

from __future__ import annotations

import pytest

from kvbaton.bench.metrics import SLO
from kvbaton.plan.goodput import SearchSettings
from kvbaton.plan.planner import PlanRequest, plan_requests


@pytest.mark.parametrize("workload", ["mooncake", "hot-prefix-burst"])
def test_plan_requests_arrive_at_rate_one_for_self_timed_workloads(workload: str) -> None:
    # Bug: plan_requests calls create_workload(..., rate=1.0) without an arrival process; mooncake and
    # hot-prefix-burst time themselves, so create_workload picks arrival "trace" and ignores the rate. The probes
    # then rescale trace times as if they were a rate-1 process: mooncake's kept requests run at ~0.54x and
    # hot-prefix-burst's at ~0.12x the probed rate, so their per-GPU goodput is overstated ~2x and ~8x.
    request = PlanRequest("llama-3-8b", "h100", 2, SearchSettings(SLO(1.0, 0.05)), workload=workload,
                          num_requests=300)
    requests = plan_requests(request, 8192)
    span_s = requests[-1].arrival_s - requests[0].arrival_s
    mean_rate = (len(requests) - 1) / span_s
    assert 0.7 < mean_rate < 1.4, f"{workload}: mean rate {mean_rate:.3f}, not ~1 req/s"
