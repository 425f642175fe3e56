"""Issue 21's must-show: the cluster KV store and transfer-aware placement, simulated, against islands and round-robin.

8 mixed workers, one H100 each, a Llama-3-8B-shaped model (roofline cost model, context raised to 256k
for the Mooncake trace), 64-token blocks, each worker's KV pool sized from the GPU's memory. Five runs
of the same requests:

- `round_robin`: no store;
- `preble`: islands: each worker its own prefix cache plus its own store node of --store-gb GB of DRAM
  (`kv_store_private`: the node serves that worker alone, nothing crosses the NIC; the same memory as the
  shared store's), and --store-disk-gb GB of disk below it;
- `store`: the `conductor` policy (least predicted queue + store load + prefill) with the cluster KV
  store: --store-gb GB of DRAM per node (one node per worker) shared by all, write-through, loads priced
  over PCIe 5 (host link), 200 Gb InfiniBand between nodes and a 5 GB/s disk (none unless --store-disk-gb);
- `preble_store`: preble with the same shared store, its P_i pricing the loads (for comparison);
- `conductor_islands`: the conductor on the islands' private nodes: what pooling the store adds for the
  transfer-aware policy, apart from what the policy adds.

Per run: `hit_ratio` (prompt tokens served from any cache or the store over prompt tokens), the pooled
bound `pooled_lru_hit_ratio` (`kvbaton.bench.pooled`: one LRU cache of all the memory the run has, device
KV plus store DRAM and disk, at block granularity, in arrival order) and `hit_over_pooled`, TTFT p50/p99
and their ratios to round-robin's, blocks loaded from the store, and the busiest worker's busy time over
the mean (1.0: no hot spot). Prints one JSON line; progress goes to stderr.
Usage: python benchmarks/kv_store_sim.py [--trace FILE | --workload conversation] [--num-requests N]
                                          [--sessions S] [--store-gb 256] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from kvbaton.bench.metrics import summarize
from kvbaton.bench.pooled import pooled_lru_hit_ratio
from kvbaton.bench.workloads import create_workload
from kvbaton.bench.workloads.mooncake import DEFAULT_MOONCAKE_TRACE
from kvbaton.sim.run import SimSetup, simulate

BLOCK_SIZE = 64
KV_BYTES_PER_TOKEN = 131072  # llama-3-8b: 32 layers x K and V x 8 KV heads x 128 x 2 bytes


def run_setups(store_gb: float, disk_gb: float, cluster: str, seed: int) -> dict[str, SimSetup]:
    base = SimSetup(model="llama-3-8b", gpu="h100", cluster=cluster, block_size=BLOCK_SIZE, max_model_len=262144,
                    seed=seed)
    return {"round_robin": SimSetup(**{**_fields(base), "policy": "round_robin"}),
            "preble": SimSetup(**{**_fields(base), "policy": "preble", "kv_store_gb": store_gb,
                                  "kv_store_disk_gb": disk_gb, "kv_store_private": True}),
            "store": SimSetup(**{**_fields(base), "policy": "conductor", "kv_store_gb": store_gb,
                                 "kv_store_disk_gb": disk_gb}),
            "preble_store": SimSetup(**{**_fields(base), "policy": "preble", "kv_store_gb": store_gb,
                                        "kv_store_disk_gb": disk_gb}),
            "conductor_islands": SimSetup(**{**_fields(base), "policy": "conductor", "kv_store_gb": store_gb,
                                             "kv_store_disk_gb": disk_gb, "kv_store_private": True})}


def _fields(setup: SimSetup) -> dict[str, Any]:
    return {name: getattr(setup, name) for name in setup.__dataclass_fields__}


def memory_blocks(setup: SimSetup, num_workers: int, num_device_blocks: int) -> int:
    """Blocks of all the KV memory a run has: every worker's device pool plus its store node's DRAM and disk."""
    store_gb = setup.kv_store_gb + setup.kv_store_disk_gb
    return num_workers * (num_device_blocks + int(store_gb * 1e9 // (KV_BYTES_PER_TOKEN * BLOCK_SIZE)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="mooncake", choices=("mooncake", "conversation"))
    parser.add_argument("--trace", default=None, help="Mooncake JSONL (default: the bundled synthetic trace)")
    parser.add_argument("--num-requests", type=int, default=None, help="first N requests (default: all)")
    parser.add_argument("--sessions", type=int, default=2000, help="conversation: sessions")
    parser.add_argument("--session-rate", type=float, default=2.0, help="conversation: sessions started per s")
    parser.add_argument("--store-gb", type=float, default=256.0, help="store DRAM per node (one node per worker)")
    parser.add_argument("--store-disk-gb", type=float, default=0.0, help="store disk per node")
    parser.add_argument("--cluster", default="8xmixed")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.workload == "mooncake":
        trace = args.trace or str(DEFAULT_MOONCAKE_TRACE)
        requests = create_workload("mooncake", num_requests=args.num_requests, trace=trace)
        described: dict[str, Any] = {"trace": trace}
    else:
        requests = create_workload("conversation", num_requests=args.num_requests, seed=args.seed,
                                   num_sessions=args.sessions, session_rate=args.session_rate)
        described = {"sessions": args.sessions, "session_rate": args.session_rate}
    runs: dict[str, dict[str, Any]] = {}
    bounds: dict[int, float] = {}
    for name, setup in run_setups(args.store_gb, args.store_disk_gb, args.cluster, args.seed).items():
        started = time.process_time()
        result = simulate(requests, setup)
        o = summarize(result.records, num_gpus=result.num_gpus).overall
        capacity = memory_blocks(setup, len(result.workers), result.num_blocks_per_worker)
        if capacity not in bounds:
            bounds[capacity] = pooled_lru_hit_ratio(requests, capacity, BLOCK_SIZE).hit_ratio
        hit = o.cache_hit_ratio or 0.0
        busy = [w.busy_s for w in result.workers]  # a hot spot shows as one worker far busier than the mean
        runs[name] = {"policy": setup.policy, "completed": o.num_completed, "hit_ratio": round(hit, 4),
                      "pooled_lru_hit_ratio": round(bounds[capacity], 4),
                      "hit_over_pooled": round(hit / bounds[capacity], 3) if bounds[capacity] else None,
                      "ttft_p50_s": round(o.ttft.p50_s, 4), "ttft_p99_s": round(o.ttft.p99_s, 4),
                      "ttft_mean_s": round(o.ttft.mean_s, 4), "memory_blocks": capacity,
                      "store_loaded_blocks": sum(w.store_loaded_blocks for w in result.workers),
                      "busy_max_over_mean": round(max(busy) / (sum(busy) / len(busy)), 3) if sum(busy) else None}
        if result.store is not None:  # loads that queued for a node's NIC or disk another worker's load held
            runs[name]["store_link_waits"] = result.store.link_waits
            runs[name]["store_link_wait_s"] = round(result.store.link_wait_s, 3)
        print(f"{name}: {json.dumps(runs[name])} ({time.process_time() - started:.0f} CPU-s)", file=sys.stderr)
    base = runs["round_robin"]
    for run in runs.values():
        run["ttft_p50_over_round_robin"] = round(run["ttft_p50_s"] / base["ttft_p50_s"], 3)
        run["ttft_p99_over_round_robin"] = round(run["ttft_p99_s"] / base["ttft_p99_s"], 3)
    print(json.dumps({"workload": args.workload, **described, "num_requests": len(requests),
                      "cluster": args.cluster, "model": "llama-3-8b", "gpu": "h100", "block_size": BLOCK_SIZE,
                      "store_gb_per_node": args.store_gb, "store_disk_gb_per_node": args.store_disk_gb,
                      "seed": args.seed, "runs": runs}))


if __name__ == "__main__":
    main()
