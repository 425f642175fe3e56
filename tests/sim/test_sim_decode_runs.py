"""Runs of quiet decode steps applied at once (`SimConfig.decode_runs`, kvbaton.sim.worker) give every record and
worker figure the step-by-step simulation gives, on workloads that stop, evict, preempt, draw step noise and copy
their prompts into their outputs (a `token_for` of its own per request)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kvbaton.bench.tokens import as_token_array
from kvbaton.bench.workloads import create_workload
from kvbaton.bench.workloads.base import WorkloadRequest
from kvbaton.bench.workloads.mooncake import DEFAULT_MOONCAKE_TRACE
from kvbaton.core.config import CacheConfig
from kvbaton.router.pools import PoolConfig
from kvbaton.sim.cluster import ClusterSim
from kvbaton.sim.config import SimConfig
from kvbaton.sim.costs import create_cost_model
from kvbaton.sim.run import SimSetup, build_sim
from kvbaton.sim.spec import parse_cluster_spec

DISTSERVE_COSTS = Path(__file__).resolve().parents[2] / "src/kvbaton/sim/costs/data/distserve_a100.json"


def _run(requests, setup: SimSetup) -> tuple[list, list, int]:
    sim, _, _ = build_sim(setup)
    try:
        records = sim.run(requests)
        return records, sim.worker_reports(), sum(w.num_quiet_steps for w in sim.workers.values())
    finally:
        sim.close()


def _noisy_costs(tmp_path: Path) -> str:
    data = json.loads(DISTSERVE_COSTS.read_text())
    data["step_noise_sigma"], data["step_noise_rho"] = 0.2, 0.6
    path = tmp_path / "noisy.json"
    path.write_text(json.dumps(data))
    return str(path)


CASES = {
    "mooncake": (lambda: create_workload("mooncake", trace=DEFAULT_MOONCAKE_TRACE, num_requests=120),
                 SimSetup(cluster="4xmixed", policy="preble", max_model_len=262144)),
    "conversation-zero-cost": (lambda: create_workload("conversation", num_requests=120, seed=2),
                               SimSetup(cluster="2xmixed", policy="round_robin", cost_model="zero")),
    "tight-pool": (lambda: create_workload("tool-use", num_requests=150, seed=5, rate=20.0),
                   SimSetup(cluster="2xmixed", policy="preble", num_blocks=400, max_num_seqs=8,
                            max_num_batched_tokens=256)),
    "no-prefix-cache": (lambda: create_workload("conversation", num_requests=100, seed=3),
                        SimSetup(cluster="3xmixed", policy="round_robin", enable_prefix_cache=False)),
    "copied-outputs": (lambda: create_workload("conversation", num_requests=100, seed=7),
                       SimSetup(cluster="2xmixed", policy="preble", output_copy_fraction=0.5)),
    "noisy": (lambda: create_workload("conversation", num_requests=120, seed=6),
              SimSetup(cluster="4xmixed", policy="preble", model="opt-13b", gpu="a100", max_model_len=2048)),
}


# Disaggregated: decode workers' runs are cut by reservations, deliveries, adoptions and lease expiry mid-run.
PD_CASES = {
    "8P8D": (lambda: create_workload("tool-use", num_requests=300, seed=0, rate=40.0),
             SimSetup(cluster="8P8D", policy="preble")),
    "late-reservation": (lambda: create_workload("tool-use", num_requests=200, seed=1, rate=30.0),
                         SimSetup(cluster="2P2D", policy="round_robin", reserve_ahead_tokens=2048)),
    "tight-decode-pool": (lambda: create_workload("conversation", num_requests=150, seed=4),
                          SimSetup(cluster="1P2D", policy="round_robin", num_blocks=700, max_num_seqs=16)),
    "combined-with-admission": (lambda: create_workload("sharegpt-like", num_requests=200, seed=2, rate=40.0),
                                SimSetup(model="opt-13b", gpu="a100", cluster="1xmixed+2P2D", cost_model="distserve",
                                         num_blocks=300, max_model_len=2048, admission="predicted",
                                         admission_slo=(0.5, 0.1))),
    "adaptive-pools": (lambda: create_workload("tool-use", num_requests=200, seed=2, rate=40.0, num_tools=4),
                       SimSetup(gpu="a100", cluster="3P1D", enable_prefix_cache=False, admission_slo=(1.0, 0.02),
                                adaptive_pools=True, pools=PoolConfig(sustain_s=0.5, cooldown_s=1.0))),
    "noisy": (lambda: create_workload("conversation", num_requests=120, seed=6),
              SimSetup(cluster="2P2D", policy="round_robin", model="opt-13b", gpu="a100", max_model_len=2048)),
}


@pytest.mark.parametrize("case", sorted(CASES) + [f"pd-{name}" for name in sorted(PD_CASES)])
def test_runs_of_quiet_decodes_give_the_step_by_step_figures(case: str, tmp_path: Path) -> None:
    make, setup = PD_CASES[case[3:]] if case.startswith("pd-") else CASES[case]
    if case.endswith("noisy"):
        setup = replace(setup, cost_model=_noisy_costs(tmp_path))
    requests = make()
    records, reports, num_quiet = _run(requests, setup)
    step_records, step_reports, step_quiet = _run(requests, replace(setup, decode_runs=False))
    assert step_quiet == 0 and num_quiet > 0, "no run was applied: the case tests nothing"
    assert records == step_records
    assert reports == step_reports
    assert sum(r.status == "completed" for r in records) > 0
    if case == "pd-tight-decode-pool":  # refusals and preemptions on the decode workers
        assert sum(w.num_preemptions for w in reports if w.role == "decode") > 0
    elif case == "pd-combined-with-admission":
        assert sum(r.status == "rejected" for r in records) > 0
    elif case == "pd-adaptive-pools":  # a prefill worker lent to mixed duty ran whole requests
        assert any(len(r.worker_ids) == 1 and r.worker_ids[0].startswith("p") for r in records)


def test_runs_cut_by_lease_expiry_give_the_step_by_step_figures() -> None:
    # One prefill worker behind arrivals twice as fast as its steps: granted reservations wait past their lease
    # and expire, on decode workers that are running runs of the requests that made it.
    rng = np.random.default_rng(3)
    requests = [WorkloadRequest(i, i * 0.004, (as_token_array(rng.integers(20, 1000, size=1500)),), 20 + i % 30)
                for i in range(200)]

    def run(decode_runs: bool) -> tuple[list, list, int]:
        config = SimConfig(cache=CacheConfig(16, 4000), handoff_lease_s=0.3, decode_runs=decode_runs)
        sim = ClusterSim(parse_cluster_spec("1P3D"), create_cost_model("roofline", model="llama-3-8b", gpu="h100"),
                         config)
        try:
            records = sim.run(requests)
            for worker in sim.workers.values():
                worker.scheduler.check_invariants()
                cached = worker.cache.num_cached_blocks if worker.cache is not None else 0
                assert worker.pool.num_used_blocks == cached  # every block freed but the prefix cache's
            return records, sim.worker_reports(), sum(w.num_quiet_steps for w in sim.workers.values())
        finally:
            sim.close()

    records, reports, num_quiet = run(True)
    assert num_quiet > 0 and (records, reports) == run(False)[:2]
    reasons = [r.reason for r in records if r.status == "failed"]
    assert any("lease" in reason for reason in reasons) and sum(r.completed for r in records) > 0
