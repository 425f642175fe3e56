"""Must-show 2, live (issue 7): an overloaded 1P+1D cluster answers 429 at once instead of letting TTFT grow.

For each admission variant a fresh `kvbaton serve --prefill 1 --decode 1 --admission V --ttft-slo T
--tpot-slo P --cost-profile F` serves SmolLM2 on this CPU, and the live driver sends the same
ShareGPT-like burst of long prompts at `--rate` (about twice what the prefill worker holds here).
The cost profile is measured first by `kvbaton profile --quick --threads 1` (each of the two workers
gets one thread), unless `--profile FILE` is given. The table: requests completed and refused,
how long a refusal took (arrival to the 429), TTFT of the completed ones at p50/p99/max, TTFT in
the last quarter of arrivals (the queue's growth shows there), SLO attainment over all requests and
goodput (requests meeting both SLOs per second of the run). One JSON line sums it up with the
ratio of none's p99 TTFT to each variant's.

    .venv/bin/python benchmarks/admission_live.py [--variants none,baseline,predicted] [--rate 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from routing_live import start_server, stop_server  # noqa: E402

from kvbaton.bench.driver import DriverConfig, discover_model, run_live  # noqa: E402
from kvbaton.bench.metrics import SLO, summarize  # noqa: E402
from kvbaton.bench.records import RequestRecord  # noqa: E402
from kvbaton.bench.workloads import create_workload  # noqa: E402


def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def profile(args: argparse.Namespace, out: Path) -> None:
    subprocess.run([sys.executable, "-m", "kvbaton.cli", "profile", "--model", args.model, "--quick",
                    "--threads", str(args.threads_per_worker), "--out", str(out)], check=True,
                   stdout=subprocess.DEVNULL)


def figures(records: list[RequestRecord], slo: SLO, last_arrival_s: float) -> dict[str, float | int | None]:
    done = [r for r in records if r.status == "completed"]
    refused = [r for r in records if r.status == "rejected"]
    ttfts = [r.first_token_s - r.arrival_s for r in done if r.first_token_s is not None]
    start_s = min(r.arrival_s for r in records)
    late = [r.first_token_s - r.arrival_s for r in done
            if r.first_token_s is not None and r.arrival_s - start_s >= 0.75 * last_arrival_s]
    summary = summarize(records, slo)
    return {
        "completed": len(done), "rejected": len(refused),
        "failed": sum(r.status == "failed" for r in records),
        "reject_p50_s": _pct([r.finish_s - r.arrival_s for r in refused], 0.5),
        "reject_max_s": max((r.finish_s - r.arrival_s for r in refused), default=None),
        "ttft_p50_s": _pct(ttfts, 0.5), "ttft_p99_s": _pct(ttfts, 0.99), "ttft_max_s": max(ttfts, default=None),
        "ttft_last_quarter_mean_s": statistics.fmean(late) if late else None,
        "slo_attainment": summary.overall.slo_attainment, "goodput_rps": summary.overall.goodput_rps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--variants", default="none,baseline,predicted")
    parser.add_argument("--num-requests", type=int, default=60)
    parser.add_argument("--rate", type=float, default=4.0, help="arrivals per second (Poisson)")
    parser.add_argument("--prompt-mean", type=float, default=512)
    parser.add_argument("--output-tokens", type=float, default=16)
    parser.add_argument("--ttft-slo", type=float, default=3.0)
    parser.add_argument("--tpot-slo", type=float, default=0.5)
    parser.add_argument("--profile", default="", help="a `kvbaton profile` file (default: measure one first)")
    parser.add_argument("--threads-per-worker", type=int, default=1)
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--request-timeout-s", type=float, default=600.0)
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    slo = SLO(args.ttft_slo, args.tpot_slo)
    requests = create_workload("sharegpt-like", num_requests=args.num_requests, seed=args.seed, rate=args.rate,
                               prompt_mean_tokens=args.prompt_mean, prompt_std_tokens=args.prompt_mean / 4,
                               output_mean_tokens=args.output_tokens, output_std_tokens=0.0)
    last_arrival_s = max(r.arrival_s for r in requests)
    with tempfile.TemporaryDirectory() as tmp:
        profile_path = Path(args.profile) if args.profile else Path(tmp) / "profile.json"
        if not args.profile:
            profile(args, profile_path)
        results: dict[str, dict[str, float | int | None]] = {}
        for variant in args.variants.split(","):
            extra = ["--admission", variant, "--ttft-slo", str(args.ttft_slo), "--tpot-slo", str(args.tpot_slo),
                     "--cost-profile", str(profile_path)] if variant != "none" else []
            server = start_server(args, "round_robin", ["--prefill", "1", "--decode", "1"], extra)
            try:
                config = DriverConfig(url=server.url, model=discover_model(server.url),
                                      timeout_s=args.request_timeout_s)
                results[variant] = figures(run_live(requests, config), slo, last_arrival_s)
            finally:
                stop_server(server)
    keys = list(next(iter(results.values())))
    print(f"{'variant':<10}" + "".join(f"{k:>26}" for k in keys))
    for variant, row in results.items():
        print(f"{variant:<10}" + "".join(f"{'-' if v is None else round(v, 3):>26}" for v in row.values()))
    base_p99 = results.get("none", {}).get("ttft_p99_s")
    print(json.dumps({
        "benchmark": "admission_live", "rate_rps": args.rate, "num_requests": args.num_requests,
        "ttft_slo_s": args.ttft_slo, "tpot_slo_s": args.tpot_slo, "variants": results,
        "ttft_p99_ratio_none_over": {v: round(base_p99 / r["ttft_p99_s"], 2) for v, r in results.items()
                                     if base_p99 and r.get("ttft_p99_s")},
    }))


if __name__ == "__main__":
    main()
