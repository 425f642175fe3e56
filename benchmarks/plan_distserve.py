"""DistServe's case three ways: its measured runs, kvbaton's simulator and planner, and DistServe's own simulator.

The case (DistServe's simulator README, OSDI'24 section 6): OPT-13B on one node of 4 x A100-80GB,
ShareGPT, TTFT 0.2 s / TPOT 0.1 s at 90 % each; DistServe picks prefill TP2 + decode TP1 (3 GPUs).

1. Measured (`data/distserve/measured_c21d11.json`, DistServe's own runs of that placement, copied
   from its repository's history with the license note in `data/distserve/NOTICE.md`): the same 300
   requests at 1.0 / 1.5 / 2.0 / 2.5 / 3.0 req/s per GPU, P90 TTFT and TPOT per run. The real system
   meets both SLOs at 1.0-2.0 and misses at 2.5: its goodput lies in [2.0, 2.5).
2. `kvbaton sim` on exactly those requests (lengths and measured arrival times), the planner's
   setup for that placement (`GoodputPlanner.setup_for`: DistServe's published A100 step costs as
   its simulator prices them since commit 4c68ed9, with its per-step overheads; KV pools sized from
   the GPUs' memory), P90 TTFT and TPOT beside the measured ones; target: within 10 % at every rate
   the real system passed. Then the simulated goodput on that trace (its arrivals rescaled, the
   planner's 0.05 req/s grid).
3. `kvbaton plan` (the `distserve-sharegpt` preset: DistServe's ShareGPT length mix, 300 requests
   per probe, Poisson arrivals) for `--seeds` seeds (each seed draws other requests and arrivals),
   so the figure does not hinge on one draw: each seed's best unit and the goodput of prefill TP2 +
   decode TP1, their median and range, beside the measured bracket.
4. With `--simdistserve PATH` (a checkout of LLMServe/DistServe; its simulator needs simpy, pandas
   and numpy from PyPI: `--simdistserve-python` names an interpreter that has them), DistServe's
   simulator (`simdistserve.benchmarks.simulate_dist`, one process per run) on the same requests:
   the measured trace at each rate, and each seed's planner requests on the same 0.05 grid (its own
   pass rule: P90 TTFT < 200 ms and P90 TPOT < 100 ms). Not run without the path.

Prints tables on stderr and one JSON line on stdout.

    python benchmarks/plan_distserve.py [--seeds 5] [--simdistserve ~/DistServe --simdistserve-python PY]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from kvbaton.bench.workloads.base import WorkloadRequest
from kvbaton.plan.cli import add_plan_arguments, plan_request_from_args
from kvbaton.plan.goodput import grid_rate, largest_passing, scaled, search_goodput
from kvbaton.plan.placements import Placement
from kvbaton.plan.planner import GoodputPlanner, plan_requests
from kvbaton.sim.run import simulate

MEASURED_PATH = Path(__file__).resolve().parent / "data" / "distserve" / "measured_c21d11.json"
TTFT_SLO_S, TPOT_SLO_S, PERCENTILE, NUM_GPUS = 0.2, 0.1, 0.9, 3
TARGET_ERROR = 0.10
Row = tuple[int, int, float, float, float]  # prompt tokens, output tokens, arrival s, TTFT ms, TPOT ms


def plan_argv(num_requests: int, seed: int, processes: int) -> list[str]:
    return ["--model", "opt-13b", "--gpu", "a100", "--num-gpus", "4", "--gpus-per-node", "4", "--ttft-slo",
            str(TTFT_SLO_S), "--tpot-slo", str(TPOT_SLO_S), "--attainment", str(PERCENTILE), "--workload",
            "distserve-sharegpt", "--cost-model", "distserve", "--num-requests", str(num_requests), "--seed",
            str(seed), "--processes", str(processes)]


def make_planner(num_requests: int, seed: int, processes: int) -> GoodputPlanner:
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return GoodputPlanner(plan_request_from_args(parser.parse_args(plan_argv(num_requests, seed, processes))))


def distserve_placement(planner: GoodputPlanner) -> Placement:
    return next(p for p in planner.placements() if p.disaggregated and p.prefill.tp == 2 and p.decode.tp == 1
                and p.prefill.pp == p.decode.pp == 1 and p.num_gpus == NUM_GPUS)


def measured_runs() -> dict[float, list[Row]]:
    runs = json.loads(MEASURED_PATH.read_text())["runs"]
    return {float(rate): [tuple(row) for row in run["requests"]] for rate, run in runs.items()}  # type: ignore[misc]


def trace_requests(lengths: Sequence[tuple[int, int]], arrivals_s: Sequence[float]) -> list[WorkloadRequest]:
    """The requests with distinct token ids (no prefix is shared: the case runs without a prefix cache)."""
    requests = []
    for i, ((prompt_tokens, output_tokens), arrival_s) in enumerate(zip(lengths, arrivals_s)):
        ids = ((np.arange(prompt_tokens, dtype=np.int64) + 2048 * i) % 50_000 + 4).astype(np.int32)
        ids.flags.writeable = False
        requests.append(WorkloadRequest(i, float(arrival_s), (ids,), int(output_tokens)))
    return requests


def p90_ms(values_s: Sequence[float]) -> float:
    return round(1e3 * float(np.quantile(np.asarray(values_s), PERCENTILE)), 1)  # numpy's default = pandas'


def simdistserve_p90s(checkout: Path, python: str, lengths: Sequence[tuple[int, int]],
                      arrivals_s: Sequence[float]) -> tuple[float, float]:
    """P90 TTFT and TPOT (ms) of DistServe's simulator, prefill TP2 + decode TP1, on these requests."""
    with tempfile.TemporaryDirectory() as tmp:
        workload, latency = Path(tmp) / "workload.json", Path(tmp) / "latency.csv"
        workload.write_text(json.dumps([{"prompt_len": p, "output_len": o, "start_time": a}
                                        for (p, o), a in zip(lengths, arrivals_s)]))
        subprocess.run([python, "-m", "simdistserve.benchmarks.simulate_dist", "--backend", "distserve",
                        "--model", "facebook/opt-13b", "--workload", str(workload), "--arrival", "custom",
                        "--N", str(len(lengths)), "--tp-prefill", "2", "--pp-prefill", "1", "--tp-decode", "1",
                        "--pp-decode", "1", "--output-request-latency", str(latency)],
                       cwd=checkout, env={"PYTHONPATH": str(checkout), "PATH": "/usr/bin:/bin"}, check=True,
                       stdout=subprocess.DEVNULL, timeout=600)
        header, *rows = latency.read_text().splitlines()
        columns = header.split(",")
        ttft = [float(r.split(",")[columns.index("first_token_latency")]) for r in rows]
        tpot = [float(r.split(",")[columns.index("tpot")]) for r in rows]
    return (round(float(np.quantile(ttft, PERCENTILE)), 1), round(float(np.quantile(tpot, PERCENTILE)), 1))


def grid_goodput(met_at: Callable[[float], bool], step_rps: float = 0.05) -> float:
    """The planner's search (largest passing rate on the 0.05 req/s-per-GPU grid) over any pass/fail test."""
    k, _, _ = largest_passing(lambda k: met_at(grid_rate(k, step_rps)), 0, round(5.0 / step_rps),
                              round(80.0 / step_rps))
    return grid_rate(k, step_rps)


def error(value: float, reference: float) -> float:
    return round((value - reference) / reference, 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="planner seeds (request and arrival draws)")
    parser.add_argument("--num-requests", type=int, default=300, help="requests per planner probe")
    parser.add_argument("--processes", type=int, default=0, help="planner processes (0: every core)")
    parser.add_argument("--simdistserve", type=Path, default=None, help="a checkout of LLMServe/DistServe")
    parser.add_argument("--simdistserve-python", default=sys.executable,
                        help="an interpreter with simdistserve's dependencies (simpy, pandas, numpy)")
    args = parser.parse_args()
    started = time.perf_counter()
    runs = measured_runs()
    planner = make_planner(args.num_requests, 0, args.processes)
    placement = distserve_placement(planner)
    setup, settings = planner.setup_for(placement), planner.request.settings
    lengths = [(r[0], r[1]) for r in runs[1.0]]
    assert all([(r[0], r[1]) for r in run] == lengths for run in runs.values()), "the runs share one request list"
    result: dict[str, object] = {"benchmark": "plan_distserve", "placement": placement.label,
                                 "cluster": placement.cluster_spec, "cost_model": planner.cost_model.name,
                                 "measured": "benchmarks/data/distserve/measured_c21d11.json", "seeds": args.seeds}

    rates: dict[str, object] = {}
    print(f"{'per GPU':>7} | {'P90 TTFT ms: real':>17} {'kvbaton':>8} {'err':>7} {'simdist':>8} | "
          f"{'P90 TPOT ms: real':>17} {'kvbaton':>8} {'err':>7} {'simdist':>8} | real met", file=sys.stderr)
    for rate, rows in runs.items():
        arrivals = [r[2] for r in rows]
        real = (p90_ms([r[3] / 1e3 for r in rows]), p90_ms([r[4] / 1e3 for r in rows]))
        records = simulate(trace_requests(lengths, arrivals), setup).records
        ours = (p90_ms([r.ttft_s or 0.0 for r in records]), p90_ms([r.tpot_s or 0.0 for r in records]))
        entry: dict[str, object] = {
            "measured_p90_ttft_ms": real[0], "measured_p90_tpot_ms": real[1],
            "measured_met": real[0] < 1e3 * TTFT_SLO_S and real[1] < 1e3 * TPOT_SLO_S,
            "kvbaton_p90_ttft_ms": ours[0], "kvbaton_p90_tpot_ms": ours[1],
            "kvbaton_ttft_error": error(ours[0], real[0]), "kvbaton_tpot_error": error(ours[1], real[1])}
        theirs = ("-", "-")
        if args.simdistserve is not None:
            theirs = simdistserve_p90s(args.simdistserve, args.simdistserve_python, lengths, arrivals)
            entry.update(simdistserve_p90_ttft_ms=theirs[0], simdistserve_p90_tpot_ms=theirs[1],
                         simdistserve_ttft_error=error(theirs[0], real[0]),
                         simdistserve_tpot_error=error(theirs[1], real[1]))
        rates[f"{rate:.1f}"] = entry
        print(f"{rate:>7.1f} | {real[0]:>17} {ours[0]:>8} {100 * entry['kvbaton_ttft_error']:>+6.1f}% "
              f"{theirs[0]:>8} | {real[1]:>17} {ours[1]:>8} {100 * entry['kvbaton_tpot_error']:>+6.1f}% "
              f"{theirs[1]:>8} | {entry['measured_met']}", file=sys.stderr)
    passed = [e for e in rates.values() if e["measured_met"]]  # type: ignore[index]
    result["rates_per_gpu"] = rates
    result["kvbaton_within_target_where_real_passed"] = all(
        abs(e[k]) <= TARGET_ERROR for e in passed for k in ("kvbaton_ttft_error", "kvbaton_tpot_error"))
    met_rates = [float(r) for r, e in rates.items() if e["measured_met"]]  # type: ignore[index]
    failed_above = [float(r) for r, e in rates.items() if not e["measured_met"] and float(r) > max(met_rates)]  # type: ignore[index]
    result["measured_goodput_bracket_per_gpu_rps"] = [max(met_rates), min(failed_above) if failed_above else None]

    # The measured trace's arrivals are one draw at rate 1.0 per GPU, rescaled for the other rates: as rate-1 times,
    # the planner's probes rescale them to any rate (and reproduce the measured runs at theirs).
    rate1_s = [a * NUM_GPUS * 1.0 for a in (r[2] for r in runs[1.0])]
    trace = trace_requests(lengths, rate1_s)
    result["kvbaton_goodput_on_measured_trace_per_gpu_rps"] = search_goodput(trace, setup, NUM_GPUS,
                                                                              settings).per_gpu_rps

    seeds: list[dict[str, object]] = []
    for seed in range(args.seeds):
        seed_started = time.perf_counter()
        seeded = make_planner(args.num_requests, seed, args.processes)
        plan = seeded.run()
        requests = plan_requests(seeded.request, seeded.max_model_len)
        unit = search_goodput(requests, seeded.setup_for(placement), NUM_GPUS, settings).per_gpu_rps
        figures: dict[str, object] = {"seed": seed, "best": plan.best.placement.label,
                                      "best_per_gpu_rps": plan.best.result.per_gpu_rps,
                                      "tp2_tp1_per_gpu_rps": unit}
        if args.simdistserve is not None:
            seed_lengths = [(r.num_prompt_tokens, r.output_tokens) for r in requests]

            def met(per_gpu_rps: float) -> bool:
                ttft, tpot = simdistserve_p90s(args.simdistserve, args.simdistserve_python, seed_lengths,
                                               [r.arrival_s for r in scaled(requests, per_gpu_rps * NUM_GPUS)])
                return ttft < 1e3 * TTFT_SLO_S and tpot < 1e3 * TPOT_SLO_S

            figures["simdistserve_tp2_tp1_per_gpu_rps"] = grid_goodput(met)
        figures["wall_s"] = round(time.perf_counter() - seed_started, 1)
        seeds.append(figures)
        print(f"seed {seed}: {figures}", file=sys.stderr, flush=True)
    result["planner_seeds"] = seeds
    for key in ("best_per_gpu_rps", "tp2_tp1_per_gpu_rps", "simdistserve_tp2_tp1_per_gpu_rps"):
        values = [float(s[key]) for s in seeds if key in s]  # type: ignore[arg-type]
        if values:
            result[f"{key}_median"] = statistics.median(values)
            result[f"{key}_range"] = [min(values), max(values)]
    if "simdistserve_tp2_tp1_per_gpu_rps_median" in result:
        result["ratio_kvbaton_over_simdistserve"] = round(
            float(result["tp2_tp1_per_gpu_rps_median"]) / float(result["simdistserve_tp2_tp1_per_gpu_rps_median"]), 3)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
