"""Splitwise's study in the simulator: H100 prompt machines and A100 (or power-capped H100) token machines against
homogeneous H100 and A100 fleets, at equal cost and at equal power. Prints one JSON line.

After Patel et al., "Splitwise: efficient generative LLM inference using phase splitting" (ISCA'24): Llama-2-70B
served by 8-GPU machines (DGX-A100, DGX-H100; one tp=8 worker per machine here), on their two production
length mixes — coding (median prompt 1,500 tokens, output 13) and conversation (prompt 1,020, output 129),
re-created as log-normal lengths around those medians (`MIXES`; Splitwise's Azure traces are not bundled).
Designs (Splitwise's names):
  baseline-h100 / baseline-a100   every machine serves both phases (colocated, a prompt per step)
  splitwise-hh / splitwise-aa     H100 (A100) prompt machines, H100 (A100) token machines
  splitwise-ha                    H100 prompt machines, A100 token machines
  splitwise-hhcap                 H100 prompt machines, H100 token machines power-capped to `--cap` of TDP
Budgets: equal cost — what `--machines` DGX-H100s cost per hour (default table: CoreWeave's on-demand list,
`kvbaton.sim.hardware`; Splitwise's $38 and $17.6 per machine-hour); equal power — their TDP (700 W x 8).
Each design takes every prompt/token split the budget fills (`kvbaton.plan.fleets.enumerate_fleets`); its
figure is its best split's goodput: the largest request rate at which `--attainment` of the requests meet
the TTFT and the TPOT SLO each (`kvbaton.plan.goodput`, Poisson arrivals), each probe lasting
`--min-probe-s` at least (at a fleet's rates a few hundred requests are one burst, over before queues build).
Ratios are to baseline-h100 under the same budget: throughput, cost per hour, power, and cost and power per
unit of throughput.
Usage: python benchmarks/splitwise.py [--machines 4] [--num-requests 300] [--cap 0.7]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from kvbaton.bench.metrics import SLO
from kvbaton.plan.fleet_planner import FleetPlanner, FleetRequest
from kvbaton.plan.fleets import Budget, Fleet, fleet_bound_rps
from kvbaton.plan.goodput import SearchSettings, search_goodput
from kvbaton.plan.planner import search_requests
from kvbaton.sim.catalog import get_gpu
from kvbaton.sim.hardware import load_prices

MODEL = "llama-2-70b"
GPUS_PER_MACHINE = 8
# Splitwise Fig. 3 medians; spreads are ours (log-normal, std as given).
MIXES: dict[str, dict[str, float]] = {
    "coding": {"prompt_mean_tokens": 1500, "prompt_std_tokens": 900, "output_mean_tokens": 13,
               "output_std_tokens": 10},
    "conversation": {"prompt_mean_tokens": 1020, "prompt_std_tokens": 700, "output_mean_tokens": 129,
                     "output_std_tokens": 100},
}
DESIGNS = ("baseline-h100", "baseline-a100", "splitwise-hh", "splitwise-aa", "splitwise-ha", "splitwise-hhcap")
PUBLISHED = {"throughput_at_20pct_lower_cost": 1.4, "throughput_at_same_cost_and_power": 2.35,
             "source": "Patel et al., ISCA'24, abstract: up to 1.4x throughput at 20 % lower cost, or 2.35x "
                       "throughput under the same cost and power budgets"}


def design_of(fleet: Fleet, cap: float) -> str | None:
    """Which of Splitwise's designs a fleet of whole machines is, or None (another split, e.g. A100 prompts)."""
    if any(pool.tp != GPUS_PER_MACHINE for pool in fleet.pools):
        return None
    if fleet.colocated is not None:
        return f"baseline-{fleet.colocated.gpu}" if fleet.colocated.cap == 1.0 else None
    p, d = fleet.prefill, fleet.decode
    assert p is not None and d is not None
    kinds = {("h100", "h100", 1.0): "splitwise-hh", ("a100", "a100", 1.0): "splitwise-aa",
             ("h100", "a100", 1.0): "splitwise-ha", ("h100", "h100", cap): "splitwise-hhcap"}
    return kinds.get((p.gpu, d.gpu, d.cap)) if p.cap == 1.0 else None


def study(mix: str, budget: Budget, args: argparse.Namespace) -> dict[str, Any]:
    settings = SearchSettings(SLO(args.ttft_slo, args.tpot_slo), args.attainment, step_rps=args.rate_step,
                              max_per_gpu_rps=20.0, ceiling_rps=1.0, min_probe_s=args.min_probe_s)
    request = FleetRequest(MODEL, ("h100", "a100"), budget, settings, decode_caps=(1.0, args.cap),
                           max_tp=GPUS_PER_MACHINE, workload="sharegpt-like",
                           workload_params=tuple(sorted(MIXES[mix].items())), num_requests=args.num_requests,
                           seed=args.seed, colocated_chunk_tokens=2048, num_processes=1)
    planner = FleetPlanner(request)
    requests = search_requests(request.workload, request.workload_params, request.num_requests, request.seed,
                               planner.max_model_len)
    by_design: dict[str, list[Fleet]] = {d: [] for d in DESIGNS}
    for fleet in planner.fleets():
        design = design_of(fleet, args.cap)
        if design is not None:
            by_design[design].append(fleet)
    prompt_p90 = sorted(r.num_prompt_tokens for r in requests)[int(0.9 * (len(requests) - 1))]
    output_mean = sum(r.output_tokens for r in requests) / len(requests)
    out: dict[str, Any] = {}
    for design, fleets in by_design.items():
        best: tuple[float, Fleet] | None = None
        bounds = {f: fleet_bound_rps(f, planner.cost_models, prompt_p90, output_mean, args.ttft_slo) for f in fleets}
        # each design's splits, best guess first, pruned only by that design's best so far
        for fleet in sorted(fleets, key=lambda f: -bounds[f]):
            floor_rps = best[0] / fleet.num_gpus if best else 0.0
            result = search_goodput(requests, planner.setup_for(fleet), fleet.num_gpus, settings, floor_rps)
            goodput = float(f"{result.per_gpu_rps * fleet.num_gpus:.12g}")
            if not result.pruned and (best is None or goodput > best[0]):
                best = (goodput, fleet)
        if best is None:
            continue
        goodput, fleet = best
        price, power = fleet.price_per_hour(planner.prices), fleet.power_kw
        out[design] = {"fleet": fleet.label, "cluster": fleet.cluster_spec, "num_machines": fleet.num_gpus // 8,
                       "goodput_rps": goodput, "price_per_hour": round(price, 2), "power_kw": round(power, 3),
                       "goodput_per_dollar_hour": round(goodput / price, 4),
                       "goodput_per_kw": round(goodput / power, 4),
                       "num_splits_searched": len(fleets)}
        print(f"  {mix:<12} {design:<16} {fleet.label:<44} {goodput:7.2f} req/s  ${price:7.2f}/h  {power:6.2f} kW",
              file=sys.stderr)
    base = out.get("baseline-h100")
    ratios = {}
    if base and base["goodput_rps"] > 0:
        for design, row in out.items():
            throughput = row["goodput_rps"] / base["goodput_rps"]
            ratios[design] = {
                "throughput": round(throughput, 3), "cost": round(row["price_per_hour"] / base["price_per_hour"], 3),
                "power": round(row["power_kw"] / base["power_kw"], 3),
                "cost_per_throughput": round(row["price_per_hour"] / base["price_per_hour"] / throughput, 3)
                if throughput > 0 else None,
                "power_per_throughput": round(row["power_kw"] / base["power_kw"] / throughput, 3)
                if throughput > 0 else None}
    return {"designs": out, "ratios_to_baseline_h100": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--machines", type=int, default=4, help="DGX-H100 machines the budgets are set by")
    parser.add_argument("--num-requests", type=int, default=300, help="requests per simulated probe")
    parser.add_argument("--cap", type=float, default=0.7, help="power cap of splitwise-hhcap's token machines")
    parser.add_argument("--ttft-slo", type=float, default=1.0)
    parser.add_argument("--tpot-slo", type=float, default=0.05)
    parser.add_argument("--attainment", type=float, default=0.9)
    parser.add_argument("--rate-step", type=float, default=0.02, help="per-GPU rate resolution (req/s)")
    parser.add_argument("--min-probe-s", type=float, default=20.0,
                        help="each probe's arrivals last this long at least (the mix repeated)")
    parser.add_argument("--mix", choices=(*MIXES, "both"), default="both")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    started = time.process_time()
    prices = load_prices(None)
    h100_machines = args.machines * GPUS_PER_MACHINE
    budgets = {"equal_cost": Budget(per_hour=h100_machines * prices["h100"]),
               "equal_power": Budget(power_kw=h100_machines * get_gpu("h100").tdp_w / 1e3)}
    mixes = list(MIXES) if args.mix == "both" else [args.mix]
    results = {mix: {name: study(mix, budget, args) for name, budget in budgets.items()} for mix in mixes}
    print(json.dumps({
        "benchmark": "splitwise", "model": MODEL,
        "machine": f"{GPUS_PER_MACHINE} GPUs, one tp={GPUS_PER_MACHINE} worker",
        "cost_model": "roofline", "baseline_machines": args.machines, "power_cap": args.cap,
        "budgets": {"equal_cost_per_hour": round(budgets["equal_cost"].per_hour or 0, 2),
                    "equal_power_kw": budgets["equal_power"].power_kw},
        "prices_per_gpu_hour": {g: prices[g] for g in ("h100", "a100")},
        "slo": {"ttft_s": args.ttft_slo, "tpot_s": args.tpot_slo, "attainment": args.attainment},
        "mixes": {m: MIXES[m] for m in mixes}, "num_requests": args.num_requests, "min_probe_s": args.min_probe_s,
        "seed": args.seed,
        "results": results, "splitwise_published": PUBLISHED, "cpu_s": round(time.process_time() - started, 1)}))


if __name__ == "__main__":
    main()
