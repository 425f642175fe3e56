"""`kvbaton plan`: the placement search from the command line (text, `--json`, or a report directory).

`kvbaton.cli` registers the subcommand with `add_plan_arguments` and calls `run_plan`. Example:
  kvbaton plan --model opt-13b --gpu a100 --num-gpus 4 --ttft-slo 0.2 --tpot-slo 0.1 \\
      --attainment 0.9 --workload sharegpt-like --json
`--cost-model auto` picks DistServe's published A100 coefficients when they cover the model
(OPT-13B/66B on a100), else the roofline model of the catalog GPU.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from kvbaton.core.errors import InvalidRequestError

if TYPE_CHECKING:
    from kvbaton.plan.planner import PlanRequest

PLOT_NAME = "goodput_vs_rate.png"


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    from kvbaton.plan.placements import AFFINITIES
    from kvbaton.sim.catalog import GPUS, MODELS

    parser.add_argument("--model", required=True, help=f"catalog model: {', '.join(MODELS)}")
    parser.add_argument("--gpu", required=True, help=f"catalog GPU: {', '.join(GPUS)}")
    parser.add_argument("--num-gpus", type=int, required=True, help="GPUs available in all")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (NVLink domain)")
    parser.add_argument("--ttft-slo", type=float, required=True, help="TTFT SLO in seconds")
    parser.add_argument("--tpot-slo", type=float, required=True, help="TPOT SLO in seconds")
    parser.add_argument("--attainment", type=float, default=0.9, help="fraction of requests meeting the SLOs")
    parser.add_argument("--joint", action="store_true",
                        help="require both SLOs on the same requests (default: each SLO separately, as DistServe)")
    parser.add_argument("--workload", default="sharegpt-like", help="workload family (kvbaton bench --list)")
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="workload parameter")
    parser.add_argument("--num-requests", type=int, default=300, help="requests per simulated probe")
    parser.add_argument("--affinity", choices=AFFINITIES, default="low",
                        help="low: node-constrained pairs (DistServe Alg. 2); high: per-phase (Alg. 1)")
    parser.add_argument("--max-pp", type=int, default=1, help="largest pipeline degree searched")
    parser.add_argument("--cost-model", default="auto", help="auto | roofline | distserve | FILE.json")
    parser.add_argument("--chunk-tokens", type=int, default=512, help="chunked-prefill budget of colocated workers")
    parser.add_argument("--rate-step", type=float, default=0.05, help="per-GPU rate resolution of the bisection")
    parser.add_argument("--max-rate", type=float, default=80.0, help="per-GPU rate limit of the search")
    parser.add_argument("--first-ceiling", type=float, default=5.0,
                        help="first per-GPU bracket top of the bisection, doubled while met (DistServe: 5)")
    parser.add_argument("--rate", type=float, default=None, help="target req/s: how many units it takes")
    parser.add_argument("--processes", type=int, default=0, help="search processes (0: every core)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", metavar="DIR", help="write report.json, report.md and the goodput plot here")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _cost_model_name(name: str, model: str, gpu: str) -> str:
    if name != "auto":
        return name
    from kvbaton.sim.costs.linear import DISTSERVE_A100_PATH

    published = json.loads(DISTSERVE_A100_PATH.read_text()).get("models", {})
    return "distserve" if gpu == "a100" and model in published else "roofline"


def plan_request_from_args(args: argparse.Namespace) -> PlanRequest:
    from kvbaton.bench.cli import parse_params
    from kvbaton.bench.metrics import SLO
    from kvbaton.plan.goodput import SearchSettings
    from kvbaton.plan.planner import PlanRequest

    if args.num_gpus <= 0 or args.num_requests <= 0:
        raise InvalidRequestError("--num-gpus and --num-requests must be positive")
    if args.max_pp < 1 or args.processes < 0:
        raise InvalidRequestError(f"--max-pp must be at least 1 and --processes at least 0 (every core), got "
                                  f"{args.max_pp} and {args.processes}")
    if not all(math.isfinite(x) for x in (args.attainment, args.rate_step, args.max_rate, args.first_ceiling)):
        raise InvalidRequestError("--attainment, --rate-step, --max-rate and --first-ceiling must be finite numbers")
    settings = SearchSettings(SLO(args.ttft_slo, args.tpot_slo), args.attainment, args.joint, args.rate_step,
                              args.max_rate, min(args.first_ceiling, args.max_rate))
    params = parse_params(args.param)
    return PlanRequest(
        model=args.model, gpu=args.gpu, num_gpus=args.num_gpus, settings=settings, gpus_per_node=args.gpus_per_node,
        affinity=args.affinity, workload=args.workload, workload_params=tuple(sorted(params.items())),
        num_requests=args.num_requests, seed=args.seed,
        cost_model=_cost_model_name(args.cost_model, args.model, args.gpu), colocated_chunk_tokens=args.chunk_tokens,
        num_processes=args.processes, max_pp=args.max_pp)


def run_plan(args: argparse.Namespace) -> int:
    from kvbaton.plan.planner import GoodputPlanner
    from kvbaton.plan.report import plan_json, plan_text, plot_goodput

    if args.rate is not None and not (math.isfinite(args.rate) and args.rate > 0):
        raise InvalidRequestError(f"--rate must be a positive finite number, got {args.rate}")
    planner = GoodputPlanner(plan_request_from_args(args))
    plan = planner.run()
    payload = plan_json(plan, args.rate)
    text = plan_text(plan, args.rate)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        shown = [c for c in (plan.best_disaggregated, plan.best_colocated) if c is not None]
        top_rps = max(c.result.per_gpu_rps for c in shown) or args.rate_step
        # 4 significant digits, not decimals: a goodput under ~0.0002 req/s would otherwise sweep rate 0
        rates = [float(f"{top_rps * f:.4g}") for f in (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5)]
        curves = planner.sweep([c.placement for c in shown], rates)
        plot_goodput(out / PLOT_NAME, [(c.placement.label, curve) for c, curve in zip(shown, curves)],
                     plan.request.settings.attainment)
        payload["curves"] = {c.placement.label: [list(point) for point in curve] for c, curve in zip(shown, curves)}
        (out / "report.json").write_text(json.dumps({**payload, "search_s": round(plan.search_s, 3)}, indent=2) + "\n")
        (out / "report.md").write_text(f"# kvbaton plan\n\n```\n{text}\n```\n\n![goodput vs rate]({PLOT_NAME})\n")
    if args.json:
        print(json.dumps(payload))
    else:
        print(text)
        if args.out:
            print(f"report: {args.out}/report.md")
    return 0
