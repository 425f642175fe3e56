"""benchmarks/gpu_check.py --small on the CPU: every section runs and agrees, so the GPU run cannot rot unseen."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


@pytest.mark.timeout(240)
def test_gpu_check_small_runs_every_section_and_agrees(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--small", "--out", str(out)], capture_output=True,
                          text=True, timeout=220)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report == json.loads(done.stdout.strip().splitlines()[-1])
    assert report["mode"] == "small" and report["ok"] is True
    for name in ("parity_smollm2", "parity_big", "speed_kvbaton", "speed_transformers", "pair"):
        assert "error" not in report[name], (name, report[name])
    for name in ("parity_smollm2", "parity_big"):
        assert report[name]["equal"] and report[name]["first_divergence"] == [None, None, None]
    speed = report["speed_kvbaton"]
    assert sorted(speed["decode"], key=int) == ["1", "4", "8"] and speed["prefill"]["tokens"] == 256
    assert all(row["tok_s"] > 0 for row in speed["decode"].values()) and speed["prefill"]["tok_s"] > 0
    assert speed["decode"]["1"]["hbm_roofline_fraction"] is None  # no roofline for a CPU
    if report["env"]["transformers"] is None:
        assert report["speed_transformers"]["skipped"].startswith("transformers is not installed")
    else:
        assert set(report["speed_ratio_kvbaton_over_transformers"]) == {"decode_b1", "decode_b4", "decode_b8",
                                                                          "prefill"}
    for transport in ("shm", "tcp"):
        pair = report["pair"][transport]
        assert "error" not in pair, pair
        assert pair["transport"] == transport and pair["equal_to_colocated"]
        assert pair["num_completed"] == 3 and pair["num_recomputed"] == 0
        assert pair["blocks_held"] == [] and pair["reports"] == []
        assert pair["kv_bytes"] > 0 and pair["decode_staged_bytes"] > 0  # the landing memory was copied in
