"""Must-show 3 (issue 7), simulated: a prompt/output mix that shifts, with and without adaptive pools.

A disaggregated unit sized for long prompts (three prefill workers, one decode worker: Llama-3-8B on
A100s, roofline) serves the `shifting-mix` workload: long prompts with short outputs, then (from
`--shift-fraction` of the requests on) short prompts with long outputs, at one Poisson rate. With
fixed roles the single decode worker falls behind after the shift and SLO attainment collapses;
with adaptive pools (`kvbaton.router.pools`) the router lends idle prefill workers to mixed duty and
sends them whole requests while decode queues, so attainment recovers. The table is SLO attainment
(both TTFT and TPOT met) per tenth of the arrival window, then per phase, for both runs; the JSON
line has the phase-2 attainment of each, the ratio, and the role switches made.

    .venv/bin/python benchmarks/adaptive_pools.py [--rate 24] [--num-requests 1500]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence

from kvbaton.bench.metrics import SLO, summarize
from kvbaton.bench.records import RequestRecord
from kvbaton.bench.workloads import create_workload
from kvbaton.bench.workloads.base import WorkloadRequest
from kvbaton.router.pools import PoolConfig
from kvbaton.sim.run import SimSetup, build_sim


def attainment_by_window(requests: Sequence[WorkloadRequest], records: dict[str, RequestRecord], slo: SLO,
                         num_windows: int) -> list[float | None]:
    end_s = max(r.arrival_s for r in requests)
    windows: list[list[RequestRecord]] = [[] for _ in range(num_windows)]
    for request in requests:
        index = min(int(request.arrival_s / end_s * num_windows), num_windows - 1)
        windows[index].append(records[request.request_id])
    return [summarize(w, slo).overall.slo_attainment if w else None for w in windows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=24.0)
    parser.add_argument("--num-requests", type=int, default=1500)
    parser.add_argument("--shift-fraction", type=float, default=0.3)
    parser.add_argument("--second-output-mean", type=int, default=800)
    parser.add_argument("--cluster", default="3P1D")
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--gpu", default="a100")
    parser.add_argument("--ttft-slo", type=float, default=1.0)
    parser.add_argument("--tpot-slo", type=float, default=0.02)
    parser.add_argument("--max-lent-per-pool", type=int, default=2)
    parser.add_argument("--windows", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    slo = SLO(args.ttft_slo, args.tpot_slo)
    requests = create_workload("shifting-mix", num_requests=args.num_requests, seed=args.seed, rate=args.rate,
                               shift_fraction=args.shift_fraction,
                               second_output_mean_tokens=args.second_output_mean)
    results: dict[str, dict[str, object]] = {}
    for name, adaptive in (("fixed", False), ("adaptive", True)):
        setup = SimSetup(model=args.model, gpu=args.gpu, cluster=args.cluster, cost_model="roofline",
                         enable_prefix_cache=False, seed=args.seed, admission_slo=(slo.ttft_s, slo.tpot_s),
                         adaptive_pools=adaptive, pools=PoolConfig(max_lent_per_pool=args.max_lent_per_pool))
        started = time.process_time()
        sim, _, _ = build_sim(setup)
        records = {r.request_id: r for r in sim.run(requests)}
        phases = {phase: summarize([records[q.request_id] for q in requests if q.group == phase], slo)
                  for phase in ("phase1", "phase2")}
        results[name] = {
            "windows": attainment_by_window(requests, records, slo, args.windows),
            "phase1": phases["phase1"].overall.slo_attainment, "phase2": phases["phase2"].overall.slo_attainment,
            "phase2_ttft_p99_s": phases["phase2"].overall.ttft.p99_s,
            "phase2_tpot_p50_s": phases["phase2"].overall.tpot.p50_s,
            "switches": [] if sim.pools is None else [
                {"at_s": round(s.at_s, 2), "worker": s.worker_id, "lent": s.lent} for s in sim.pools.switches],
            "cpu_s": round(time.process_time() - started, 2),
        }
    print(f"SLO attainment per tenth of the arrival window ({args.cluster}, {args.model} on {args.gpu}, "
          f"{args.rate:g} req/s, shift at {args.shift_fraction:.0%} of {args.num_requests} requests)")
    for name, row in results.items():
        windows = " ".join("  -  " if a is None else f"{a:5.2f}" for a in row["windows"])  # type: ignore[union-attr]
        print(f"{name:<9} {windows}   phase1 {row['phase1']:.2f}  phase2 {row['phase2']:.2f}")
    for switch in results["adaptive"]["switches"]:  # type: ignore[union-attr]
        print(f"  at {switch['at_s']:7.2f} s: {switch['worker']} {'lent to mixed duty' if switch['lent'] else 'returned'}")
    fixed, adaptive = results["fixed"]["phase2"], results["adaptive"]["phase2"]
    print(json.dumps({"benchmark": "adaptive_pools", "rate_rps": args.rate, "cluster": args.cluster,
                      "phase2_attainment_fixed": fixed, "phase2_attainment_adaptive": adaptive,
                      "phase2_attainment_ratio": round(adaptive / fixed, 2) if fixed else None, "runs": results}))


if __name__ == "__main__":
    main()
