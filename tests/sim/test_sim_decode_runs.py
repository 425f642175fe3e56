"""Runs of quiet decode steps applied at once (`SimConfig.decode_runs`, kvbaton.sim.worker) give every record and
worker figure the step-by-step simulation gives, on workloads that stop, evict, preempt, draw step noise and copy
their prompts into their outputs (a `token_for` of its own per request)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from kvbaton.bench.workloads import create_workload
from kvbaton.bench.workloads.mooncake import DEFAULT_MOONCAKE_TRACE
from kvbaton.sim.run import SimSetup, build_sim

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


@pytest.mark.parametrize("case", sorted(CASES))
def test_runs_of_quiet_decodes_give_the_step_by_step_figures(case: str, tmp_path: Path) -> None:
    make, setup = CASES[case]
    if case == "noisy":
        setup = replace(setup, cost_model=_noisy_costs(tmp_path))
    requests = make()
    records, reports, num_quiet = _run(requests, setup)
    step_records, step_reports, step_quiet = _run(requests, replace(setup, decode_runs=False))
    assert step_quiet == 0 and num_quiet > 0, "no run was applied: the case tests nothing"
    assert records == step_records
    assert reports == step_reports
    assert sum(r.status == "completed" for r in records) > 0


def test_no_runs_with_kv_handoffs() -> None:
    requests = create_workload("tool-use", num_requests=60, seed=1, rate=50.0)
    records, reports, num_quiet = _run(requests, SimSetup(cluster="1P1D", policy="round_robin"))
    assert num_quiet == 0 and all(r.status == "completed" for r in records)
