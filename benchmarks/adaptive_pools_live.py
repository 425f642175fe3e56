"""Must-show 3 (issue 7), live: the shifting mix on a 1P+1D SmolLM2 cluster on this CPU, fixed roles vs adaptive.

Two fresh `kvbaton serve --prefill 1 --decode 1` clusters (one torch thread per worker) serve the same
`shifting-mix` requests — long prompts with short outputs, then short prompts with long outputs —
through the live driver: one with fixed roles, one with `--adaptive-pools` (the router lends the idle
prefill worker to mixed duty while the decode worker queues). The cost profile both the balancer and
the report's SLO use is measured first by `kvbaton profile --quick --threads 1` unless `--profile FILE`
is given. Printed: SLO attainment per phase and per fifth of the arrival window, TPOT p50 of phase 2,
and how many calls the lent worker took whole (the router's `pool_lent` decisions, from /cluster).

    .venv/bin/python benchmarks/adaptive_pools_live.py [--num-requests 80] [--rate 1.0]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from adaptive_pools import attainment_by_window  # noqa: E402
from admission_live import profile  # noqa: E402
from routing_live import start_server, stop_server  # noqa: E402

from kvbaton.bench.driver import DriverConfig, discover_model, run_live  # noqa: E402
from kvbaton.bench.metrics import SLO, summarize  # noqa: E402
from kvbaton.bench.workloads import create_workload  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-requests", type=int, default=80)
    parser.add_argument("--rate", type=float, default=1.0)
    parser.add_argument("--shift-fraction", type=float, default=0.4)
    parser.add_argument("--first-prompt-mean", type=float, default=600)
    parser.add_argument("--first-output-mean", type=float, default=8)
    parser.add_argument("--second-prompt-mean", type=float, default=60)
    parser.add_argument("--second-output-mean", type=float, default=120)
    parser.add_argument("--ttft-slo", type=float, default=2.0)
    parser.add_argument("--tpot-slo", type=float, default=0.1)
    parser.add_argument("--profile", default="", help="a `kvbaton profile` file (default: measure one first)")
    parser.add_argument("--threads-per-worker", type=int, default=1)
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("--request-timeout-s", type=float, default=600.0)
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    slo = SLO(args.ttft_slo, args.tpot_slo)
    requests = create_workload(
        "shifting-mix", num_requests=args.num_requests, seed=args.seed, rate=args.rate,
        shift_fraction=args.shift_fraction, first_prompt_mean_tokens=args.first_prompt_mean,
        first_output_mean_tokens=args.first_output_mean, second_prompt_mean_tokens=args.second_prompt_mean,
        second_output_mean_tokens=args.second_output_mean)
    results: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        profile_path = Path(args.profile) if args.profile else Path(tmp) / "profile.json"
        if not args.profile:
            profile(args, profile_path)
        for name in ("fixed", "adaptive"):
            extra = (["--adaptive-pools", "--ttft-slo", str(args.ttft_slo), "--tpot-slo", str(args.tpot_slo),
                      "--cost-profile", str(profile_path)] if name == "adaptive" else [])
            server = start_server(args, "round_robin", ["--prefill", "1", "--decode", "1"], extra)
            try:
                config = DriverConfig(url=server.url, model=discover_model(server.url),
                                      timeout_s=args.request_timeout_s)
                records = {r.request_id: r for r in run_live(requests, config)}
                with urllib.request.urlopen(f"{server.url}/cluster", timeout=10.0) as response:
                    info = json.loads(response.read())
            finally:
                stop_server(server)
            phases = {p: summarize([records[q.request_id] for q in requests if q.group == p], slo)
                      for p in ("phase1", "phase2")}
            results[name] = {
                "phase1": phases["phase1"].overall.slo_attainment, "phase2": phases["phase2"].overall.slo_attainment,
                "phase2_tpot_p50_s": phases["phase2"].overall.tpot.p50_s,
                "phase2_ttft_p50_s": phases["phase2"].overall.ttft.p50_s,
                "windows": attainment_by_window(requests, records, slo, args.windows),
                "calls_on_lent_worker": info.get("router_decisions", {}).get("pool_lent", 0),
                "pool_switches": info.get("pool_switches", 0),
                "failed": sum(r.status != "completed" for r in records.values()),
            }
    for name, row in results.items():
        windows = " ".join("  -  " if a is None else f"{a:5.2f}" for a in row["windows"])  # type: ignore[union-attr]
        print(f"{name:<9} {windows}   phase1 {row['phase1']:.2f}  phase2 {row['phase2']:.2f}  "
              f"phase2 TPOT p50 {row['phase2_tpot_p50_s']:.3f} s  whole on lent worker {row['calls_on_lent_worker']}")
    fixed, adaptive = results["fixed"]["phase2"], results["adaptive"]["phase2"]
    print(json.dumps({"benchmark": "adaptive_pools_live", "rate_rps": args.rate, "num_requests": args.num_requests,
                      "phase2_attainment_fixed": fixed, "phase2_attainment_adaptive": adaptive,
                      "phase2_attainment_ratio": round(adaptive / fixed, 2) if fixed else None, "runs": results}))


if __name__ == "__main__":
    main()
