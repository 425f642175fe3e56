"""Regressions: report.json and `--json` output must be strict JSON (no NaN/Infinity), and non-finite input that
would produce it must be refused at the door."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbaton.cli import main


def _strict(text: str) -> object:
    def refuse(constant: str) -> object:
        raise ValueError(f"not valid JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_sim_refuses_or_survives_a_nan_slo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Bug: run_sim checks only that both SLOs are given; SLO(nan, ...) reaches summarize, and the report holds
    # NaN (the slo block of report.json) — `json.loads` of other tools rejects it. plan refuses such SLOs.
    rc = main(["sim", "--workload", "shared-prefix", "--num-requests", "2", "--no-progress", "--ttft-slo", "nan",
               "--tpot-slo", "0.1", "--out", str(tmp_path)])
    if rc == 2:
        return
    _strict((tmp_path / "report.json").read_text())


def test_mooncake_trace_with_a_nan_timestamp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Bug: read_mooncake_trace accepts float("NaN") timestamps (trace_arrivals' non-decreasing check is False
    # for NaN), every record's times become NaN and report.json / --json print NaN.
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": NaN, "input_length": 100, "output_length": 5, "hash_ids": [1]}\n'
                     '{"timestamp": 0, "input_length": 100, "output_length": 5, "hash_ids": [2]}\n')
    rc = main(["sim", "--workload", "mooncake", "--trace", str(trace), "--no-progress", "--json"])
    out = capsys.readouterr().out
    if rc == 2:
        return
    _strict(out)


def test_plan_json_with_an_infinite_slo(capsys: pytest.CaptureFixture[str]) -> None:
    # Bug: plan accepts --ttft-slo inf (only `<= 0` is refused); bound_per_gpu_rps computes inf/inf and
    # plan_json prints "bound_per_gpu_rps": NaN.
    rc = main(["plan", "--model", "llama-3-8b", "--gpu", "h100", "--num-gpus", "1", "--ttft-slo", "inf",
               "--tpot-slo", "inf", "--num-requests", "20", "--processes", "1", "--json"])
    out = capsys.readouterr().out
    if rc == 2:
        return
    _strict(out)
