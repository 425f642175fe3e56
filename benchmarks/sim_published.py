"""Must-show 3: published results, qualitatively, on simulated GPUs.

A. Preble (Preble, ICLR'25): Preble-like workloads (tool-use, programming, agent) on 4 mixed workers
   (one A6000 each, Mistral-7B, roofline cost model) under preble, round_robin and longest_prefix.
   Preble reports 1.5-14.5x lower mean and 2-10x lower p99 latency than round-robin; locality-only
   routing shows the hotspot tail. Printed: mean / p99 end-to-end latency, hit ratio, and the ratios
   round_robin / preble and longest_prefix / preble, at each rate of --rates.
B. DistServe (OSDI'24): OPT-13B, ShareGPT-like chat lengths, A100 with DistServe's published cost
   coefficients, SLO TTFT 0.25 s / TPOT 0.1 s at 90 % attainment (its chatbot setting). Per-GPU
   goodput (the largest rate meeting both SLOs, found by bisection, divided by GPUs) of colocated
   workers (1xmixed) against disaggregated placements 1P1D and 2P1D (KV over NVLink, as DistServe
   places pairs within a node). Requests longer than OPT's 2,048-token context are dropped from the
   workload, as DistServe does. DistServe reports 2.0-4.6x higher per-GPU goodput for chatbots.
   --tpot-slo tightens the TPOT SLO, where prefill-decode interference starts to cost colocation.
Usage: python benchmarks/sim_published.py [--part A|B|both] [--num-requests 600]
"""

from __future__ import annotations

import argparse
import time

from kvbaton.bench.metrics import SLO, max_goodput_rate, summarize
from kvbaton.bench.workloads import create_workload
from kvbaton.sim.run import SimSetup, simulate

PREBLE_POLICIES = ("preble", "round_robin", "longest_prefix")
PREBLE_WORKLOADS = ("tool-use", "programming", "agent")
DISTSERVE_SLO = SLO(ttft_s=0.25, tpot_s=0.1)


def part_a(num_requests: int, rates: list[float]) -> None:
    print("A. Preble-like workloads, 4 x A6000, Mistral-7B (roofline); E2E latency in s")
    for workload in PREBLE_WORKLOADS:
        for rate in rates:
            requests = create_workload(workload, num_requests=num_requests, seed=0, rate=rate)
            figures = {}
            for policy in PREBLE_POLICIES:
                result = simulate(requests, SimSetup(model="mistral-7b", gpu="a6000", cluster="4xmixed", policy=policy))
                o = summarize(result.records).overall
                busy = [w.busy_s for w in result.workers]
                figures[policy] = (o.e2e.mean_s, o.e2e.p99_s, o.cache_hit_ratio or 0.0, max(busy) / (sum(busy) / 4))
            pre = figures["preble"]
            cells = "  ".join(f"{p}: mean {m:.2f} p99 {p99:.2f} hit {100 * h:.0f}% busiest/avg {b:.2f}"
                              for p, (m, p99, h, b) in figures.items())
            rr, lp = figures["round_robin"], figures["longest_prefix"]
            print(f"  {workload} @ {rate:g} req/s: {cells}")
            print(f"    round_robin/preble mean {rr[0] / pre[0]:.2f}x p99 {rr[1] / pre[1]:.2f}x; "
                  f"longest_prefix/preble mean {lp[0] / pre[0]:.2f}x p99 {lp[1] / pre[1]:.2f}x")


def part_b(num_requests: int, slo: SLO) -> None:
    print(f"B. DistServe OPT-13B ShareGPT-like on A100 (published coefficients), SLO TTFT "
          f"{slo.ttft_s} s TPOT {slo.tpot_s} s, 90 % attainment")
    base = [r for r in create_workload("sharegpt-like", num_requests=num_requests * 2, seed=0, rate=1.0)
            if r.num_prompt_tokens + r.output_tokens <= 2048][:num_requests]
    per_gpu = {}
    for cluster in ("1xmixed", "1P1D:link=nvlink-a100", "2P1D:link=nvlink-a100"):
        setup = SimSetup(model="opt-13b", gpu="a100", cluster=cluster, cost_model="distserve", policy="round_robin",
                         max_model_len=2048)

        def run_at(rate: float):  # noqa: ANN202 - records
            scaled = [type(r)(r.index, r.arrival_s / rate, r.prompt_parts, r.output_tokens) for r in base]
            return simulate(scaled, setup).records

        started = time.process_time()
        search = max_goodput_rate(run_at, slo, attainment=0.9, low=0.25, high=64.0, tol=0.1)
        num_gpus = 3 if cluster.startswith("2P1D") else (2 if cluster.startswith("1P1D") else 1)
        per_gpu[cluster] = search.rate_rps / num_gpus
        print(f"  {cluster:<22} goodput {search.rate_rps:6.2f} req/s on {num_gpus} GPU(s) = "
              f"{per_gpu[cluster]:.2f} req/s per GPU ({len(search.probes)} probes, "
              f"{time.process_time() - started:.0f} CPU-s)")
    colocated = per_gpu["1xmixed"]
    for cluster, value in per_gpu.items():
        if cluster != "1xmixed":
            print(f"  {cluster} / colocated per-GPU goodput: {value / colocated:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("A", "B", "both"), default="both")
    parser.add_argument("--num-requests", type=int, default=600)
    parser.add_argument("--rates", default="12,24", help="Part A request rates, comma-separated")
    parser.add_argument("--tpot-slo", type=float, default=DISTSERVE_SLO.tpot_s, help="Part B TPOT SLO (s)")
    args = parser.parse_args()
    if args.part in ("A", "both"):
        part_a(args.num_requests, [float(x) for x in args.rates.split(",")])
    if args.part in ("B", "both"):
        part_b(args.num_requests, SLO(DISTSERVE_SLO.ttft_s, args.tpot_slo))


if __name__ == "__main__":
    main()
