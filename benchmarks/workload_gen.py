"""Workload generation figures: generation speed, the Mooncake trace statistics, measured sharing.

Prints one JSON line per figure:
- `shared_prefix_100k`: seconds to generate 100,000 `shared-prefix` requests (SGLang defaults:
  64 groups, 2,048-token system prompts, 128-token questions) — the issue asks for seconds.
- `mooncake`: request count, mean input/output tokens (published: 3,993 / 15,325 / 149) and
  the measured sharing of the bundled trace.
- `preble/<workload>`: mean prompt/output tokens and measured sharing per seed, against the
  paper's 85–97 % band.
- `pool_formula`: seed 000 §6, min(2 * 5.6, 1 * 10) / 3 = 10/3 req/s per GPU.

    .venv/bin/python benchmarks/workload_gen.py [--seeds 0 1 2] [--num-requests 100000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from kvbaton.bench.metrics import pool_goodput_per_gpu
from kvbaton.bench.sharing import describe_workload
from kvbaton.bench.workloads import PREBLE_WORKLOADS, create_workload
from kvbaton.bench.workloads.mooncake import DEFAULT_MOONCAKE_TRACE

PREBLE_PAPER = {  # Preble Table 1 as quoted in the generator docstrings: (prompt mean, output mean, sharing)
    "tool-use": (1835, 43, 0.85), "agent": (2285, 16, 0.97), "programming": (3871, 190, 0.97),
    "video-qa": (9865, 4, 0.88), "long-doc-qa": (23474, 16, 0.91),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--num-requests", type=int, default=100_000)
    args = parser.parse_args()

    start = time.perf_counter()
    requests = create_workload("shared-prefix", num_requests=args.num_requests, seed=0)
    elapsed_s = time.perf_counter() - start
    print(json.dumps({"figure": "shared_prefix_100k", "num_requests": len(requests), "seconds": round(elapsed_s, 3),
                      "prompt_tokens": sum(r.num_prompt_tokens for r in requests)}), flush=True)
    del requests

    if DEFAULT_MOONCAKE_TRACE.is_file():
        start = time.perf_counter()
        trace = create_workload("mooncake")
        load_s = time.perf_counter() - start
        stats = describe_workload(trace)
        print(json.dumps({"figure": "mooncake", "num_requests": stats.num_requests,
                          "mean_input_tokens": round(stats.mean_prompt_tokens, 1),
                          "mean_output_tokens": round(stats.mean_output_tokens, 1),
                          "sharing": round(stats.sharing_ratio, 4), "load_seconds": round(load_s, 3),
                          "published": {"num_requests": 3993, "mean_input_tokens": 15325, "mean_output_tokens": 149}}),
              flush=True)
        del trace

    for name in PREBLE_WORKLOADS:
        per_seed = [describe_workload(create_workload(name, seed=seed)) for seed in args.seeds]
        paper_prompt, paper_output, paper_sharing = PREBLE_PAPER[name]
        print(json.dumps({
            "figure": f"preble/{name}", "seeds": args.seeds,
            "sharing": [round(s.sharing_ratio, 4) for s in per_seed],
            "mean_prompt_tokens": round(statistics.fmean(s.mean_prompt_tokens for s in per_seed), 1),
            "mean_output_tokens": round(statistics.fmean(s.mean_output_tokens for s in per_seed), 1),
            "paper": {"prompt_tokens": paper_prompt, "output_tokens": paper_output, "sharing": paper_sharing},
            "in_85_97_band": all(0.85 <= s.sharing_ratio <= 0.97 for s in per_seed),
        }), flush=True)

    print(json.dumps({"figure": "pool_formula", "g_p": 2, "g_d": 1, "rate_p": 5.6, "rate_d": 10.0,
                      "per_gpu_rps": pool_goodput_per_gpu(2, 1, 5.6, 10.0), "expected": 10 / 3}))


if __name__ == "__main__":
    main()
