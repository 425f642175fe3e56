"""Speculative decoding by prompt lookup in the simulator: what K drafts buy as load grows, on one simulated GPU.

The live scheduler's NgramProposer drafts from each request's own tokens; the simulated worker accepts the drafts
equal to the request's next tokens, as a greedy model does. Outputs copy spans of their prompt for a fraction
`--copy-fraction` of their tokens (`kvbaton.sim.outputs.CopyingOutputs`; 0.5: a RAG or code-editing answer
that quotes about half its text). ShareGPT-like lengths on one H100 with a Llama-3-8B-shaped model (roofline
cost model), speculating at any batch size. For each rate: mean TPOT and E2E latency without and with K drafts,
their ratio, the share of drafts accepted, and output tokens per decode row. Next to them, from the cost model in
the same run, what a decode step of the run's mean batch costs with 1 + K rows per request over 1 row: where
it nears 1 + K the GPU is compute-bound and drafts cost what they save (the physical limit speculation runs into).
Prints one JSON line; progress on stderr.

    .venv/bin/python benchmarks/sim_spec_decode.py [--k 4] [--rates 1,10,40,80,160] [--num-requests 400]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from kvbaton.bench.records import RequestRecord
from kvbaton.bench.workloads import create_workload
from kvbaton.core.step import ScheduledChunk, StepPlan
from kvbaton.sim.costs import create_cost_model
from kvbaton.sim.run import SimResult, SimSetup, simulate


def tpot_s(records: list[RequestRecord]) -> float:
    return statistics.mean((r.token_times_s[-1] - r.token_times_s[0]) / (len(r.token_times_s) - 1)
                           for r in records if r.status == "completed" and len(r.token_times_s) > 1)


def e2e_s(records: list[RequestRecord]) -> float:
    return statistics.mean(r.finish_s - r.arrival_s for r in records if r.status == "completed")


def mean_running(result: SimResult) -> float:
    """Requests in flight on average over the run (Little's law: sum of latencies / span)."""
    records = [r for r in result.records if r.status == "completed"]
    span = max(r.finish_s for r in records) - min(r.arrival_s for r in records)
    return sum(r.finish_s - r.arrival_s for r in records) / span


def draft_step_cost(model: str, gpu: str, batch: int, context: int, k: int) -> float:
    """Cost of a decode step of `batch` requests at `context` tokens each with 1 + k rows per request, over 1 row."""
    cost = create_cost_model("roofline", model, gpu)

    def step(rows: int) -> float:
        chunks = tuple(ScheduledChunk(f"r{i}", context, (1,) * rows, (), True) for i in range(batch))
        return cost.plan_s(StepPlan(0, chunks, batch * rows))

    return step(1 + k) / step(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--rates", default="1,10,40,80,160")
    parser.add_argument("--num-requests", type=int, default=400)
    parser.add_argument("--copy-fraction", type=float, default=0.5)
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--workload", default="sharegpt-like")
    args = parser.parse_args()
    rows = []
    for rate in (float(r) for r in args.rates.split(",")):
        requests = create_workload(args.workload, num_requests=args.num_requests, seed=0, rate=rate)
        runs = {}
        for k in (0, args.k):
            setup = SimSetup(model=args.model, gpu=args.gpu, cluster="1xmixed", num_speculative_tokens=k,
                             spec_max_running=1 << 20, output_copy_fraction=args.copy_fraction)
            runs[k] = simulate(requests, setup)
        plain, spec = runs[0], runs[args.k]
        drafts = sum(w.num_draft_tokens for w in spec.workers)
        accepted = sum(w.num_accepted_tokens for w in spec.workers)
        batch = max(1, round(mean_running(plain)))
        context = round(statistics.mean(w.num_prompt_tokens + w.output_tokens / 2 for w in requests))
        row = {"rate": rate, "tpot_ms": [round(1000 * tpot_s(plain.records), 3), round(1000 * tpot_s(spec.records), 3)],
               "e2e_s": [round(e2e_s(plain.records), 4), round(e2e_s(spec.records), 4)],
               "tpot_spec_over_plain": round(tpot_s(spec.records) / tpot_s(plain.records), 3),
               "e2e_spec_over_plain": round(e2e_s(spec.records) / e2e_s(plain.records), 3),
               "drafts_accepted": round(accepted / drafts, 3) if drafts else None,
               "mean_running_without": batch,
               "step_cost_with_drafts_over_without": round(draft_step_cost(args.model, args.gpu, batch, context,
                                                                           args.k), 3)}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps({"setup": {"model": args.model, "gpu": args.gpu, "workload": args.workload, "k": args.k,
                                "copy_fraction": args.copy_fraction, "num_requests": args.num_requests},
                      "rates": rows}))


if __name__ == "__main__":
    main()
