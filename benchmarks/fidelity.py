"""Simulator fidelity: one trace on the live cluster and in the simulator with the profiled cost model.

1. The same `shared-prefix` requests run on a live `kvbaton serve` (2 mixed workers, and 1 prefill +
   1 decode) through the live driver; every worker logs its steps (`--step-log-dir`).
2. The simulator's step-time coefficients for this host, two ways (`kvbaton profile --from-step-log`):
   - held out: from a calibration run (the same workload family, another seed, its own server) just
     before the evaluated one; the evaluated trace is never used for fitting;
   - in run: from the evaluated run's own step log: the few cost-model coefficients only, never a
     request's outcome. This host's speed drifts by 10-20 % within minutes (the decode step's median
     moved 43.7 -> 48.8 -> 52.3 ms over three consecutive runs of one stop), so a held-out fit mixes
     that drift into the error; the in-run fit separates the simulator's own error (queueing,
     batching, caching, routing) from the host's.
   (`--calibrate idle` times the idle engine with `kvbaton profile` instead of the held-out run.)
3. The same requests through `kvbaton.sim` with each cost model, the same cluster shape, policy, KV
   pool and token budget, for `--sim-seeds` step-noise seeds pooled into one distribution.
4. The evaluated trace runs live a second time (`--live-repeats`): the live system's own
   run-to-run spread, the floor under any simulator's error on this host.
p50/p99 TTFT and TPOT side by side with the error (sim - live) / live; targets: <= 10 % at p50,
<= 20 % at p99. Prints markdown tables per cluster on stderr and one JSON line on stdout; the live
records, step logs and fitted coefficient files stay in the printed `workdir`.

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
from kvbaton.bench.records import RequestRecord, write_records
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
                        help="the held-out fit: a calibration run's worker step logs, or the idle engine")
    parser.add_argument("--sim-seeds", type=int, default=5, help="step-noise seeds pooled per simulation")
    parser.add_argument("--live-repeats", type=int, default=1, help="extra live runs of the evaluated trace")
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

    def fit(logs: Path, out: Path) -> Path:
        subprocess.run([sys.executable, "-m", "kvbaton.cli", "profile", "--model", args.model, "--out", str(out),
                        "--from-step-log", *sorted(str(p) for p in logs.iterdir())],
                       check=True, stdout=subprocess.DEVNULL)
        return out

    requests = trace(args.seed)
    result: dict[str, object] = {"benchmark": "fidelity", "model": args.model, "policy": args.policy,
                                 "num_requests": args.num_requests, "rate_rps": args.rate,
                                 "calibrate": "profile file" if args.profile else args.calibrate,
                                 "sim_seeds": args.sim_seeds, "workdir": str(workdir), "clusters": {}}
    for cluster in [c for c in args.clusters.split(",") if c]:
        held_out = idle_profile
        if not args.profile and args.calibrate == "serving":
            logs = workdir / f"calibration-{cluster}"
            logs.mkdir()
            run_live_cluster(args, cluster, trace(args.seed + 1000), logs)  # another trace of the same family
            held_out = fit(logs, workdir / f"held-out-{cluster}.json")
        eval_logs = workdir / f"evaluated-{cluster}"
        eval_logs.mkdir()
        live = run_live_cluster(args, cluster, requests, eval_logs)
        write_records(workdir / f"live-{cluster}.jsonl", live)
        in_run = fit(eval_logs, workdir / f"in-run-{cluster}.json")
        title = f"{cluster}, {args.policy}, {args.num_requests} requests at {args.rate} req/s"
        figures: dict[str, object] = {}
        for name, coefficients in (("held_out", held_out), ("in_run", in_run)):
            simulated = [record for seed in range(args.seed, args.seed + args.sim_seeds)
                         for record in simulate(requests, SimSetup(
                             model=args.model, cluster=cluster, policy=args.policy, cost_model=str(coefficients),
                             seed=seed, num_blocks=args.num_blocks, max_num_batched_tokens=512,
                             max_num_seqs=128)).records]
            rows = compare_runs(live, simulated)
            print(render_fidelity(rows, f"{title}: simulator, {name.replace('_', '-')} fit"), file=sys.stderr)
            figures[name] = _rows_json(rows)
        for repeat in range(args.live_repeats):  # the live system against itself: what drift alone does
            repeated = run_live_cluster(args, cluster, requests)
            write_records(workdir / f"live-{cluster}-repeat{repeat + 1}.jsonl", repeated)
            rows = compare_runs(live, repeated)
            print(render_fidelity(rows, f"{title}: live repeat {repeat + 1} against the evaluated run"),
                  file=sys.stderr)
            figures[f"live_repeat_{repeat + 1}"] = _rows_json(rows)
        result["clusters"][cluster] = figures  # type: ignore[index]
    print(json.dumps(result))


def _rows_json(rows: list) -> dict[str, object]:
    return {row.metric: {"live_s": row.live_s, "sim_s": row.sim_s, "error": row.error,
                         "within_target": row.within_target} for row in rows}


if __name__ == "__main__":
    main()
