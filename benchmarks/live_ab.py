"""Paired live runs of two source trees on the same trace: did a change make the live cluster faster?

Serves the `shared-prefix` trace (the fidelity benchmark's) on a live `kvbaton serve` started from
source tree A, then B, then B, then A (ABBA, so a host that drifts during the runs weighs on both
alike), and prints each run's TTFT and TPOT percentiles and the ratio B / A of the pairs' medians.
The tree is the server's PYTHONPATH: check out the code to compare with, e.g.
`git worktree add /tmp/kvbaton-before HEAD~1`, and pass its `src`.

    .venv/bin/python benchmarks/live_ab.py --a-src /tmp/kvbaton-before/src [--b-src src] [--cluster 1P1D]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import numpy as np
from fidelity import POOL_FLAGS
from routing_live import start_server, stop_server

from kvbaton.bench.driver import DriverConfig, discover_model, run_live
from kvbaton.bench.workloads import create_workload

FIGURES = ("ttft_p50_ms", "ttft_p99_ms", "ttft_mean_ms", "tpot_p50_ms", "tpot_p99_ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a-src", required=True, help="the source tree to compare against (its src folder)")
    parser.add_argument("--b-src", default=str(Path(__file__).resolve().parents[1] / "src"))
    parser.add_argument("--cluster", choices=sorted(POOL_FLAGS), default="1P1D")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--policy", default="round_robin")
    parser.add_argument("--num-requests", type=int, default=150)
    parser.add_argument("--rate", type=float, default=0.8)
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--threads-per-worker", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout-s", type=float, default=240.0)
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    args = parser.parse_args()
    requests = create_workload("shared-prefix", num_requests=args.num_requests, seed=args.seed, rate=args.rate,
                               num_groups=4, system_prompt_tokens=512, question_tokens=64, output_tokens=24)
    trees = {"A": str(Path(args.a_src).resolve()), "B": str(Path(args.b_src).resolve())}
    runs: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    saved_path = os.environ.get("PYTHONPATH")
    try:
        for name in ("A", "B", "B", "A"):
            os.environ["PYTHONPATH"] = trees[name]  # the server's processes import this tree
            server = start_server(args, args.policy, POOL_FLAGS[args.cluster])
            try:
                config = DriverConfig(url=server.url, model=discover_model(server.url),
                                      timeout_s=args.request_timeout_s)
                records = run_live(requests, config)
            finally:
                stop_server(server)
            figures = _figures(records)
            runs[name].append(figures)
            print(json.dumps({"tree": name, "src": trees[name], **figures}), flush=True)
    finally:
        if saved_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved_path
    medians = {name: {k: statistics.median(run[k] for run in runs[name]) for k in FIGURES} for name in runs}
    print(json.dumps({"benchmark": "live_ab", "cluster": args.cluster, "num_requests": args.num_requests,
                      "rate_rps": args.rate, "median_a": medians["A"], "median_b": medians["B"],
                      "ratio_b_over_a": {k: round(medians["B"][k] / medians["A"][k], 3) for k in FIGURES}}))


def _figures(records: list) -> dict[str, float]:
    completed = [r for r in records if r.completed]
    ttft = np.array([r.ttft_s for r in completed]) * 1e3
    tpot = np.array([r.tpot_s for r in completed if r.tpot_s is not None]) * 1e3
    return {"completed": len(completed), "ttft_p50_ms": round(float(np.percentile(ttft, 50)), 1),
            "ttft_p99_ms": round(float(np.percentile(ttft, 99)), 1), "ttft_mean_ms": round(float(ttft.mean()), 1),
            "tpot_p50_ms": round(float(np.percentile(tpot, 50)), 1),
            "tpot_p99_ms": round(float(np.percentile(tpot, 99)), 1)}


if __name__ == "__main__":
    main()
