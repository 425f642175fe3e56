"""`kvbaton bench --describe` output, and the policy-core import rule for kvbaton.bench."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvbaton.bench.workloads.mooncake import DEFAULT_MOONCAKE_TRACE
from kvbaton.cli import main as kvbaton_main


def test_bench_modules_import_no_torch_fastapi_zmq_or_matplotlib() -> None:
    code = ("import sys; import kvbaton.bench, kvbaton.bench.cli, kvbaton.bench.driver, kvbaton.bench.report, "
            "kvbaton.bench.sharing, kvbaton.bench.plots; "
            "print(json.dumps(sorted(m for m in ('torch', 'fastapi', 'zmq', 'matplotlib') if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_describe_table(capsys) -> None:
    assert kvbaton_main(["bench", "--describe", "shared-prefix", "--param", "num_groups=4",
                         "--param", "prompts_per_group=5", "--param", "system_prompt_tokens=100",
                         "--param", "question_tokens=10"]) == 0
    out = capsys.readouterr().out
    assert "requests       20" in out
    assert "mean input     110.0 tokens" in out
    # 16 of 20 prompts reuse a 100-token system prompt: 1600 / 2200 tokens
    assert f"{100 * 1600 / 2200:.1f} % of prompt tokens shared" in out


def test_describe_json_is_deterministic(capsys) -> None:
    argv = ["bench", "--describe", "agent", "--num-requests", "200", "--seed", "5", "--json"]
    assert kvbaton_main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert kvbaton_main(argv) == 0
    assert json.loads(capsys.readouterr().out) == first
    assert first["num_requests"] == 200 and 0 < first["sharing_ratio"] < 1


@pytest.mark.skipif(not DEFAULT_MOONCAKE_TRACE.is_file(), reason="shared Mooncake trace not present")
def test_describe_mooncake_trace(capsys) -> None:
    assert kvbaton_main(["bench", "--describe", "mooncake", "--trace", str(DEFAULT_MOONCAKE_TRACE), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["num_requests"] == 3993
    assert round(stats["mean_prompt_tokens"]) == 15325 and round(stats["mean_output_tokens"]) == 149
    assert 0.5 < stats["sharing_ratio"] < 0.8


def test_user_errors_exit_2(capsys) -> None:
    assert kvbaton_main(["bench", "--describe", "tool-use", "--trace", "x.jsonl"]) == 2
    assert kvbaton_main(["bench", "--describe", "tool-use", "--param", "novalue"]) == 2
    assert kvbaton_main(["bench"]) == 2
    assert "kvbaton: error:" in capsys.readouterr().err
