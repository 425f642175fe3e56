"""The planner end to end on a small search: determinism across process counts, JSON shape, the CLI."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvbaton.bench.metrics import SLO
from kvbaton.cli import main
from kvbaton.plan.goodput import SearchSettings
from kvbaton.plan.planner import GoodputPlanner, PlanRequest, bound_per_gpu_rps
from kvbaton.plan.report import plan_json, plan_text

SMALL = PlanRequest("opt-13b", "a100", 2, SearchSettings(SLO(0.2, 0.1), 0.9, step_rps=1.0, max_per_gpu_rps=16.0, ceiling_rps=8.0),
                    gpus_per_node=2, num_requests=40, cost_model="distserve", num_processes=1)


@pytest.fixture(scope="module")
def plan_one_process():  # noqa: ANN201 - a Plan
    return GoodputPlanner(SMALL).run()


def test_small_plan_searches_every_placement_and_picks_the_highest(plan_one_process) -> None:  # noqa: ANN001
    plan = plan_one_process
    labels = [c.placement.label for c in plan.candidates]
    assert labels == ["P tp1 pp1 x1 + D tp1 pp1 x1", "colocated tp1 pp1 x1", "colocated tp2 pp1 x1"]
    searched = [c for c in plan.candidates if not c.result.pruned]
    assert plan.best in searched
    assert plan.best.result.per_gpu_rps == max(c.result.per_gpu_rps for c in plan.candidates) > 0
    assert plan.best_disaggregated is plan.candidates[0]
    assert plan.best_colocated in plan.candidates[1:]
    for c in plan.candidates:  # a pruned candidate saw a failure at or below the winner's rate
        if c.result.pruned:
            failed = [p.per_gpu_rps for p in c.result.probes if not p.met]
            assert failed and min(failed) <= plan.best.result.per_gpu_rps
    assert plan.units_for(10.0) * plan.best.result.per_gpu_rps * plan.best.placement.num_gpus >= 10.0


@pytest.mark.parametrize("wave_size", [1, 4])
def test_the_plan_json_is_the_same_bytes_whatever_the_process_count(plan_one_process, wave_size: int) -> None:  # noqa: ANN001
    # Waves of 1 prune each search by the ones before it (the candidates' pruned flags and probe counts then depend
    # on the waves alone, not on which process finished first); a wave of 4 holds all three candidates.
    one = GoodputPlanner(replace(SMALL, wave_size=wave_size)).run()
    two = GoodputPlanner(replace(SMALL, num_processes=2, wave_size=wave_size)).run()
    assert json.dumps(plan_json(one, 10.0)) == json.dumps(plan_json(two, 10.0))
    assert one.best.placement == plan_one_process.best.placement
    assert one.best.result.per_gpu_rps == plan_one_process.best.result.per_gpu_rps
    if wave_size == 1:
        assert any(c.result.pruned for c in one.candidates)


def test_cli_plan_json_is_byte_identical_for_one_and_two_processes(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "opt-13b", "--gpu", "a100", "--num-gpus", "2", "--gpus-per-node", "2", "--ttft-slo",
            "0.2", "--tpot-slo", "0.1", "--cost-model", "distserve", "--num-requests", "40", "--rate-step", "1",
            "--first-ceiling", "8", "--max-rate", "16", "--json"]
    outputs = []
    for processes in ("1", "2"):
        assert main([*argv, "--processes", processes]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and "search_s" not in outputs[0]


def test_plan_json_shape(plan_one_process) -> None:  # noqa: ANN001
    payload = plan_json(plan_one_process, rate_rps=12.0)
    best = payload["best"]
    assert ("colocated" in best) != ("prefill" in best and "decode" in best)
    pools = [best["colocated"]] if "colocated" in best else [best["prefill"], best["decode"]]
    assert all(set(pool) == {"tp", "pp", "replicas"} for pool in pools)
    assert best["per_gpu_goodput_rps"] == plan_one_process.best.result.per_gpu_rps
    assert best["units"] == plan_one_process.units_for(12.0)
    assert len(payload["candidates"]) == 3
    json.dumps(payload)
    text = plan_text(plan_one_process, 12.0)
    assert "best unit" in text and "for 12 req/s" in text


def test_bound_orders_hopeless_prefill_last() -> None:
    planner = GoodputPlanner(SMALL)
    placements = planner.placements()
    slo = SLO(0.2, 0.1)
    # A 2,000-token prompt takes over 0.2 s to prefill on one A100 with these coefficients: no rate meets TTFT.
    assert bound_per_gpu_rps(placements[1], planner.cost_model, 2000, 200, slo) == 0.0
    assert bound_per_gpu_rps(placements[2], planner.cost_model, 2000, 200, slo) > 0.0


def test_cli_plan_json(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--model", "opt-13b", "--gpu", "a100", "--num-gpus", "2", "--gpus-per-node", "2",
                 "--ttft-slo", "0.2", "--tpot-slo", "0.1", "--num-requests", "40", "--rate-step", "1",
                 "--max-rate", "8", "--processes", "1", "--rate", "5", "--json"])
    assert code == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["settings"]["cost_model"] == "distserve"  # auto: published A100 coefficients
    assert payload["best"]["per_gpu_goodput_rps"] > 0 and payload["best"]["units"] >= 1
    assert {"prefill", "decode"} <= set(payload["candidates"][0])


def test_cli_plan_rejects_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "opt-13b", "--gpu", "a100", "--num-gpus", "0", "--ttft-slo", "0.2",
                 "--tpot-slo", "0.1"]) == 2
    assert "num-gpus" in capsys.readouterr().err


def test_cli_plan_out_writes_report_and_plot(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    out = tmp_path / "plan"
    code = main(["plan", "--model", "opt-13b", "--gpu", "a100", "--num-gpus", "2", "--gpus-per-node", "2",
                 "--ttft-slo", "0.2", "--tpot-slo", "0.1", "--num-requests", "30", "--rate-step", "2",
                 "--max-rate", "16", "--processes", "1", "--out", str(out)])
    assert code == 0
    assert "best unit" in capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert "P tp1 pp1 x1 + D tp1 pp1 x1" in report["curves"] and len(report["curves"]) == 2
    for points in report["curves"].values():
        assert len(points) == 8 and all(0.0 <= attained <= 1.0 for _, _, attained in points)
    assert (out / "goodput_vs_rate.png").stat().st_size > 1000
    assert "goodput_vs_rate.png" in (out / "report.md").read_text()
