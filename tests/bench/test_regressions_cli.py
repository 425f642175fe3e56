"""Regressions: bad input to `kvbaton sim | plan | bench --describe | profile --from-step-log` must end with a
one-line `kvbaton: error: ...` and exit status 2, never a traceback (an exception escaping `main`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbaton.cli import main

SIM = ["sim", "--workload", "shared-prefix", "--num-requests", "2", "--no-progress", "--json"]
PLAN = ["plan", "--model", "llama-3-8b", "--gpu", "h100", "--num-gpus", "1", "--ttft-slo", "1", "--tpot-slo", "0.05",
        "--num-requests", "20", "--processes", "1", "--json"]


def _exits_cleanly(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvbaton: error: ") and "\n" not in err, err


@pytest.mark.parametrize("extra", [
    ["--rate", ","],  # run_sim: _rates gives [] -> next(iter({})) raises StopIteration
    ["--rate", ""],
    ["--param", "num_groups=abc"],  # check_positive compares a str with 0 -> TypeError
    ["--param", "num_groups=1.5"],  # range(1.5) -> TypeError
    ["--param", "num_groups=null"],
    ["--param", "rng=3"],  # create_workload: dict() got multiple values for 'rng'
    ["--param", "num_requests=3"],  # create_workload() got multiple values for 'num_requests'
    ["--param", "rate=3"],
    ["--speculative-tokens", "4", "--output-copy-fraction", "2"],  # CopyingOutputs raises a bare ValueError
    ["--speculative-tokens", "4", "--output-copy-fraction", "0.5", "--output-copy-span", "0"],
    ["--block-size", "0"],  # kv_blocks_for divides by zero
    ["--host-kv-gb", "1"],  # gone with the host tier: the error names the KV store's flags instead
    ["--kv-store-gb", "nan"],
    ["--kv-store-private"],  # without a store
    ["--seed", "-1"],  # numpy default_rng([-1, ...]) -> ValueError
])
def test_sim_bad_arguments(extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    _exits_cleanly(SIM + extra, capsys)


@pytest.mark.parametrize("extra", [
    ["--rate", "nan"],  # run_plan checks `rate <= 0` only; units_for: math.ceil(nan) -> ValueError
    ["--rate", "inf"],  # OverflowError
    ["--cost-model", "zero"],  # bound_per_gpu_rps: rho / service_s with service_s == 0 -> ZeroDivisionError
])
def test_plan_bad_arguments(extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    _exits_cleanly(PLAN + extra, capsys)


def _mooncake(tmp_path: Path, text: bytes) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_bytes(text)
    return str(path)


@pytest.mark.parametrize("content", [
    b'{"timestamp": 0, "input_length": 0, "output_length": 5, "hash_ids": []}\n',  # IndexError on ids[-1]
    b'{"timestamp": 0, "input_length": 100, "output_length": 5, "hash_ids": "7"}\n',  # validated as ints, used raw
    b"\xff\xfe not utf-8\n",  # UnicodeDecodeError while iterating the file, outside the try
])
def test_malformed_mooncake_traces(tmp_path: Path, content: bytes, capsys: pytest.CaptureFixture[str]) -> None:
    _exits_cleanly(["sim", "--workload", "mooncake", "--trace", _mooncake(tmp_path, content), "--no-progress"], capsys)


@pytest.mark.parametrize("content", [
    b'[{"conversations": ["hello there friend", "hi"]}]',  # read_sharegpt: turns[0].get on a str
    b'[{"conversations": "xy"}]',
    b"\xff\xfe",  # UnicodeDecodeError is neither OSError nor JSONDecodeError
])
def test_malformed_sharegpt_files(tmp_path: Path, content: bytes, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "sharegpt.json"
    path.write_bytes(content)
    _exits_cleanly(["bench", "--describe", "sharegpt-like", "--trace", str(path)], capsys)


def test_describe_an_empty_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # describe_workload raises a bare ValueError("cannot describe an empty workload").
    _exits_cleanly(["bench", "--describe", "mooncake", "--trace", _mooncake(tmp_path, b"")], capsys)


def _step_rows(duration_s: float) -> str:
    rows = [{"prefill_new_tokens": [100 * (i + 1)], "prefill_context_tokens": [0], "num_decodes": 0,
             "decode_context_tokens": 0, "duration_s": duration_s} for i in range(6)]
    rows += [{"prefill_new_tokens": [], "prefill_context_tokens": [], "num_decodes": i + 1,
              "decode_context_tokens": 100 * (i + 1), "duration_s": duration_s} for i in range(5)]
    return "".join(json.dumps(r) + "\n" for r in rows)


@pytest.mark.parametrize("make", [
    lambda d: str(d / "missing.jsonl"),  # read_step_samples: FileNotFoundError outside the try
    lambda d: str(d),  # IsADirectoryError
    lambda d: (d / "bin.jsonl").write_bytes(b"\xff\xfe\n") and str(d / "bin.jsonl"),  # UnicodeDecodeError
    lambda d: (d / "zero.jsonl").write_text(_step_rows(0.0)) and str(d / "zero.jsonl"),  # fit_quality: max of []
])
def test_profile_from_bad_step_logs(tmp_path: Path, make, capsys: pytest.CaptureFixture[str]) -> None:
    _exits_cleanly(["profile", "--model", "tiny-random", "--out", str(tmp_path / "p.json"), "--from-step-log",
                    make(tmp_path)], capsys)


@pytest.mark.parametrize("argv, message", [
    (["--spec-max-running", "-1"], "spec_max_running must be >= 0"),
    (["--cluster", "1xmixed:pp=1000"], "pipeline stages"),
    (["--rate", "1.0000001,1.0000002"], "may not repeat"),
    (["--policy", "preble,preble"], "may not repeat"),
])
def test_sim_refuses_values_it_used_to_accept_silently(argv: list[str], message: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Odd values the hunt found silently accepted: a negative speculation bound turned speculation off, a pipeline
    deeper than the model's layers ran, and sweep runs of rates equal at 6 digits (or a repeated policy) overwrote
    each other's results."""
    base = ["sim", "--workload", "tool-use", "--num-requests", "5", "--no-progress"]
    assert main([*base, *argv]) == 2
    assert message in capsys.readouterr().err
