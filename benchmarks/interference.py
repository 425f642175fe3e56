"""Prefill-decode interference: short requests decode while 1,500-token prompts keep arriving; mixed vs 1P+1D.

Every layout gets the same two cores' worth of torch threads: 1P+1D (`--prefill 1 --decode 1`, one
thread each) against 2 mixed workers (`--workers 2`, one thread each, least_load routing) and against
1 mixed worker with both threads (`--workers 1 --threads-per-worker 2`). For each layout a fresh
`kvbaton serve` starts as a subprocess (the same model), the script waits on `/ready`, sends the
same open-loop workload through the live driver, stops the server with SIGTERM and kills anything
left by pid. Workload: `--num-short` short requests (random 24-token prompts, `--short-output`
tokens each, arriving over the first seconds) while long requests (`--long-tokens`-token unique
prompts, 2 output tokens) arrive every `--long-interval` seconds for the whole run. It prints p50 /
p99 ITL and TTFT of the short requests side by side and one JSON line with the ratios of each mixed
layout's figure to 1P+1D's (`itl_p99_ratio_<layout>_over_1p1d`). `--repeats` runs every layout that
many times, the layouts' order rotated each round; the figures are medians over the rounds.

With `--sweep-threshold`, it instead measures, on 1P+1D, TTFT of prompts of growing length sent one
at a time, with the handoff (threshold 0) and prefilled on the decode worker (huge threshold): the
length where the two meet is the default `local_prefill_threshold_tokens` (kvbaton.router.pairs).

Measured here: see the README's table (the figures of one invocation, with its command).

    .venv/bin/python benchmarks/interference.py [--model smollm2-135m] [--out /tmp/interference]
    .venv/bin/python benchmarks/interference.py --sweep-threshold
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvbaton.bench.driver import DriverConfig, drive
from kvbaton.bench.records import RequestRecord
from kvbaton.bench.workloads.base import WorkloadRequest
from routing_live import DTYPE_HELP

from kvbaton.router.pairs import DEFAULT_LOCAL_PREFILL_THRESHOLD_TOKENS

_BANNER = re.compile(r"kvbaton: serving .* at (http://\S+) with .*\(pids ([\d ]+)\)")
# layout -> (pool flags, workers, torch threads per worker); every layout runs two threads in all.
LAYOUTS = {"2xmixed": (["--workers", "2"], 2, 1), "1xmixed-2t": (["--workers", "1"], 1, 2),
           "1p1d": (["--prefill", "1", "--decode", "1"], 2, 1)}


def start_server(model: str, dtype: str, layout_args: Sequence[str], threads_per_worker: int,
                 extra: Sequence[str]) -> tuple[subprocess.Popen[str], str, list[int]]:
    command = [sys.executable, "-m", "kvbaton.cli", "serve", "--model", model, "--dtype", dtype, *layout_args,
               "--port", "0", "--threads-per-worker", str(threads_per_worker), "--policy", "least_load",
               "--num-blocks", "1024", "--kv-store-gb", "0", *extra]  # no store: the interference is the subject
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert process.stdout is not None
    for line in process.stdout:
        match = _BANNER.search(line)
        if match:
            url, pids = match.group(1), [int(p) for p in match.group(2).split()]
            for _ in range(200):
                try:
                    with urllib.request.urlopen(f"{url}/ready", timeout=2.0) as response:
                        if response.status == 200:
                            return process, url, pids
                except OSError:
                    pass
                time.sleep(0.1)
            break
    stop_server(process, [])
    raise RuntimeError(f"server did not start: {' '.join(command)}")


def stop_server(process: subprocess.Popen[str], worker_pids: Sequence[int]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30.0)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10.0)
    for pid in worker_pids:  # stragglers only: the launcher normally reaps its workers
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _request(index: int, arrival_s: float, prompt: Sequence[int], output_tokens: int,
             slo_class: str) -> WorkloadRequest:
    array = np.asarray(prompt, dtype=np.int32)
    array.flags.writeable = False
    return WorkloadRequest(index, arrival_s, (array,), output_tokens, slo_class=slo_class)


def build_workload(args: argparse.Namespace, vocab_size: int) -> list[WorkloadRequest]:
    rng = random.Random(args.seed)
    items: list[tuple[float, list[int], int, str]] = []
    for i in range(args.num_short):
        prompt = [rng.randrange(100, vocab_size) for _ in range(24)]
        items.append((args.warmup_s + i * args.short_spacing, prompt, args.short_output, "short"))
    num_long = int(args.duration / args.long_interval)
    for i in range(num_long):
        prompt = [rng.randrange(100, vocab_size) for _ in range(args.long_tokens)]
        items.append((args.warmup_s + i * args.long_interval, prompt, 2, "long"))
    items.sort(key=lambda item: (item[0], item[3]))
    return [_request(i, at, prompt, out, cls) for i, (at, prompt, out, cls) in enumerate(items)]


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def short_summary(records: Sequence[RequestRecord]) -> dict[str, float]:
    shorts = [r for r in records if r.slo_class == "short" and r.completed]
    itls = [itl for r in shorts for itl in r.itls_s]
    ttfts = [r.ttft_s for r in shorts if r.ttft_s is not None]
    return {"num_short_completed": len(shorts), "num_failed": sum(not r.completed for r in records),
            "itl_p50_s": percentile(itls, 50), "itl_p99_s": percentile(itls, 99),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99)}


def run_layout(args: argparse.Namespace, layout: str, requests: list[WorkloadRequest],
               extra: Sequence[str] = ()) -> list[RequestRecord]:
    pools, _, threads = LAYOUTS[layout]
    process, url, pids = start_server(args.model, args.dtype, pools, threads, extra)
    try:
        config = DriverConfig(url=url, model=args.model, timeout_s=600.0)
        return asyncio.run(drive(requests, config))
    finally:
        stop_server(process, pids)


def vocab_size_of(model: str) -> int:
    from kvbaton.model.registry import read_model_header, resolve_model_source

    config, _ = read_model_header(resolve_model_source(model))
    return min(config.vocab_size, 32000)


def interference(args: argparse.Namespace) -> dict[str, object]:
    requests = build_workload(args, vocab_size_of(args.model))
    layouts = [name for name in args.layouts.split(",") if name]
    unknown = sorted(set(layouts) - set(LAYOUTS))
    if unknown or "1p1d" not in layouts:
        raise SystemExit(f"--layouts: need 1p1d and names from {sorted(LAYOUTS)}, got {layouts}")
    rounds: dict[str, list[dict[str, float]]] = {layout: [] for layout in layouts}
    for repeat in range(args.repeats):
        for layout in layouts[repeat % len(layouts):] + layouts[:repeat % len(layouts)]:
            # 1P+1D with the default conditional-disaggregation threshold: the 24-token short prompts prefill on the
            # decode worker, the 1,500-token ones are handed off (--local-prefill-threshold 0 hands off everything).
            extra = ["--local-prefill-threshold", str(args.local_prefill_threshold)] if layout == "1p1d" else []
            records = run_layout(args, layout, requests, extra)
            rounds[layout].append(short_summary(records))
            print(f"round {repeat + 1} {layout}: {rounds[layout][-1]}", file=sys.stderr, flush=True)
            if args.out:
                Path(args.out).mkdir(parents=True, exist_ok=True)
                with open(Path(args.out) / f"{layout}-{repeat + 1}.jsonl", "w") as f:
                    f.writelines(json.dumps(r.to_dict()) + "\n" for r in records)
    keys = ("itl_p50_s", "itl_p99_s", "ttft_p50_s", "ttft_p99_s")
    results = {layout: {key: statistics.median(r[key] for r in runs) for key in (*keys, "num_failed")}
               for layout, runs in rounds.items()}
    print(f"{'short requests':<16}" + "".join(f"{layout:>12}" for layout in layouts))
    for key in keys:
        print(f"{key:<16}" + "".join(f"{results[layout][key]:>12.4f}" for layout in layouts))
    summary: dict[str, object] = {"benchmark": "interference", "dtype": args.dtype, "repeats": args.repeats,
                                  "threads": {layout: LAYOUTS[layout][1] * LAYOUTS[layout][2] for layout in layouts},
                                  "medians": results, "rounds": rounds}
    for layout in layouts:
        if layout == "1p1d":
            continue
        for key in keys:
            ratio = results[layout][key] / results["1p1d"][key]
            summary[f"{key.removesuffix('_s')}_ratio_{layout}_over_1p1d"] = round(ratio, 3)
    return summary


def sweep_threshold(args: argparse.Namespace) -> dict[str, object]:
    """TTFT of lone prompts of growing length: handed off vs prefilled on the decode worker."""
    rng = random.Random(args.seed)
    vocab = vocab_size_of(args.model)
    lengths = [16, 32, 64, 128, 256, 512]
    requests = [_request(i, 1.0 + 1.5 * i, [rng.randrange(100, vocab) for _ in range(n)], 2, f"len{n}")
                for i, n in enumerate(lengths)]
    ttft: dict[str, dict[int, float]] = {}
    for name, threshold in (("handoff", "0"), ("local", "100000")):
        records = run_layout(args, "1p1d", requests, ["--local-prefill-threshold", threshold])
        ttft[name] = {int(r.slo_class.removeprefix("len")): round(r.ttft_s or float("nan"), 4) for r in records}
    print(f"{'prompt tokens':<16}{'handoff TTFT':>14}{'local TTFT':>12}")
    for n in lengths:
        print(f"{n:<16}{ttft['handoff'][n]:>14.4f}{ttft['local'][n]:>12.4f}")
    return {"ttft_handoff_s": ttft["handoff"], "ttft_local_s": ttft["local"]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32", help=DTYPE_HELP)
    parser.add_argument("--num-short", type=int, default=8)
    parser.add_argument("--short-output", type=int, default=48)
    parser.add_argument("--short-spacing", type=float, default=0.5, help="seconds between short arrivals")
    parser.add_argument("--long-tokens", type=int, default=1500)
    parser.add_argument("--long-interval", type=float, default=3.0, help="seconds between long arrivals")
    parser.add_argument("--duration", type=float, default=12.0, help="seconds over which long prompts arrive")
    parser.add_argument("--warmup-s", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--local-prefill-threshold", type=int, default=DEFAULT_LOCAL_PREFILL_THRESHOLD_TOKENS)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, from {sorted(LAYOUTS)}")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the layouts (medians reported)")
    parser.add_argument("--out", default="")
    parser.add_argument("--sweep-threshold", action="store_true")
    args = parser.parse_args(argv)
    summary = sweep_threshold(args) if args.sweep_threshold else interference(args)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
