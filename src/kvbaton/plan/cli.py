"""`kvbaton plan`: the placement search from the command line (text, `--json`, or a report directory).

`kvbaton.cli` registers the subcommand with `add_plan_arguments` and calls `run_plan`. Example:
  kvbaton plan --model opt-13b --gpu a100 --num-gpus 4 --ttft-slo 0.2 --tpot-slo 0.1 \\
      --attainment 0.9 --workload sharegpt-like --json
`--cost-model auto` picks DistServe's published A100 coefficients when they cover the model
(OPT-13B/66B on a100), else the roofline model of the catalog GPU.

With `--gpus` it searches hardware instead (`kvbaton.plan.fleet_planner`): every fleet of those GPUs (per
phase, decode pools also under each `--decode-caps` power cap) a budget buys, e.g.
  kvbaton plan --model llama-2-70b --gpus h100,a100 --budget-per-hour 80 --ttft-slo 1 --tpot-slo 0.1 --json
reporting each fleet's goodput, per GPU, per dollar-hour and per kW, the best under the budget and the best
homogeneous fleet beside it. `--prices FILE` overrides the default GPU price table (`kvbaton.sim.hardware`).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from kvbaton.core.errors import InvalidRequestError

if TYPE_CHECKING:
    from kvbaton.plan.fleet_planner import FleetRequest
    from kvbaton.plan.planner import PlanRequest

PLOT_NAME = "goodput_vs_rate.png"
HARDWARE_MIN_PROBE_S = 30.0


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    from kvbaton.plan.placements import AFFINITIES
    from kvbaton.sim.catalog import GPUS, MODELS

    parser.add_argument("--model", required=True, help=f"catalog model: {', '.join(MODELS)}")
    parser.add_argument("--gpu", help=f"catalog GPU: {', '.join(GPUS)} (placement search)")
    parser.add_argument("--num-gpus", type=int, help="GPUs available in all (placement search)")
    parser.add_argument("--gpus", help="comma-separated catalog GPUs: search fleets of them under a budget instead")
    parser.add_argument("--budget-per-hour", type=float, help="hardware search: USD per hour for all GPUs")
    parser.add_argument("--power-budget-kw", type=float, help="hardware search: kW for all GPUs (TDP x cap)")
    parser.add_argument("--decode-caps", default="1", help="hardware search: power caps tried for decode pools, "
                                                          "fractions of TDP in (0, 1], comma-separated")
    parser.add_argument("--prices", metavar="FILE", help='hardware search: {"prices_per_gpu_hour": {"h100": 4.0}}')
    parser.add_argument("--max-tp", type=int, default=8, help="hardware search: largest tensor degree of a worker")
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
    parser.add_argument("--min-probe-s", type=float, default=None,
                        help="a probe's arrivals last at least this long, the mix repeated (default: 0, the mix as "
                             f"it is; the hardware search: {HARDWARE_MIN_PROBE_S:g} s, since fleets run at high rates)")
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

    if args.gpu is None or args.num_gpus is None:
        raise InvalidRequestError("give --gpu and --num-gpus (placement search) or --gpus and a budget (hardware)")
    if args.num_gpus <= 0 or args.num_requests <= 0:
        raise InvalidRequestError("--num-gpus and --num-requests must be positive")
    if args.max_pp < 1 or args.processes < 0:
        raise InvalidRequestError(f"--max-pp must be at least 1 and --processes at least 0 (every core), got "
                                  f"{args.max_pp} and {args.processes}")
    if not all(math.isfinite(x) for x in (args.attainment, args.rate_step, args.max_rate, args.first_ceiling)):
        raise InvalidRequestError("--attainment, --rate-step, --max-rate and --first-ceiling must be finite numbers")
    settings = SearchSettings(SLO(args.ttft_slo, args.tpot_slo), args.attainment, args.joint, args.rate_step,
                              args.max_rate, min(args.first_ceiling, args.max_rate), args.min_probe_s or 0.0)
    params = parse_params(args.param)
    return PlanRequest(
        model=args.model, gpu=args.gpu, num_gpus=args.num_gpus, settings=settings, gpus_per_node=args.gpus_per_node,
        affinity=args.affinity, workload=args.workload, workload_params=tuple(sorted(params.items())),
        num_requests=args.num_requests, seed=args.seed,
        cost_model=_cost_model_name(args.cost_model, args.model, args.gpu), colocated_chunk_tokens=args.chunk_tokens,
        num_processes=args.processes, max_pp=args.max_pp)


def fleet_request_from_args(args: argparse.Namespace) -> FleetRequest:
    from kvbaton.bench.cli import parse_params
    from kvbaton.bench.metrics import SLO
    from kvbaton.plan.fleet_planner import FleetRequest
    from kvbaton.plan.fleets import Budget
    from kvbaton.plan.goodput import SearchSettings
    from kvbaton.sim.catalog import get_gpu
    from kvbaton.sim.hardware import check_cap, load_prices

    if args.gpu is not None or args.num_gpus is not None:
        raise InvalidRequestError("--gpus searches fleets under a budget: leave out --gpu and --num-gpus")
    gpus = tuple(dict.fromkeys(g.strip() for g in args.gpus.split(",") if g.strip()))
    for gpu in gpus:
        get_gpu(gpu)
    try:
        caps = tuple(dict.fromkeys(float(c) for c in args.decode_caps.split(",") if c.strip()))
    except ValueError:
        raise InvalidRequestError(f"--decode-caps expects numbers in (0, 1], got {args.decode_caps!r}") from None
    for cap in caps:
        check_cap(cap)
    if args.num_requests <= 0 or args.max_tp < 1 or args.processes < 0:
        raise InvalidRequestError("--num-requests and --max-tp must be positive, --processes at least 0")
    if not all(math.isfinite(x) for x in (args.attainment, args.rate_step, args.max_rate, args.first_ceiling)):
        raise InvalidRequestError("--attainment, --rate-step, --max-rate and --first-ceiling must be finite numbers")
    if args.cost_model not in ("auto", "roofline"):
        raise InvalidRequestError("the hardware search prices each pool's GPU with the roofline model: "
                                  f"--cost-model {args.cost_model} does not apply")
    prices = load_prices(args.prices)
    min_probe_s = HARDWARE_MIN_PROBE_S if args.min_probe_s is None else args.min_probe_s
    settings = SearchSettings(SLO(args.ttft_slo, args.tpot_slo), args.attainment, args.joint, args.rate_step,
                              args.max_rate, min(args.first_ceiling, args.max_rate), min_probe_s)
    return FleetRequest(
        model=args.model, gpus=gpus, budget=Budget(args.budget_per_hour, args.power_budget_kw), settings=settings,
        decode_caps=caps or (1.0,), prices=tuple(sorted(prices.items())), max_tp=min(args.max_tp, args.gpus_per_node),
        workload=args.workload, workload_params=tuple(sorted(parse_params(args.param).items())),
        num_requests=args.num_requests, seed=args.seed, colocated_chunk_tokens=args.chunk_tokens,
        num_processes=args.processes)


def run_fleet_plan(args: argparse.Namespace) -> int:
    from kvbaton.plan.fleet_planner import FleetPlanner, fleet_plan_json, fleet_plan_text

    plan = FleetPlanner(fleet_request_from_args(args)).run()
    payload = fleet_plan_json(plan)
    text = fleet_plan_text(plan)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps({**payload, "search_s": round(plan.search_s, 3)}, indent=2) + "\n")
        (out / "report.md").write_text(f"# kvbaton plan (hardware)\n\n```\n{text}\n```\n")
    print(json.dumps(payload) if args.json else text)
    return 0


def run_plan(args: argparse.Namespace) -> int:
    from kvbaton.plan.planner import GoodputPlanner
    from kvbaton.plan.report import plan_json, plan_text, plot_goodput

    if args.gpus is not None:
        return run_fleet_plan(args)
    if args.budget_per_hour is not None or args.power_budget_kw is not None:
        raise InvalidRequestError("a budget applies to the hardware search: name the GPUs with --gpus")

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
