"""The soak benchmark at CI size: 200 mixed requests (streamed and whole, n > 1, structured output, clients that
leave mid-stream) at concurrency 32 against `kvbaton serve` 1P1D on tiny-random, with an API key.

Asserted here, as in the full run: every request ends (completed, rejected or failed with a reason), no block is
held by a worker afterwards beyond its prefix cache, no invariant failed, no worker was lost, the server still
serves. RSS is held to 10 % between the first and last quarter (the full run's 5 % needs its 2,000 requests to
outgrow warm-up); the p99 latency ratio is only reported at this size (a quarter's p99 is one of its 50
requests' latencies on a shared machine). The full figures: benchmarks/soak.py, README.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def test_a_ci_sized_soak_ends_every_request_and_leaves_nothing_held() -> None:
    done = subprocess.run([sys.executable, str(SOAK), "--num-requests", "200", "--concurrency", "32",
                           "--max-tokens", "16", "--request-timeout-s", "120"],
                          capture_output=True, text=True, timeout=480)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["every_request_ended"] and result["outcomes"]["hung"] == 0, result
    assert result["outcomes"]["completed"] > 100 and result["outcomes"]["abandoned"] > 0, result
    assert result["outcomes"]["failed"] == 0, result["failure_reasons"]  # at this load nothing should fail
    assert all(result["mix"][kind] > 0 for kind in ("chat", "streamed", "n_above_1", "structured",
                                                     "leave_mid_stream")), result["mix"]
    assert result["blocks_held_after"] == 0 and result["in_flight_after"] == 0, result
    assert result["invariant_errors"] == {} and result["lost_workers"] == {} and result["serving_after"], result
    assert set(result["rss"]) == {"router", "p0", "d0"}
    assert all(figures["ratio"] <= 1.10 for figures in result["rss"].values()), result["rss"]
