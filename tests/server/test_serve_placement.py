"""`kvbaton plan ... --json` handed to `kvbaton serve --placement`: the planned pools start and serve a completion
(tiny-random serving, the plan priced on smollm2-135m's catalog shape)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.server.serve_helpers import serve_process

pytestmark = pytest.mark.timeout(420)


def test_serve_launches_the_planned_disaggregated_unit(tmp_path: Path) -> None:
    plan = subprocess.run([sys.executable, "-m", "kvbaton.cli", "plan", "--model", "smollm2-135m", "--gpu", "a100",
                           "--num-gpus", "2", "--ttft-slo", "0.5", "--tpot-slo", "0.1", "--num-requests", "40",
                           "--processes", "1", "--json"], capture_output=True, text=True, timeout=120, check=True)
    path = tmp_path / "plan.json"
    path.write_text(plan.stdout)
    unit = json.loads(plan.stdout)["best_disaggregated"]
    assert (unit["prefill"]["replicas"], unit["decode"]["replicas"]) == (1, 1)
    with serve_process(["--placement", str(path), "--placement-pick", "best_disaggregated", "--model", "tiny-random",
                        "--num-blocks", "128", "--local-prefill-threshold", "0", "--drain-timeout", "5"],
                       startup_timeout_s=300.0, stderr=subprocess.PIPE) as served:
        assert "with 0 mixed + 1 prefill + 1 decode worker(s)" in served.banner
        with httpx.Client(timeout=120) as http:
            cluster = http.get(served.url + "/cluster").json()
            assert sorted(w["role"] for w in cluster["workers"]) == ["decode", "prefill"]
            answer = http.post(served.url + "/v1/completions", json={
                "model": "tiny-random", "prompt": "a prompt long enough to be handed off " * 4, "max_tokens": 6,
                "temperature": 0, "ignore_eos": True}).json()
            assert answer["choices"][0]["finish_reason"] == "length"
            assert answer["usage"]["completion_tokens"] == 6
