"""The host KV tier in the simulator: the Mooncake synthetic trace on 8 x H100 with preble, without and with the tier.

Replays ../shared/data/mooncake/synthetic_trace.jsonl (3,993 requests, mean input 15k tokens) as
`sim_mooncake.py` does: 8 mixed workers, one H100 each, a Llama-3-8B-shaped model with a 256k
context, 64-token blocks, the roofline cost model, and each worker's KV pool sized from the GPU's
memory (~7,300 blocks, 467k tokens). The trace has ~22M distinct prompt tokens, six times what the
8 device caches hold together, so the caches evict prefixes that come back. With `--host-kv-gb G`
each worker keeps what its GPU evicts in G GB of host memory and copies it back over PCIe 5.0
(50 GB/s per GPU), the copies serial with the step's compute. Prints one JSON line: per host size
the prefix-cache hit ratio, TTFT mean/p50/p99, blocks loaded and saved, and TTFT ratios against
the run without a tier. Progress goes to stderr.
Usage: python benchmarks/sim_host_tier.py [--host-kv-gb 0,256] [--num-requests N] [--num-blocks N]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from kvbaton.bench.metrics import summarize
from kvbaton.bench.workloads import create_workload
from kvbaton.bench.workloads.mooncake import DEFAULT_MOONCAKE_TRACE, MOONCAKE_BLOCK_TOKENS, read_mooncake_trace
from kvbaton.sim.run import SimResult, SimSetup, simulate

BLOCK_SIZE = 64


def run_figures(result: SimResult) -> dict[str, Any]:
    o = summarize(result.records, num_gpus=result.num_gpus).overall
    return {"completed": o.num_completed, "hit_ratio": round(o.cache_hit_ratio or 0.0, 4),
            "ttft_mean_s": round(o.ttft.mean_s, 4), "ttft_p50_s": round(o.ttft.p50_s, 4),
            "ttft_p99_s": round(o.ttft.p99_s, 4),
            "host_loaded_blocks": sum(w.host_loaded_blocks for w in result.workers),
            "host_saved_blocks": sum(w.host_saved_blocks for w in result.workers),
            "num_blocks_per_worker": result.num_blocks_per_worker}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host-kv-gb", default="0,256", help="comma-separated host GB per worker; 0 = no tier")
    parser.add_argument("--num-requests", type=int, default=None, help="first N rows (default: the whole trace)")
    parser.add_argument("--num-blocks", type=int, default=0, help="device KV blocks per worker (0: from memory)")
    parser.add_argument("--trace", default=None, help="Mooncake JSONL (default: the bundled synthetic trace)")
    parser.add_argument("--cluster", default="8xmixed")
    parser.add_argument("--policy", default="preble")
    args = parser.parse_args()
    sizes_gb = [float(x) for x in args.host_kv_gb.split(",") if x.strip()]
    if 0.0 not in sizes_gb:
        sizes_gb.insert(0, 0.0)  # the ratios need the run without a tier
    trace = args.trace or DEFAULT_MOONCAKE_TRACE
    rows = read_mooncake_trace(trace, args.num_requests)
    distinct_tokens = len({h for row in rows for h in row["hash_ids"]}) * MOONCAKE_BLOCK_TOKENS  # within a block
    requests = create_workload("mooncake", num_requests=args.num_requests, trace=trace)
    runs: dict[str, dict[str, Any]] = {}
    num_workers = 0
    for host_kv_gb in sizes_gb:
        setup = SimSetup(model="llama-3-8b", gpu="h100", cluster=args.cluster, policy=args.policy,
                         block_size=BLOCK_SIZE, max_model_len=262144, num_blocks=args.num_blocks,
                         host_kv_gb=host_kv_gb)
        started = time.process_time()
        result = simulate(requests, setup)
        num_workers = len(result.workers)
        runs[f"{host_kv_gb:g}"] = figures = run_figures(result)
        print(f"host {host_kv_gb:g} GB/worker: {json.dumps(figures)} ({time.process_time() - started:.0f} CPU-s)",
              file=sys.stderr)
    base = runs["0"]
    ratios = {gb: {"ttft_mean": round(r["ttft_mean_s"] / base["ttft_mean_s"], 3),
                   "ttft_p50": round(r["ttft_p50_s"] / base["ttft_p50_s"], 3),
                   "ttft_p99": round(r["ttft_p99_s"] / base["ttft_p99_s"], 3),
                   "hit_ratio": round(r["hit_ratio"] / base["hit_ratio"], 3) if base["hit_ratio"] else None}
              for gb, r in runs.items() if gb != "0"}
    print(json.dumps({"trace": str(trace), "num_requests": len(requests), "cluster": args.cluster,
                      "policy": args.policy, "model": "llama-3-8b", "gpu": "h100", "block_size": BLOCK_SIZE,
                      "trace_distinct_tokens": distinct_tokens,
                      "device_cache_tokens": base["num_blocks_per_worker"] * BLOCK_SIZE * num_workers,
                      "runs_by_host_kv_gb": runs, "ratios_with_tier_over_without": ratios}))


if __name__ == "__main__":
    main()
