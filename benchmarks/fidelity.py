"""Simulator fidelity: one trace on the live cluster and in the simulator with the profiled cost model.

1. The simulator's step-time coefficients for this host: with `--calibrate serving` (default) a
   calibration run — the same workload family with another seed, on the same cluster — logs every
   worker's steps as it serves (`kvbaton serve --step-log-dir`) and `kvbaton profile --from-step-log`
   fits them, per cluster; with `--calibrate idle`, `kvbaton profile` times the engine alone (one
   torch thread, like each live worker). The evaluation trace is never used for fitting.
2. The same `shared-prefix` requests run on a live `kvbaton serve` (2 mixed workers, and 1 prefill +
   1 decode) through the live driver, and through `kvbaton.sim` with the profiled cost model, the
   same cluster shape, policy, KV pool and token budget.
3. p50/p99 TTFT and TPOT side by side with the error (sim - live) / live; targets: <= 10 % at p50,
   <= 20 % at p99. Prints a markdown table per cluster on stderr and one JSON line on stdout.

    .venv/bin/python benchmarks/fidelity.py [--num-requests 120] [--rate 0.8] [--clusters 2xmixed,1P1D]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from routing_live import start_server, stop_server

from kvbaton.bench.driver import DriverConfig, discover_model, run_live
from kvbaton.bench.records import RequestRecord
from kvbaton.bench.workloads import create_workload
from kvbaton.sim.fidelity import compare_runs, render_fidelity
from kvbaton.sim.run import SimSetup, simulate

POOL_FLAGS = {"2xmixed": ["--workers", "2"], "1P1D": ["--prefill", "1", "--decode", "1"]}


def profile(args: argparse.Namespace, out: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads_per_worker))
    subprocess.run([sys.executable, "-m", "kvbaton.cli", "profile", "--model", args.model, "--out", str(out)],
                   check=True, env=env, timeout=1800)


def run_live_cluster(args: argparse.Namespace, cluster: str, requests: list,
                     step_log_dir: Path | None = None) -> list[RequestRecord]:
    extra = ["--step-log-dir", str(step_log_dir)] if step_log_dir is not None else []
    server = start_server(args, args.policy, POOL_FLAGS[cluster], extra)
    try:
        config = DriverConfig(url=server.url, model=discover_model(server.url), timeout_s=args.request_timeout_s)
        return run_live(requests, config)
    finally:
        stop_server(server)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--clusters", default="2xmixed,1P1D")
    parser.add_argument("--policy", default="round_robin")
    parser.add_argument("--threads-per-worker", type=int, default=1)
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--num-groups", type=int, default=4)
    parser.add_argument("--system-prompt-tokens", type=int, default=512)
    parser.add_argument("--question-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=24)
    parser.add_argument("--num-requests", type=int, default=120)
    parser.add_argument("--rate", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", default=None, help="reuse a coefficient file instead of profiling")
    parser.add_argument("--calibrate", default="serving", choices=("serving", "idle"),
                        help="fit step times from a calibration run's worker step logs, or time the idle engine")
    parser.add_argument("--startup-timeout-s", type=float, default=240.0)
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp())
    idle_profile = Path(args.profile) if args.profile else workdir / "profile.json"
    if not args.profile and args.calibrate == "idle":
        profile(args, idle_profile)

    def trace(seed: int) -> list:
        return create_workload("shared-prefix", num_requests=args.num_requests, seed=seed, rate=args.rate,
                               num_groups=args.num_groups, system_prompt_tokens=args.system_prompt_tokens,
                               question_tokens=args.question_tokens, output_tokens=args.output_tokens)

    requests = trace(args.seed)
    result: dict[str, object] = {"benchmark": "fidelity", "model": args.model, "policy": args.policy,
                                 "num_requests": args.num_requests, "rate_rps": args.rate,
                                 "calibrate": "profile file" if args.profile else args.calibrate, "clusters": {}}
    for cluster in [c for c in args.clusters.split(",") if c]:
        coefficients = idle_profile
        if not args.profile and args.calibrate == "serving":
            logs = workdir / f"steps-{cluster}"
            logs.mkdir()
            run_live_cluster(args, cluster, trace(args.seed + 1000), logs)  # another trace of the same family
            coefficients = workdir / f"serving-{cluster}.json"
            subprocess.run([sys.executable, "-m", "kvbaton.cli", "profile", "--model", args.model, "--out",
                            str(coefficients), "--from-step-log", *sorted(str(p) for p in logs.iterdir())],
                           check=True, stdout=subprocess.DEVNULL)
        live = run_live_cluster(args, cluster, requests)
        setup = SimSetup(model=args.model, cluster=cluster, policy=args.policy, cost_model=str(coefficients),
                         seed=args.seed, num_blocks=args.num_blocks, max_num_batched_tokens=512, max_num_seqs=128)
        simulated = simulate(requests, setup).records
        rows = compare_runs(live, simulated)
        print(render_fidelity(rows, f"{cluster}, {args.policy}, {args.num_requests} requests at {args.rate} req/s"),
              file=sys.stderr)
        result["clusters"][cluster] = {  # type: ignore[index]
            row.metric: {"live_s": row.live_s, "sim_s": row.sim_s, "error": row.error, "within_target": row.within_target}
            for row in rows
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
