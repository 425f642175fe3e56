"""The simulator's figures from two source trees on the same runs: which decisions a change moved, and by how much.

Runs a fixed set of simulated clusters (mixed pools, disaggregated pools, admission, adaptive pools,
private KV store nodes) with the tree in `--src` (default: this checkout) and prints one JSON object per
run: a digest of every record's placement and times (equal digests: the change moved no decision there),
and the headline figures. `--compare OTHER_SRC` runs both trees, each in its own process, and prints
the runs whose digests differ with both trees' figures side by side. A run whose `SimSetup` options a
tree lacks is not run there: its row names the options missing, with no digest.

    .venv/bin/python benchmarks/sim_before_after.py --compare /tmp/kvbaton-before/src [--scale 0.5]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()

# name -> (workload, workload options, SimSetup options); scaled by --scale in request count.
RUNS: dict[str, tuple[str, dict, dict]] = {
    "tool-use 4xmixed preble": ("tool-use", {"num_requests": 400, "rate": 30.0},
                                {"cluster": "4xmixed", "policy": "preble"}),
    "tool-use 4xmixed round_robin": ("tool-use", {"num_requests": 400, "rate": 30.0},
                                     {"cluster": "4xmixed", "policy": "round_robin"}),
    "sharegpt 2P2D round_robin": ("sharegpt-like", {"num_requests": 400, "rate": 20.0},
                                  {"cluster": "2P2D", "policy": "round_robin"}),
    "tool-use 2P2D preble": ("tool-use", {"num_requests": 400, "rate": 20.0},
                             {"cluster": "2P2D", "policy": "preble"}),
    "mooncake 8xmixed preble": ("mooncake", {"num_requests": 400},
                                {"cluster": "8xmixed", "policy": "preble", "block_size": 64,
                                 "max_model_len": 262144}),
    # Islands: each worker its own store node (trees before the host tier's removal lack `kv_store_private`;
    # their host tier, `host_kv_gb`, was the same question).
    "mooncake 8xmixed preble private store": ("mooncake", {"num_requests": 400},
                                              {"cluster": "8xmixed", "policy": "preble", "block_size": 64,
                                               "max_model_len": 262144, "kv_store_gb": 256.0,
                                               "kv_store_private": True}),
    **{f"mooncake 4P1D {name} admission": ("mooncake", {"num_requests": 300, "rate": 10.0},
                                             {"cluster": "4P1D:link=nvlink-a100", "policy": "round_robin",
                                              "model": "mistral-7b", "gpu": "a100", "enable_prefix_cache": False,
                                              "admission": name, "admission_slo": (30.0, 0.03),
                                              "max_model_len": 32768})
       for name in ("baseline", "early", "predicted")},
    "shifting-mix 3P1D adaptive pools": ("shifting-mix", {"num_requests": 600, "rate": 24.0},
                                         {"cluster": "3P1D", "policy": "round_robin", "gpu": "a100",
                                          "admission_slo": (1.0, 0.02), "adaptive_pools": True}),
}


def run_here(scale: float) -> list[dict]:
    from kvbaton.bench.metrics import summarize
    from kvbaton.bench.workloads import create_workload
    from kvbaton.sim.run import SimSetup, simulate

    out = []
    for name, (workload, options, setup_options) in RUNS.items():
        missing = sorted(set(setup_options) - set(SimSetup.__dataclass_fields__))
        if missing:
            out.append({"run": name, "digest": None, "missing": missing})
            continue
        options = dict(options, num_requests=max(1, int(options["num_requests"] * scale)))
        requests = create_workload(workload, **options)
        if workload == "mooncake" and "max_model_len" in setup_options:  # rows that fit the context
            limit = setup_options["max_model_len"]
            requests = [r for r in requests if r.num_prompt_tokens + r.output_tokens <= limit]
        result = simulate(requests, SimSetup(**setup_options))
        digest = hashlib.sha256()
        for r in result.records:
            digest.update(repr((r.request_id, r.status, r.worker_ids, r.cached_tokens, round(r.first_token_s or 0, 9),
                                round(r.finish_s or 0, 9))).encode())
        o = summarize(result.records, num_gpus=result.num_gpus).overall
        statuses: dict[str, int] = {}
        for r in result.records:
            statuses[r.status] = statuses.get(r.status, 0) + 1
        out.append({"run": name, "digest": digest.hexdigest()[:16], "statuses": statuses,
                    "hit_ratio": round(o.cache_hit_ratio or 0.0, 4),
                    "ttft_p50_s": round(o.ttft.p50_s, 4), "ttft_p99_s": round(o.ttft.p99_s, 4),
                    "tpot_p50_ms": round(1e3 * o.tpot.p50_s, 3)})
    return out


def run_tree(src: str, scale: float) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=src)
    done = subprocess.run([sys.executable, str(HERE), "--scale", str(scale), "--json"], env=env, check=True,
                          capture_output=True, text=True)
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", default=None, help="the source tree to run (its src folder); default: this one")
    parser.add_argument("--compare", default=None, help="a second source tree: print the runs that differ")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies each run's request count")
    parser.add_argument("--json", action="store_true", help="one JSON line per run (used by --compare)")
    args = parser.parse_args()
    if args.compare is None and args.src is None:
        for row in run_here(args.scale):
            print(json.dumps(row))
        return
    mine = run_tree(args.src or str(HERE.parents[1] / "src"), args.scale)
    if args.compare is None:
        for row in mine:
            print(json.dumps(row))
        return
    theirs = {row["run"]: row for row in run_tree(args.compare, args.scale)}
    same = [row["run"] for row in mine if theirs[row["run"]]["digest"] == row["digest"]]
    changed = [{"run": row["run"], "this": row, "compared": theirs[row["run"]]} for row in mine
               if row["run"] not in same]
    print(json.dumps({"identical": same, "changed": changed}))


if __name__ == "__main__":
    main()
