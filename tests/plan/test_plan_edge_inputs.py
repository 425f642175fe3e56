"""Regressions of `kvbaton plan` found by a bug hunt: edge inputs, tiny rates, placements that fit no node."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvbaton.bench.metrics import SLO
from kvbaton.core.errors import InvalidRequestError
from kvbaton.plan.cli import add_plan_arguments, plan_request_from_args, run_plan
from kvbaton.plan.goodput import SearchSettings
from kvbaton.plan.placements import Hardware, disaggregated_placements
from kvbaton.sim.catalog import get_gpu, get_model
from kvbaton.sim.costs import create_cost_model

# One GPU, SLOs nothing meets: every search fails down to the grid's first rate in a handful of fast probes.
HOPELESS = ["--model", "llama-3-8b", "--gpu", "h100", "--num-gpus", "1", "--ttft-slo", "0.0001", "--tpot-slo",
            "0.0001", "--num-requests", "20", "--processes", "1"]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return parser.parse_args(argv)


def _strict(text: str) -> object:
    def refuse(constant: str) -> None:
        raise AssertionError(f"non-strict JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def test_report_dir_of_a_tiny_goodput_sweeps_positive_rates(tmp_path: Path, capsys) -> None:
    # Bug: `--out` sweeps rates round(top * f, 4); with a goodput (or --rate-step) under ~0.0002 req/s per GPU
    # they round to 0.0 and the sweep divided arrival times by zero (ZeroDivisionError traceback).
    assert run_plan(parse(HOPELESS + ["--rate-step", "0.0001", "--out", str(tmp_path), "--json"])) == 0
    report = _strict((tmp_path / "report.json").read_text())
    rates = [point[0] for curve in report["curves"].values() for point in curve]
    assert rates and all(rate > 0 for rate in rates)
    _strict(capsys.readouterr().out)


def test_a_rate_step_under_a_nanorequest_never_probes_rate_zero(capsys) -> None:
    # Bug: grid rates were rounded to 9 decimals, so with --rate-step 1e-10 the bisection's lowest probe was rate
    # 0.0 and the search crashed with ZeroDivisionError instead of reporting goodput 0.
    assert run_plan(parse(HOPELESS + ["--rate-step", "1e-10", "--json"])) == 0
    best = _strict(capsys.readouterr().out)["best"]  # type: ignore[index]
    assert best["per_gpu_goodput_rps"] == 0.0


def test_the_search_never_probes_above_max_rate() -> None:
    # Bug: max_steps rounded max/step to the nearest grid index, so step 0.35 under a 1.0 limit searched (and could
    # report as capped) 1.05 req/s per GPU, above --max-rate.
    settings = SearchSettings(SLO(1.0, 0.1), step_rps=0.35, max_per_gpu_rps=1.0, ceiling_rps=0.5)
    assert settings.max_steps * settings.step_rps <= settings.max_per_gpu_rps


@pytest.mark.parametrize("flag, value", [("--processes", "-1"), ("--max-pp", "0"), ("--max-pp", "-2")])
def test_out_of_range_counts_are_refused(flag: str, value: str) -> None:
    # Bug: --processes -1 silently ran inline and --max-pp 0 ended in "fits no placement", not a plain refusal.
    with pytest.raises(InvalidRequestError, match=flag):
        plan_request_from_args(parse(HOPELESS + [flag, value]))


def test_node_constrained_segments_fit_the_nodes_there_are() -> None:
    # Bug: Algorithm 2 only checked pp_cross * segment GPUs <= all GPUs, so on 10 GPUs of 8 per node it offered
    # two 5-GPU segments (P tp1 pp2 + D tp4 pp2), though the second node holds only 2 GPUs.
    model = get_model("llama-2-7b")
    hardware = Hardware(get_gpu("h100"), 10, 8)
    cost = create_cost_model("roofline", "llama-2-7b", "h100")
    for p in disaggregated_placements(model, cost, hardware, "low", 4096, max_pp=2):
        assert p.prefill is not None and p.decode is not None
        pp_cross = min(p.prefill.pp, p.decode.pp) if p.prefill.pp > 1 and p.decode.pp > 1 else 1
        segment_gpus = p.num_gpus // pp_cross
        placeable = (10 // 8) * (8 // segment_gpus) + (10 % 8) // segment_gpus
        assert placeable >= pp_cross, f"{p.label}: {pp_cross} segments of {segment_gpus} GPUs on nodes of 8 + 2"


def test_text_says_plainly_when_no_placement_meets_the_slos(capsys) -> None:
    # Bug: with goodput 0 everywhere the text still presented a "best unit" with "per-GPU goodput 0.00 req/s" and
    # never said that nothing meets the SLOs.
    assert run_plan(parse(HOPELESS)) == 0
    assert "no placement meets the SLOs" in capsys.readouterr().out
