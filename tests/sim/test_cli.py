"""`kvbaton sim` CLI functions: sweeps, the bench report, byte-identical output across processes; import hygiene."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvbaton.core.errors import InvalidRequestError
from kvbaton.sim.cli import add_sim_arguments, run_sim

ARGS = ["--workload", "shared-prefix", "--num-requests", "40", "--rate", "20,40", "--policy", "round_robin,preble",
        "--cluster", "1P1D", "--seed", "7", "--no-progress", "--ttft-slo", "0.5", "--tpot-slo", "0.05"]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    return parser.parse_args(argv)


def test_sweep_writes_the_bench_report_identically_in_two_processes(tmp_path: Path, capsys) -> None:
    assert run_sim(parse(ARGS + ["--out", str(tmp_path / "a")])) == 0
    assert "round_robin@20" in capsys.readouterr().out
    code = ("import argparse, sys\nfrom kvbaton.sim.cli import add_sim_arguments, run_sim\n"
            "p = argparse.ArgumentParser(); add_sim_arguments(p); run_sim(p.parse_args(sys.argv[1:]))\n")
    proc = subprocess.run([sys.executable, "-c", code, *ARGS, "--out", str(tmp_path / "b")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    a, b = (tmp_path / "a" / "report.json").read_bytes(), (tmp_path / "b" / "report.json").read_bytes()
    assert a == b
    report = json.loads(a)
    assert set(report["runs"]) == {"round_robin@20", "round_robin@40", "preble@20", "preble@40"}
    assert [p["rate_rps"] for p in report["sweeps"]["preble"]] == [20.0, 40.0]
    assert report["num_gpus"] == 2 and report["runs"]["preble@20"]["overall"]["num_completed"] == 40
    assert (tmp_path / "a" / "report.md").exists() and (tmp_path / "a" / "ttft_cdf.png").exists()


def test_json_output_and_errors(capsys) -> None:
    assert run_sim(parse(["--workload", "sharegpt-like", "--num-requests", "20", "--rate", "5", "--json",
                          "--cluster", "2xmixed", "--gpu", "a100", "--model", "opt-13b", "--cost-model",
                          "distserve"])) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["runs"]["round_robin"]["overall"]["num_requests"] == 20
    with pytest.raises(InvalidRequestError):
        run_sim(parse(["--workload", "tool-use", "--policy", "nope"]))
    with pytest.raises(InvalidRequestError):
        run_sim(parse(["--workload", "tool-use", "--trace", "x.jsonl"]))


def test_sim_package_imports_no_torch_fastapi_or_zmq() -> None:
    code = ("import sys, kvbaton.sim.cli, kvbaton.sim.run\n"
            "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'fastapi', 'zmq'))))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "", proc.stdout + proc.stderr
