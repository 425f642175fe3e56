"""`kvbaton bench`: describe a workload (`--describe W`) or drive a live server with it (`--url U --workload W`).

The lead's `kvbaton.cli` registers the subcommand with `add_bench_arguments` and calls
`run_bench`. Errors meant for the user are raised as KvbatonError (one line, exit status 2).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from kvbaton.bench.tokens import DEFAULT_VOCAB_SIZE
from kvbaton.core.errors import InvalidRequestError, KvbatonError

# Which generator parameter --trace feeds, per workload.
_TRACE_PARAM = {"mooncake": "trace", "sharegpt-like": "sharegpt_path"}


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    from kvbaton.bench.arrivals import ARRIVALS
    from kvbaton.bench.workloads import WORKLOADS

    names = ", ".join(WORKLOADS)
    parser.add_argument("--describe", metavar="WORKLOAD", help=f"print a workload's statistics ({names})")
    parser.add_argument("--workload", metavar="W", help="workload to send to --url")
    parser.add_argument("--url", help="base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--api-key", default="", metavar="KEY", help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--rate", type=float, default=None, help="mean requests/s (default: the workload's)")
    parser.add_argument("--num-requests", type=int, default=None, help="requests to generate (default: the workload's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arrival", choices=ARRIVALS, default=None,
                        help="arrival process (default: poisson, or the trace's own times)")
    parser.add_argument("--cv", type=float, default=2.0, help="coefficient of variation for --arrival gamma")
    parser.add_argument("--on-s", type=float, default=5.0, help="burst length for --arrival on-off")
    parser.add_argument("--off-s", type=float, default=5.0, help="silence length for --arrival on-off")
    parser.add_argument("--trace", metavar="FILE",
                        help="Mooncake JSONL trace (mooncake) or ShareGPT JSON (sharegpt-like)")
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="workload parameter, e.g. --param num_groups=8 (repeatable; VALUE parsed as JSON)")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per-request timeout")
    parser.add_argument("--ttft-slo", type=float, default=None, help="TTFT SLO in seconds")
    parser.add_argument("--tpot-slo", type=float, default=None, help="TPOT SLO in seconds")
    parser.add_argument("--num-gpus", type=int, default=1, help="GPUs serving, for per-GPU goodput")
    parser.add_argument("--name", default=None, help="run name in the report (default: the workload)")
    parser.add_argument("--out", metavar="DIR", help="write report.json, report.md and plots here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def parse_params(items: list[str]) -> dict[str, Any]:
    """`KEY=VALUE` items as generator keyword parameters (VALUE parsed as JSON, else kept as a string)."""
    import inspect

    from kvbaton.bench.workloads import create_workload

    # create_workload's own arguments (seed, rate, arrival, ...) have options of their own (it refuses the names it
    # passes generators itself, RESERVED_PARAMS).
    reserved = set(inspect.signature(create_workload).parameters) - {"params"}
    params: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise InvalidRequestError(f"--param expects KEY=VALUE, got {item!r}")
        if key in reserved:
            raise InvalidRequestError(f"--param {key} is not a workload parameter: it has an option of its own")
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value
    return params


def _workload(args: argparse.Namespace, name: str) -> tuple[list, dict[str, Any]]:
    from kvbaton.bench.workloads import create_workload

    params = parse_params(args.param)
    if args.trace:
        if name not in _TRACE_PARAM:
            raise InvalidRequestError(f"--trace applies to {', '.join(_TRACE_PARAM)}, not {name}")
        params[_TRACE_PARAM[name]] = args.trace
    requests = create_workload(name, num_requests=args.num_requests, seed=args.seed, vocab_size=args.vocab_size,
                               rate=args.rate, arrival=args.arrival, arrival_cv=args.cv, arrival_on_s=args.on_s,
                               arrival_off_s=args.off_s, **params)
    return requests, params


def _describe(args: argparse.Namespace) -> int:
    from kvbaton.bench.sharing import describe_workload

    requests, params = _workload(args, args.describe)
    stats = describe_workload(requests)
    if args.json:
        print(json.dumps({"workload": args.describe, "seed": args.seed, "params": params, **asdict(stats)}))
        return 0
    classes = ", ".join(f"{c}: {n}" for c, n in stats.requests_per_class.items())
    rows = [
        ("workload", args.describe),
        ("requests", f"{stats.num_requests}"),
        ("mean input", f"{stats.mean_prompt_tokens:.1f} tokens (max {stats.max_prompt_tokens})"),
        ("mean output", f"{stats.mean_output_tokens:.1f} tokens"),
        ("sharing", f"{100 * stats.sharing_ratio:.1f} % of prompt tokens shared with an earlier request"),
        ("prefix groups", f"{stats.num_groups}"),
        ("duration", f"{stats.duration_s:.1f} s ({stats.mean_rate_rps:.2f} req/s)"),
        ("classes", classes),
    ]
    for key, value in rows:
        print(f"{key:<14} {value}")
    return 0


def _drive(args: argparse.Namespace) -> int:
    from kvbaton.bench.driver import DriverConfig, discover_model, run_live
    from kvbaton.bench.metrics import SLO, summarize
    from kvbaton.bench.report import write_report

    if not args.workload:
        raise InvalidRequestError("--url needs --workload W")
    if (args.ttft_slo is None) != (args.tpot_slo is None):
        raise InvalidRequestError("give both --ttft-slo and --tpot-slo, or neither")
    slo = SLO(args.ttft_slo, args.tpot_slo) if args.ttft_slo is not None else None
    requests, params = _workload(args, args.workload)
    try:
        model = args.model or discover_model(args.url, api_key=args.api_key)
    except Exception as exc:  # any failure to reach or parse /v1/models is a user-facing setup error
        raise KvbatonError(f"cannot list models at {args.url}/v1/models ({exc}); pass --model") from None
    config = DriverConfig(url=args.url, model=model, timeout_s=args.timeout_s, api_key=args.api_key)
    records = run_live(requests, config, progress=not args.no_progress and not args.json)
    name = args.name or args.workload
    summary = summarize(records, slo, args.num_gpus)
    extra = {"workload": args.workload, "params": params, "seed": args.seed, "rate": args.rate,
             "arrival": args.arrival, "num_requests": len(requests), "url": args.url, "model": model}
    if args.out:
        write_report(args.out, {name: records}, slo=slo, num_gpus=args.num_gpus, title=f"kvbaton bench: {name}",
                     extra=extra)
    if args.json:
        print(json.dumps({"run": name, **extra, "summary": summary.to_dict()}))
    else:
        o = summary.overall
        print(f"{name}: {o.num_completed}/{o.num_requests} completed, {o.num_rejected} rejected, "
              f"{o.num_failed} failed in {summary.duration_s:.2f} s")
        for label, stats in (("TTFT", o.ttft), ("TPOT", o.tpot), ("E2E", o.e2e)):
            if stats.count:
                print(f"  {label:<5} mean {stats.mean_s:.4f} s  p50 {stats.p50_s:.4f}  p99 {stats.p99_s:.4f}")
        if o.cache_hit_ratio is not None:
            print(f"  cache hit ratio {100 * o.cache_hit_ratio:.1f} %")
        if o.slo_attainment is not None:
            print(f"  SLO attainment {100 * o.slo_attainment:.1f} %, goodput {o.goodput_rps:.3f} req/s")
        if args.out:
            print(f"  report: {args.out}/report.md")
    return 0


def run_bench(args: argparse.Namespace) -> int:
    if args.describe:
        return _describe(args)
    if args.url:
        return _drive(args)
    raise InvalidRequestError("kvbaton bench needs --describe WORKLOAD, or --url URL --workload W")
