"""Live routing on SmolLM2: one `kvbaton serve` cluster (2 mixed workers) per placement policy, same workload.

For each policy a fresh `kvbaton serve --model smollm2-135m --workers 2 --policy P` starts as a
subprocess (workers pinned to `--threads-per-worker` torch threads so the two share the cores
fairly), the script waits on `/ready`, drives the `shared-prefix` workload through the live
driver (`kvbaton.bench.driver`, the one `kvbaton bench --url` uses), then stops the server with
SIGTERM and kills anything left by pid. It prints a table per pool size, writes the comparison report
(`write_report`, every run) to `--out`, and prints one JSON line with, per pool size, the median
mean/p99 TTFT and E2E and the prompt-token hit ratio per policy and `ttft_mean_ratio_round_robin_over_preble`.

Default sizes fit a shared 2-core CPU machine (about 1.5 minutes per run): 8 groups, each a
1,024-token system prompt (64 KV blocks) plus a 32-token question, 8 output tokens, 64 requests
at 1 req/s (Poisson). A cold 1,056-token prefill takes ~2.5-4 s on one thread here, a hit ~0.5 s.
The KV pool per worker is swept (`--num-blocks 192,384,768`): 192 blocks hold the prefixes of
about 2 groups (neither policy keeps the working set: both evict), 384 about 4 (the regime Preble
targets: the two workers' caches together hold the 8 groups, one alone does not, so a policy that
spreads every group over both workers keeps re-prefilling while a prefix-aware one splits the
groups and hits), 768 all 8 on each worker (any policy hits once warm: locality buys little).
Each (pool size, policy) runs `--repeats` times, interleaved round by round with the policies'
order rotated; the figures are medians, and the round_robin / preble TTFT ratio is the median of
the per-round ratios.

    .venv/bin/python benchmarks/routing_live.py --out /tmp/routing_live [--policies preble,round_robin]
        [--num-blocks 192,384,768] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvbaton.bench.driver import DriverConfig, discover_model, run_live
from kvbaton.bench.metrics import Summary, summarize
from kvbaton.bench.records import RequestRecord
from kvbaton.bench.report import write_report
from kvbaton.bench.workloads import create_workload
from kvbaton.bench.workloads.base import WorkloadRequest

POLICIES = ("round_robin", "least_load", "longest_prefix", "preble")
DTYPE_HELP = ("the workers' dtype (float32 by default: on an AVX2-only host such as this one, without AVX-512 BF16 "
              "or AMX, a bfloat16 matmul runs ~30x slower than float32)")
_BANNER = re.compile(r"kvbaton: serving .* at (http://\S+) with .*\(pids ([\d ]+)\)")


@dataclass(slots=True)
class ServerProcess:
    """A `kvbaton serve` subprocess, its URL and its workers' pids (from the startup banner)."""

    process: subprocess.Popen[str]
    url: str = ""
    worker_pids: list[int] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)


def _pump_output(server: ServerProcess, banner_seen: threading.Event) -> None:
    assert server.process.stdout is not None
    for line in server.process.stdout:
        server.lines.append(line.rstrip())
        match = _BANNER.search(line)
        if match and not banner_seen.is_set():
            server.url = match.group(1)
            server.worker_pids = [int(p) for p in match.group(2).split()]
            banner_seen.set()


def start_server(args: argparse.Namespace, policy: str, pools: Sequence[str] | None = None,
                 extra: Sequence[str] = ()) -> ServerProcess:
    """Start `kvbaton serve` on a free port and wait until `/ready` answers 200 (raises after the timeout).

    `pools` are the worker-pool flags (default `--workers N`; e.g. `--prefill 1 --decode 1`); `extra` are
    appended as they are (e.g. admission flags).
    """
    pools = list(pools) if pools is not None else ["--workers", str(args.workers)]
    command = [sys.executable, "-m", "kvbaton.cli", "serve", "--model", args.model, *pools,
               "--policy", policy, "--port", "0", "--num-blocks", str(args.num_blocks),
               "--threads-per-worker", str(args.threads_per_worker), "--max-num-waiting", "1024",
               "--drain-timeout", "5", "--seed", str(args.seed), "--dtype", getattr(args, "dtype", "auto"),
               # per-worker caches only, as the figures these benchmarks report were measured (the store's are
               # kv_store_live.py's); an `extra` --kv-store-gb, given after, turns it on
               "--kv-store-gb", "0", *extra]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    server = ServerProcess(process)
    banner_seen = threading.Event()
    threading.Thread(target=_pump_output, args=(server, banner_seen), daemon=True).start()
    deadline_s = time.monotonic() + args.startup_timeout_s
    while not banner_seen.wait(0.2):
        if process.poll() is not None or time.monotonic() > deadline_s:
            stop_server(server)
            raise RuntimeError(f"kvbaton serve ({policy}) did not start:\n" + "\n".join(server.lines[-20:]))
    while time.monotonic() < deadline_s:
        try:
            with urllib.request.urlopen(f"{server.url}/ready", timeout=5.0) as response:
                if response.status == 200:
                    return server
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    stop_server(server)
    raise RuntimeError(f"{server.url}/ready never answered 200 for {policy}")


def stop_server(server: ServerProcess, timeout_s: float = 20.0) -> None:
    """SIGTERM the router (it drains and stops its workers), then SIGKILL by pid whatever is left."""
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait(timeout=5.0)
    for pid in server.worker_pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                if b"worker" not in cmdline.read():
                    continue  # exited, and the pid was reused by something else
            os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            pass


def build_workload(args: argparse.Namespace) -> list[WorkloadRequest]:
    return create_workload("shared-prefix", num_requests=args.num_requests, seed=args.seed, rate=args.rate,
                           num_groups=args.num_groups, system_prompt_tokens=args.system_prompt_tokens,
                           question_tokens=args.question_tokens, output_tokens=args.output_tokens)


def run_policy(args: argparse.Namespace, policy: str, requests: Sequence[WorkloadRequest]) -> list[RequestRecord]:
    server = start_server(args, policy)
    try:
        config = DriverConfig(url=server.url, model=discover_model(server.url), timeout_s=args.request_timeout_s)
        return run_live(requests, config)
    finally:
        stop_server(server)


def policy_figures(summary: Summary) -> dict[str, float | int | None]:
    o = summary.overall
    return {"ttft_mean_s": o.ttft.mean_s, "ttft_p99_s": o.ttft.p99_s, "e2e_mean_s": o.e2e.mean_s,
            "e2e_p99_s": o.e2e.p99_s, "hit_ratio": o.cache_hit_ratio, "num_completed": o.num_completed,
            "num_failed": o.num_failed + o.num_rejected}


def _fmt(value: float | int | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_table(figures: dict[str, dict[str, float | int | None]]) -> None:
    print(f"{'policy':<15} {'TTFT mean':>10} {'TTFT p99':>10} {'E2E mean':>10} {'E2E p99':>10} {'hit ratio':>10} "
          f"{'done':>5} {'fail':>5}", file=sys.stderr)
    for policy, f in figures.items():
        print(f"{policy:<15} {_fmt(f['ttft_mean_s']):>10} {_fmt(f['ttft_p99_s']):>10} {_fmt(f['e2e_mean_s']):>10} "
              f"{_fmt(f['e2e_p99_s']):>10} {_fmt(f['hit_ratio']):>10} {f['num_completed']:>5} {f['num_failed']:>5}",
              file=sys.stderr)


def median_figures(runs: Sequence[dict[str, float | int | None]]) -> dict[str, float | int | None]:
    """Each figure's median over repeated runs (None when any run had none)."""
    out: dict[str, float | int | None] = {}
    for key in runs[0]:
        values = [run[key] for run in runs]
        out[key] = None if any(v is None for v in values) else statistics.median(values)  # type: ignore[type-var]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default="preble,round_robin", help="comma-separated, from " + ",".join(POLICIES))
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads-per-worker", type=int, default=1)
    parser.add_argument("--dtype", default="float32", help=DTYPE_HELP)
    parser.add_argument("--num-blocks", default="192,384,768",
                        help="KV blocks per worker: one pool size or a comma-separated sweep")
    parser.add_argument("--repeats", type=int, default=3, help="runs per (pool size, policy); medians reported")
    parser.add_argument("--num-groups", type=int, default=8)
    parser.add_argument("--system-prompt-tokens", type=int, default=1024)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--rate", type=float, default=1.0, help="mean requests/s (Poisson)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout-s", type=float, default=240.0)
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument("--out", default=None, help="write the comparison report (report.json/.md, plots) here")
    args = parser.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        parser.error(f"unknown policies {unknown}; choose from {POLICIES}")
    pool_sizes = [int(n) for n in args.num_blocks.split(",") if n]

    requests = build_workload(args)
    runs: dict[str, list[RequestRecord]] = {}
    per_run: dict[int, dict[str, list[dict[str, float | int | None]]]] = {n: {p: [] for p in policies}
                                                                          for n in pool_sizes}
    for repeat in range(args.repeats):  # interleaved: every (pool, policy) once per round, the order rotated
        for num_blocks in pool_sizes:
            order = policies[repeat % len(policies):] + policies[:repeat % len(policies)]
            for policy in order:
                started_s = time.monotonic()
                records = run_policy(argparse.Namespace(**{**vars(args), "num_blocks": num_blocks}), policy, requests)
                runs[f"{policy}@{num_blocks}#{repeat + 1}"] = records
                per_run[num_blocks][policy].append(policy_figures(summarize(records)))
                print(f"round {repeat + 1}, {num_blocks} blocks, {policy}: {per_run[num_blocks][policy][-1]} "
                      f"({time.monotonic() - started_s:.0f} s with startup)", file=sys.stderr, flush=True)

    workload = {"workload": "shared-prefix", "num_groups": args.num_groups,
                "system_prompt_tokens": args.system_prompt_tokens, "question_tokens": args.question_tokens,
                "output_tokens": args.output_tokens, "num_requests": args.num_requests, "rate_rps": args.rate,
                "seed": args.seed}
    cluster = {"model": args.model, "workers": args.workers, "threads_per_worker": args.threads_per_worker,
               "dtype": args.dtype}
    pools: dict[str, object] = {}
    for num_blocks in pool_sizes:
        figures = {policy: median_figures(per_run[num_blocks][policy]) for policy in policies}
        print(f"--- {num_blocks} KV blocks per worker, medians of {args.repeats}", file=sys.stderr)
        print_table(figures)
        entry: dict[str, object] = {"medians": figures, "runs": per_run[num_blocks]}
        if "round_robin" in figures and "preble" in figures:
            rr, preble = per_run[num_blocks]["round_robin"], per_run[num_blocks]["preble"]
            ratios = [float(r["ttft_mean_s"]) / float(p["ttft_mean_s"]) for r, p in zip(rr, preble)
                      if r["ttft_mean_s"] and p["ttft_mean_s"]]
            entry["ttft_mean_ratio_round_robin_over_preble"] = round(statistics.median(ratios), 3) if ratios else None
            entry["ttft_mean_ratio_per_repeat"] = [round(x, 3) for x in ratios]
        pools[str(num_blocks)] = entry
    result: dict[str, object] = {"benchmark": "routing_live", "workload": workload, "cluster": cluster,
                                 "repeats": args.repeats, "num_blocks_per_worker": pools}
    if args.out:
        write_report(args.out, runs, title="Live routing on SmolLM2: 2 workers, shared-prefix",
                     extra={"command": " ".join(sys.argv), **workload, **cluster})
    print(json.dumps(result))


if __name__ == "__main__":
    main()
