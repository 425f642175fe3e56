"""Must-show 2 (issue 7): Mooncake's admission variants under overload (2x by default) in the simulator.

Mooncake's setting (FAST'25, overload-oriented scheduling): its own trace (long prompts, short outputs:
the bundled synthetic trace has mean input 15,325 and output 149 tokens) on a cluster of several prefill
and decode instances with *both* stages near capacity. Then wasted prefills (baseline: refused by the
decode stage after the prefill ran) cost other requests their prefill, and a request reaches decode a
prefill-queue later than it arrives, so today's decode load (early) is not the one it meets there
(predicted). Defaults: the trace's first 1,200 rows that fit Mistral-7B's 32k context (mean prompt
7,758, output 217), four prefill workers and one decode worker on A100s (roofline: a prefill worker
serves ~1.26 of these prompts a second, the decode worker ~4.8 requests a second at 30 ms a step, so
both stages are near capacity together), no prefix cache (admission prices uncached prefills), TTFT
30 s as Mooncake's, TPOT 30 ms. What binds at decode is KV: the handoff holds each admitted request's
prompt blocks on the decode worker from its arrival (DESIGN: the decode worker reserves before the
prefill runs), so the prompts queued for prefill fill the decode worker's KV before its step time
reaches the TPOT SLO.
The rate is `--overload` times the goodput with no admission control (`--base-rate`, or found by
bisection on both SLOs at `--attainment`); `--overload 1.5,2,2.5,3` sweeps. Each variant — none,
baseline, early, predicted (`kvbaton.router.admission`), all with the same SLOs and max_load — replays
the same requests; every variant but none keeps the decode stage's own gate. The table: rejected
requests, of which refused by the decode gate after their prefill ran, goodput (requests meeting both
SLOs per second), SLO attainment over all requests and over admitted ones, and the prefill tokens
thrown away by decode-gate refusals. The rest of the rejected were refused at arrival for the prefill
stage (predicted TTFT over the SLO).
`--reserve-ahead-tokens N` makes handoffs reserve their decode KV late (once their prefill worker has at
most N prompt tokens left ahead of them) instead of on arrival.
`--workload sharegpt-like` runs the earlier decode-bound 1P1D chat setting instead (give its options).
Usage: python benchmarks/admission_overload.py [--base-rate R] [--overload 2.0]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from kvbaton.bench.metrics import SLO, max_goodput_rate, summarize
from kvbaton.bench.workloads import create_workload
from kvbaton.bench.workloads.base import WorkloadRequest
from kvbaton.router.admission import ADMISSION_POLICIES
from kvbaton.sim.run import SimSetup, simulate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("mooncake", "sharegpt-like"), default="mooncake")
    parser.add_argument("--num-requests", type=int, default=1200, help="trace rows read / requests generated")
    parser.add_argument("--overload", default="2.0", help="times the base rate; a comma list sweeps")
    parser.add_argument("--model", default="mistral-7b")
    parser.add_argument("--max-model-len", type=int, default=32768, help="longer trace requests are left out")
    parser.add_argument("--gpu", default="a100")
    parser.add_argument("--cluster", default="4P1D:link=nvlink-a100")
    parser.add_argument("--prompt-mean", type=float, default=1500, help="sharegpt-like only")
    parser.add_argument("--output-mean", type=float, default=1000, help="sharegpt-like only")
    parser.add_argument("--ttft-slo", type=float, default=30.0)
    parser.add_argument("--tpot-slo", type=float, default=0.03)
    parser.add_argument("--attainment", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reserve-ahead-tokens", type=int, default=None, metavar="N",
                        help="late KV reservation (N prompt tokens ahead on the prefill worker); default on arrival")
    parser.add_argument("--base-rate", type=float, default=None,
                        help="the no-admission goodput to overload (default: find it by bisection first)")
    args = parser.parse_args()
    slo = SLO(args.ttft_slo, args.tpot_slo)
    if args.workload == "mooncake":  # the trace's own order and relative timing, its mean rate scaled to 1 req/s
        rows = create_workload("mooncake", num_requests=args.num_requests, rate=1.0)
        fits = [r for r in rows if r.num_prompt_tokens + r.output_tokens <= args.max_model_len]
        base = [replace(r, arrival_s=r.arrival_s - fits[0].arrival_s) for r in fits]
    else:
        base = create_workload("sharegpt-like", num_requests=args.num_requests, seed=args.seed, rate=1.0,
                               prompt_mean_tokens=args.prompt_mean, prompt_std_tokens=args.prompt_mean / 3,
                               output_mean_tokens=args.output_mean, output_std_tokens=args.output_mean)
    setup = SimSetup(model=args.model, gpu=args.gpu, cluster=args.cluster, cost_model="roofline",
                     max_model_len=args.max_model_len, enable_prefix_cache=False, seed=args.seed,
                     admission_slo=(slo.ttft_s, slo.tpot_s), reserve_ahead_tokens=args.reserve_ahead_tokens)

    def at_rate(rate: float) -> list[WorkloadRequest]:
        return [replace(r, arrival_s=r.arrival_s / rate) for r in base]

    started = time.perf_counter()
    if args.base_rate is None:
        search = max_goodput_rate(lambda rate: simulate(at_rate(rate), setup).records, slo, args.attainment,
                                  low=0.05, high=20.0, tol=0.05, joint=True)
        base_rate, how = search.rate_rps, f"bisection, {len(search.probes)} probes"
    else:
        base_rate, how = args.base_rate, "given"
    for overload in (float(x) for x in args.overload.split(",")):
        rate = overload * base_rate
        reserving = ("on arrival" if args.reserve_ahead_tokens is None
                     else f"{args.reserve_ahead_tokens} tokens ahead of the prefill")
        print(f"{args.workload}: {args.model} on {args.gpu}, {args.cluster}, KV reserved {reserving}; mean prompt "
              f"{sum(r.num_prompt_tokens for r in base) / len(base):.0f}, output "
              f"{sum(r.output_tokens for r in base) / len(base):.0f} tokens; SLO TTFT {slo.ttft_s:g} s TPOT "
              f"{slo.tpot_s:g} s; goodput without admission {base_rate:.2f} req/s "
              f"({how}); offered {rate:.2f} req/s ({overload:g}x), {len(base)} requests")
        print(f"{'admission':<10} {'rejected':>8} {'for decode at arrival':>21} {'at decode':>9} {'goodput':>8} "
              f"{'attain all':>10} {'attain admitted':>15} {'wasted prefill tokens':>21}")
        requests = at_rate(rate)
        for name in ADMISSION_POLICIES:
            records = simulate(requests, replace(setup, admission=name)).records
            overall = summarize(records, slo).overall
            admitted = [r for r in records if r.status != "rejected"]
            admitted_attainment = summarize(admitted, slo).overall.slo_attainment if admitted else 0.0
            at_decode = [r for r in records if r.status == "rejected" and r.reason.startswith("decode")
                         and r.first_token_s is not None]
            # Refused at arrival because of the decode stage (early, predicted): the prefill never ran.
            for_decode = sum(1 for r in records if r.status == "rejected" and r.reason.startswith("decode")
                             and r.first_token_s is None)
            wasted = sum(r.prompt_tokens for r in at_decode)
            print(f"{name:<10} {overall.num_rejected:>8} {for_decode:>21} {len(at_decode):>9} "
                  f"{overall.goodput_rps or 0.0:>8.2f} {overall.slo_attainment or 0.0:>10.3f} "
                  f"{admitted_attainment or 0.0:>15.3f} {wasted:>21}")
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
