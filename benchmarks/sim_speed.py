"""Simulator speed: CPU-seconds per 1,000 simulated requests, with prefix caching and PD on 16 workers.

Runs the real LocalScheduler, BlockPool, RadixCache and router policy code for every step of every
simulated worker; workload generation is timed separately and excluded. Configurations: 8P8D
(disaggregated, KV handoffs over InfiniBand) and 16xmixed, preble and round_robin, prefix cache on,
plus one run with the prefix cache off (closest to Vidur's setting). Targets (issue 6): <= 0.5 CPU-s;
Vidur 0.0.26 ~4.5 and DistServe's simulator 0.6-1 CPU-s per 1,000 requests on this machine class.
Usage: python benchmarks/sim_speed.py [--num-requests 2000 --workload tool-use --rate 40 --json]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from kvbaton.bench.workloads import create_workload
from kvbaton.sim.run import SimSetup, simulate

# CPU-s per 1,000 requests measured on this machine class (issue 6): Vidur 0.0.26 without prefix cache
# or PD, and DistServe's simulator (0.6-1; its midpoint). vidur is not installed by the project, so these
# are quoted references, not measured in this run; the target is 0.5.
REFERENCE_CPU_S_PER_1000 = {"vidur": 4.5, "distserve": 0.8, "target": 0.5}

CONFIGS = (
    ("8P8D", "preble", True),
    ("8P8D", "round_robin", True),
    ("16xmixed", "preble", True),
    ("16xmixed", "round_robin", False),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="tool-use")
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=40.0)
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    started = time.process_time()
    requests = create_workload(args.workload, num_requests=args.num_requests, seed=0, rate=args.rate)
    workload_s = time.process_time() - started
    stats = {"workload": args.workload, "num_requests": len(requests),
             "mean_prompt_tokens": float(np.mean([r.num_prompt_tokens for r in requests])),
             "mean_output_tokens": float(np.mean([r.output_tokens for r in requests])),
             "workload_gen_cpu_s_per_1000": 1000 * workload_s / len(requests), "runs": []}
    for cluster, policy, prefix_cache in CONFIGS:
        setup = SimSetup(model=args.model, gpu=args.gpu, cluster=cluster, policy=policy,
                         enable_prefix_cache=prefix_cache)
        started = time.process_time()
        result = simulate(requests, setup)
        cpu_s = time.process_time() - started
        steps = sum(w.num_steps for w in result.workers)
        stats["runs"].append({"cluster": cluster, "policy": policy, "prefix_cache": prefix_cache,
                              "cpu_s_per_1000_requests": round(1000 * cpu_s / len(requests), 3),
                              "num_steps": steps, "us_per_step": round(1e6 * cpu_s / max(steps, 1), 1),
                              "completed": sum(r.completed for r in result.records)})
    # The figure: prefix caching and PD on 16 workers (the first configuration, 8P8D preble).
    headline = stats["runs"][0]["cpu_s_per_1000_requests"]
    stats["reference_cpu_s_per_1000"] = REFERENCE_CPU_S_PER_1000
    stats["ratio_pd_prefix_cache_over_reference"] = {
        name: round(headline / ref, 3) for name, ref in REFERENCE_CPU_S_PER_1000.items()}
    if args.json:
        print(json.dumps(stats))
        return
    print(f"{stats['workload']}: {len(requests)} requests, mean prompt {stats['mean_prompt_tokens']:.0f} tokens, "
          f"mean output {stats['mean_output_tokens']:.0f}; workload generation "
          f"{stats['workload_gen_cpu_s_per_1000']:.2f} CPU-s per 1,000 (excluded)")
    for run in stats["runs"]:
        cache = "prefix cache" if run["prefix_cache"] else "no prefix cache"
        print(f"  {run['cluster']:<9} {run['policy']:<12} {cache:<16} {run['cpu_s_per_1000_requests']:.2f} CPU-s "
              f"per 1,000 requests ({run['num_steps']} steps, {run['us_per_step']:.0f} us/step, "
              f"{run['completed']} completed)")


if __name__ == "__main__":
    main()
