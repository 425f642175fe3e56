"""Simulator fidelity: one trace on the live cluster and in the simulator, the cost model fitted on other runs.

1. Live (`kvbaton serve`, 2 mixed workers, and 1 prefill + 1 decode), per cluster, interleaved:
   a calibration run (the same `shared-prefix` family, another seed: other prompts and arrivals),
   then the evaluated trace twice (runs A and B). Every worker logs its steps (`--step-log-dir`);
   the records and logs stay in `--workdir`.
2. The simulator's step-time coefficients for this host (`kvbaton profile --from-step-log`, the few
   cost-model coefficients and the step noise, never a request's outcome), fitted on each run:
   - held out (the headline): fitted on run B's steps and scored against run A, and the other way
     round: the scored run's own steps are never used;
   - calibration workload: fitted on the calibration run (other prompts and arrivals) and scored
     against A and B; next to it, each run's median step time over that fit's prediction for the
     same shapes: how far the host's own speed moved between runs minutes apart;
   - in run (fit quality only): fitted on run A's own log and scored against run A.
3. The same requests through `kvbaton.sim` with each cost model, the same cluster shape, policy, KV
   pool and token budget, for `--sim-seeds` step-noise seeds pooled into one distribution.
4. Run B against run A: the live system's own run-to-run spread on this host, measured in the same
   session. A perfect simulator predicts the runs' common distribution, so it still misses one run
   by about that run's own deviation; when that alone passes the targets, the spread forbids them.
p50/p99 TTFT and TPOT with the error (sim - live) / live; targets: <= 10 % at p50, <= 20 % at p99.
Prints markdown tables on stderr and one JSON line on stdout. `--skip-live --workdir DIR` scores a
finished workdir again (e.g. after a cost-model change) without serving anything.

    .venv/bin/python benchmarks/fidelity.py [--num-requests 120] [--rate 0.8] [--clusters 2xmixed,1P1D]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from routing_live import DTYPE_HELP, start_server, stop_server

from kvbaton.bench.driver import DriverConfig, discover_model, run_live
from kvbaton.bench.records import RequestRecord, read_records, write_records
from kvbaton.bench.workloads import create_workload
from kvbaton.bench.workloads.base import WorkloadRequest
from kvbaton.sim.costs.fit import read_step_samples
from kvbaton.sim.costs.linear import load_linear_model
from kvbaton.sim.fidelity import FidelityRow, compare_runs, render_fidelity
from kvbaton.sim.run import SimSetup, simulate

POOL_FLAGS = {"2xmixed": ["--workers", "2"], "1P1D": ["--prefill", "1", "--decode", "1"]}
LIVE_RUNS = ("calibration", "A", "B")  # in the order they run


def run_live_cluster(args: argparse.Namespace, cluster: str, requests: list[WorkloadRequest],
                     step_log_dir: Path) -> list[RequestRecord]:
    server = start_server(args, args.policy, POOL_FLAGS[cluster], ["--step-log-dir", str(step_log_dir)])
    try:
        config = DriverConfig(url=server.url, model=discover_model(server.url), timeout_s=args.request_timeout_s)
        return run_live(requests, config)
    finally:
        stop_server(server)


def fit(args: argparse.Namespace, logs: Path, out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "kvbaton.cli", "profile", "--model", args.model, "--out", str(out),
                    "--dtype", args.dtype, "--from-step-log", *sorted(str(p) for p in logs.iterdir())], check=True, stdout=subprocess.DEVNULL)
    return out


def simulated(args: argparse.Namespace, cluster: str, requests: list[WorkloadRequest],
              coefficients: Path) -> list[RequestRecord]:
    return [record for seed in range(args.seed, args.seed + args.sim_seeds)
            for record in simulate(requests, SimSetup(
                model=args.model, cluster=cluster, policy=args.policy, cost_model=str(coefficients), seed=seed,
                num_blocks=args.num_blocks, max_num_batched_tokens=512, max_num_seqs=128)).records]


def host_drift(coefficients: Path, logs: dict[str, Path]) -> dict[str, float]:
    """Each run's median step time over what one fixed cost model predicts for the same shapes: how much the
    host's speed moved between runs (no simulation, no request outcome involved)."""
    model = load_linear_model(coefficients)
    drift = {}
    for run, folder in logs.items():
        ratios = [s.duration_s / model.step_s(s.shape) for s in read_step_samples(sorted(folder.iterdir()))
                  if model.step_s(s.shape) > 0]
        drift[run] = round(statistics.median(ratios), 3)
    return drift


def rows_json(rows: list[FidelityRow]) -> dict[str, object]:
    return {row.metric: {"live_s": row.live_s, "sim_s": row.sim_s, "error": row.error,
                         "within_target": row.within_target} for row in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--clusters", default="2xmixed,1P1D")
    parser.add_argument("--policy", default="round_robin")
    parser.add_argument("--threads-per-worker", type=int, default=1)
    parser.add_argument("--dtype", default="float32", help=DTYPE_HELP)
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--num-groups", type=int, default=4)
    parser.add_argument("--system-prompt-tokens", type=int, default=512)
    parser.add_argument("--question-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=24)
    parser.add_argument("--num-requests", type=int, default=120)
    parser.add_argument("--rate", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sim-seeds", type=int, default=5, help="step-noise seeds pooled per simulation")
    parser.add_argument("--workdir", default=None, help="live records and step logs (default: a new temp dir)")
    parser.add_argument("--skip-live", action="store_true", help="score the runs already in --workdir")
    parser.add_argument("--startup-timeout-s", type=float, default=240.0)
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    args = parser.parse_args()
    if args.skip_live and not args.workdir:
        parser.error("--skip-live needs --workdir")
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp())

    def trace(seed: int) -> list[WorkloadRequest]:
        return create_workload("shared-prefix", num_requests=args.num_requests, seed=seed, rate=args.rate,
                               num_groups=args.num_groups, system_prompt_tokens=args.system_prompt_tokens,
                               question_tokens=args.question_tokens, output_tokens=args.output_tokens)

    traces = {"calibration": trace(args.seed + 1000), "A": trace(args.seed), "B": trace(args.seed)}
    clusters = [c for c in args.clusters.split(",") if c]
    if not args.skip_live:
        for cluster in clusters:
            for run in LIVE_RUNS:
                logs = workdir / cluster / f"{run}-steps"
                logs.mkdir(parents=True, exist_ok=True)
                records = run_live_cluster(args, cluster, traces[run], logs)
                write_records(workdir / cluster / f"{run}.jsonl", records)
                print(f"{cluster} {run}: {len(records)} records", file=sys.stderr, flush=True)

    result: dict[str, object] = {"benchmark": "fidelity", "model": args.model, "dtype": args.dtype, "policy": args.policy,
                                 "num_requests": args.num_requests, "rate_rps": args.rate,
                                 "sim_seeds": args.sim_seeds, "workdir": str(workdir), "clusters": {}}
    for cluster in clusters:
        base = workdir / cluster
        live = {run: read_records(base / f"{run}.jsonl") for run in LIVE_RUNS}
        fits = {run: fit(args, base / f"{run}-steps", base / f"fit-{run}.json") for run in LIVE_RUNS}
        title = f"{cluster}, {args.policy}, {args.num_requests} requests at {args.rate} req/s"
        sim = {run: simulated(args, cluster, traces["A"], fits[run]) for run in LIVE_RUNS}
        comparisons = {  # name: (live reference, the other side, what it says)
            "held_out_B_to_A": (live["A"], sim["B"], "simulator fitted on run B's steps vs live run A"),
            "held_out_A_to_B": (live["B"], sim["A"], "simulator fitted on run A's steps vs live run B"),
            "calibration_to_A": (live["A"], sim["calibration"], "simulator fitted on the calibration run vs live A"),
            "calibration_to_B": (live["B"], sim["calibration"], "simulator fitted on the calibration run vs live B"),
            "in_run_fit_quality": (live["A"], sim["A"], "simulator fitted on run A's own steps vs run A"),
            "live_B_vs_A": (live["A"], live["B"], "live run B vs live run A (the host's own spread)"),
        }
        figures: dict[str, object] = {}
        for name, (reference, other, label) in comparisons.items():
            rows = compare_runs(reference, other)
            print(render_fidelity(rows, f"{title}: {label}"), file=sys.stderr)
            figures[name] = rows_json(rows)
        figures["host_step_time_vs_calibration"] = host_drift(base / "fit-calibration.json",
                                                              {run: base / f"{run}-steps" for run in LIVE_RUNS})
        print(f"{title}: median step time over the calibration fit's prediction: "
              f"{figures['host_step_time_vs_calibration']}", file=sys.stderr)
        result["clusters"][cluster] = figures  # type: ignore[index]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
