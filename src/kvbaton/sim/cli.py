"""`kvbaton sim`: simulate a workload on a named cluster, sweeping policies and rates, and write the bench report.

The lead's `kvbaton.cli` registers the subcommand with `add_sim_arguments` and calls `run_sim`.
`--policy` and `--rate` take comma-separated lists: every (policy, rate) pair is one run. The
report (report.json, report.md, plots, records-*.jsonl) is the one `kvbaton bench` writes for a
live cluster; it holds no wall-clock figures, so the same seed gives a byte-identical report.json.
(`kvbaton profile` lives in `kvbaton.engine.profiler`: it drives the torch engine, which the sim
layer may not import.)
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict
from typing import Any

from kvbaton.bench.records import RequestRecord
from kvbaton.core.errors import InvalidRequestError
from kvbaton.sim.catalog import GPUS, MODELS
from kvbaton.sim.config import StoreNodeLoss
from kvbaton.sim.costs import COST_MODELS
from kvbaton.sim.run import SimResult, SimSetup, check_setup, simulate

_TRACE_PARAM = {"mooncake": "trace", "sharegpt-like": "sharegpt_path"}


def add_sim_arguments(parser: argparse.ArgumentParser) -> None:
    from kvbaton.bench.arrivals import ARRIVALS
    from kvbaton.bench.workloads import WORKLOADS
    from kvbaton.router.admission import ADMISSION_POLICIES
    from kvbaton.router.policies import POLICY_NAMES

    parser.add_argument("--workload", required=True, help=f"one of {', '.join(WORKLOADS)}")
    parser.add_argument("--model", default="llama-3-8b", help=f"catalog model: {', '.join(MODELS)}")
    parser.add_argument("--gpu", default="h100", help=f"catalog GPU: {', '.join(GPUS)}")
    parser.add_argument("--cluster", default="4xmixed",
                        help="e.g. 4xmixed, 2P2D, 2P2D:tp_p=2,link=nvlink, 2P3D:gpu_p=h100,gpu_d=a100,cap_d=0.7")
    parser.add_argument("--policy", default="round_robin", help=f"comma-separated, from {', '.join(POLICY_NAMES)}")
    parser.add_argument("--cost-model", default="roofline", help=f"{' | '.join(COST_MODELS)} (from kvbaton profile)")
    parser.add_argument("--rate", default=None, help="mean requests/s, or a comma-separated sweep")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arrival", choices=ARRIVALS, default=None)
    parser.add_argument("--cv", type=float, default=2.0, help="coefficient of variation for --arrival gamma")
    parser.add_argument("--trace", metavar="FILE", help="Mooncake JSONL (mooncake) or ShareGPT JSON (sharegpt-like)")
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="workload parameter")
    parser.add_argument("--num-blocks", type=int, default=0, help="KV blocks per worker (0: from GPU memory)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=0, help="0: the model's context length")
    parser.add_argument("--no-prefix-cache", action="store_true")
    # Gone (the host tier): kept, hidden, to name its replacement (`run_sim`).
    parser.add_argument("--host-kv-gb", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--kv-store-gb", type=float, default=0.0, metavar="G",
                        help="cluster KV store: host DRAM per worker's node (GB), pooled across the cluster; new "
                             "blocks are written through and prefix hits past the GPU are loaded from wherever they "
                             "are, priced over the host link, the NIC and the disk (0: no store; use --policy "
                             "conductor to place by predicted TTFT with the loads)")
    parser.add_argument("--kv-store-disk-gb", type=float, default=0.0, metavar="D",
                        help="cluster KV store: local disk per node (GB), below its DRAM")
    parser.add_argument("--kv-store-private", action="store_true",
                        help="cluster KV store: each worker's node serves that worker alone (islands: it keeps and "
                             "reads back only what its worker wrote, nothing crosses the NIC)")
    parser.add_argument("--lose-store-node", action="append", default=[], metavar="NODE@T[:BACK]",
                        help="cluster KV store: the store node of worker NODE's host is lost at T simulated seconds "
                             "with all it holds (and back, empty, at BACK); repeatable")
    parser.add_argument("--speculative-tokens", type=int, default=0, metavar="K",
                        help="speculative decoding by prompt lookup, K drafts per decode (the live scheduler's); "
                             "drafts find something only with --output-copy-fraction > 0")
    parser.add_argument("--spec-max-running", type=int, default=None, metavar="N",
                        help="speculate only while at most N requests run (default: the live default, tuned on CPU)")
    parser.add_argument("--output-copy-fraction", type=float, default=0.0, metavar="F",
                        help="share of output tokens copied from spans of the prompt (quoting, RAG, code edits); "
                             "0: synthetic tokens that never repeat the prompt")
    parser.add_argument("--output-copy-span", type=float, default=16.0, metavar="L",
                        help="mean length of a copied span, in tokens")
    parser.add_argument("--ttft-slo", type=float, default=None, help="TTFT SLO in seconds")
    parser.add_argument("--tpot-slo", type=float, default=None, help="TPOT SLO in seconds")
    parser.add_argument("--admission", choices=ADMISSION_POLICIES, default="none",
                        help="SLO admission control (Mooncake's variants; needs --ttft-slo and --tpot-slo)")
    parser.add_argument("--adaptive-pools", action="store_true",
                        help="lend workers of the idle pool to mixed duty while the other queues (needs the SLOs)")
    parser.add_argument("--reserve-ahead-tokens", type=int, default=None, metavar="N",
                        help="late KV reservation: a handoff reserves on the decode worker once its prefill worker "
                             "has at most N prompt tokens left ahead of it (default: on arrival)")
    parser.add_argument("--out", metavar="DIR", help="write report.json, report.md and plots here")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _rates(text: str | None) -> list[float | None]:
    if text is None:
        return [None]
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidRequestError(f"--rate expects numbers separated by commas, got {text!r}") from None
    if not rates or not all(math.isfinite(r) and r > 0 for r in rates):
        raise InvalidRequestError(f"--rate expects positive finite numbers separated by commas, got {text!r}")
    return rates


def _fleet_figures(cluster: str, gpu: str, cost_model: str) -> dict[str, float]:
    """What the cluster's GPUs cost per hour (the default price table, `kvbaton.sim.hardware`) and draw (kW), when
    the cost model prices catalog GPUs (a profile of a CPU host has neither)."""
    from kvbaton.sim.hardware import load_prices
    from kvbaton.sim.spec import parse_cluster_spec

    if cost_model not in ("roofline", "distserve"):
        return {}
    spec = parse_cluster_spec(cluster, gpu)
    return {"price_per_hour": round(spec.price_per_hour(load_prices(None)), 4), "power_kw": round(spec.power_kw, 4)}


def _setup(args: argparse.Namespace, policy: str) -> SimSetup:
    return SimSetup(model=args.model, gpu=args.gpu, cluster=args.cluster, policy=policy,
                    cost_model=args.cost_model, seed=args.seed, block_size=args.block_size,
                    num_blocks=args.num_blocks, enable_prefix_cache=not args.no_prefix_cache,
                    max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                    max_model_len=args.max_model_len, admission=args.admission, adaptive_pools=args.adaptive_pools,
                    admission_slo=(args.ttft_slo, args.tpot_slo) if args.ttft_slo is not None else None,
                    reserve_ahead_tokens=args.reserve_ahead_tokens,
                    kv_store_gb=args.kv_store_gb, kv_store_disk_gb=args.kv_store_disk_gb,
                    kv_store_private=args.kv_store_private,
                    store_node_losses=tuple(StoreNodeLoss.parse(text) for text in args.lose_store_node),
                    num_speculative_tokens=args.speculative_tokens, spec_max_running=args.spec_max_running,
                    output_copy_fraction=args.output_copy_fraction, output_copy_span=args.output_copy_span)


def run_sim(args: argparse.Namespace) -> int:
    from kvbaton.bench.cli import parse_params
    from kvbaton.bench.metrics import SLO, summarize
    from kvbaton.bench.report import write_report
    from kvbaton.bench.workloads import create_workload
    from kvbaton.router.policies import POLICY_NAMES

    if args.host_kv_gb is not None:
        gb = args.host_kv_gb
        raise InvalidRequestError(f"--host-kv-gb is gone: the KV store's DRAM tier took the host tier's place: "
                                  f"--kv-store-gb {gb} (shared, Mooncake's store) or --kv-store-gb {gb} "
                                  "--kv-store-private (each worker's own node: islands)")
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICY_NAMES]
    if unknown or not policies:
        raise InvalidRequestError(f"unknown policy {unknown}; choose from {', '.join(POLICY_NAMES)}")
    if (args.ttft_slo is None) != (args.tpot_slo is None):
        raise InvalidRequestError("give both --ttft-slo and --tpot-slo, or neither")
    slo = SLO(args.ttft_slo, args.tpot_slo) if args.ttft_slo is not None else None  # refuses non-finite targets
    check_setup(_setup(args, policies[0]))
    params = parse_params(args.param)
    if args.trace:
        if args.workload not in _TRACE_PARAM:
            raise InvalidRequestError(f"--trace applies to {', '.join(_TRACE_PARAM)}, not {args.workload}")
        params[_TRACE_PARAM[args.workload]] = args.trace
    rates = _rates(args.rate)
    names = [f"{rate:g}" for rate in rates if rate is not None]
    if len(set(names)) < len(names) or len(set(policies)) < len(policies):
        raise InvalidRequestError("--rate and --policy may not repeat a value (rates are told apart to 6 significant "
                                  f"digits: {', '.join(names)})")
    workloads = {rate: create_workload(args.workload, num_requests=args.num_requests, seed=args.seed, rate=rate,
                                       arrival=args.arrival, arrival_cv=args.cv, **params) for rate in rates}
    runs: dict[str, list[RequestRecord]] = {}
    sweeps: dict[str, list[tuple[float, list[RequestRecord]]]] = {}
    results: dict[str, SimResult] = {}
    cpu_start = time.process_time()
    total = sum(len(w) for w in workloads.values()) * len(policies)
    with _Progress(total, enabled=not args.no_progress and not args.json) as advance:
        for policy in policies:
            for rate, requests in workloads.items():
                result = simulate(requests, _setup(args, policy), on_record=lambda _: advance())
                name = policy if len(rates) == 1 else f"{policy}@{rate:g}"
                runs[name] = result.records
                results[name] = result
                if len(rates) > 1:
                    sweeps.setdefault(policy, []).append((float(rate or 0.0), result.records))
    cpu_s = time.process_time() - cpu_start
    num_gpus = next(iter(results.values())).num_gpus
    extra: dict[str, Any] = {
        "simulator": {"model": args.model, "gpu": args.gpu, "cluster": args.cluster, "cost_model": args.cost_model,
                      "num_blocks_per_worker": next(iter(results.values())).num_blocks_per_worker,
                      "kv_store_gb": args.kv_store_gb, "kv_store_disk_gb": args.kv_store_disk_gb,
                      "kv_store_private": args.kv_store_private, "speculative_tokens": args.speculative_tokens,
                      "spec_max_running": args.spec_max_running, "output_copy_fraction": args.output_copy_fraction,
                      "output_copy_span": args.output_copy_span,
                      **_fleet_figures(args.cluster, args.gpu, args.cost_model)},
        "workload": args.workload, "params": {k: str(v) for k, v in params.items()}, "seed": args.seed,
        "workers": {name: [asdict(w) for w in r.workers] for name, r in results.items()},
    }
    if any(r.store is not None for r in results.values()):
        extra["store"] = {name: asdict(r.store) if r.store is not None else None for name, r in results.items()}
    if args.out:
        write_report(args.out, runs, slo=slo, num_gpus=num_gpus, sweeps=sweeps or None,
                     title=f"kvbaton sim: {args.workload} on {args.cluster} x {args.gpu} ({args.model})", extra=extra)
    summaries = {name: summarize(records, slo, num_gpus) for name, records in runs.items()}
    if args.json:
        print(json.dumps({"runs": {n: s.to_dict() for n, s in summaries.items()}, "cpu_s": cpu_s, **extra}))
        return 0
    print(f"simulated {total} requests in {cpu_s:.2f} CPU-s ({1000 * cpu_s / max(total, 1):.2f} CPU-s per 1,000)")
    for name, s in summaries.items():
        o = s.overall
        hit = "-" if o.cache_hit_ratio is None else f"{100 * o.cache_hit_ratio:.1f} %"
        p50 = o.ttft.p50_s if o.ttft.p50_s is not None else float("nan")
        p99 = o.ttft.p99_s if o.ttft.p99_s is not None else float("nan")
        tpot = o.tpot.p50_s if o.tpot.p50_s is not None else float("nan")
        print(f"  {name}: {o.num_completed}/{o.num_requests} done, TTFT p50 {1e3 * p50:.1f} ms p99 {1e3 * p99:.1f} ms,"
              f" TPOT p50 {1e3 * tpot:.2f} ms, hit ratio {hit}")
    if args.out:
        print(f"  report: {args.out}/report.md")
    return 0


class _Progress:
    """A rich progress bar as a context manager yielding `advance()`; a no-op when disabled."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total = total
        self.enabled = enabled
        self._bar: Any = None

    def __enter__(self) -> Any:
        if not self.enabled:
            return lambda: None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(TextColumn("sim"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                             transient=True)
        self._bar.__enter__()
        task = self._bar.add_task("requests", total=self.total)
        return lambda: self._bar.advance(task)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
