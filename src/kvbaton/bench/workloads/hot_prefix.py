"""`hot-prefix-burst`: three classes behind one 8,000-token system prompt, with a burst of the hot class.

The scenario of seed 000 §4 ("A workload where reuse harms tail latency"): every prompt starts
with the same 8,000-token system prompt; class A appends a popular 200-token tool instruction
(one shared instruction) and arrives at 100 req/s; class B appends a rare 400-token
customer-specific instruction (one per customer, 4 customers) at 5 req/s; class C has only the
common prefix at 20 req/s. Each request ends with a short unique question (16 tokens) so no two
prompts are identical. During the burst window — from 40 % to 60 % of the nominal duration —
class A arrives `burst_factor` (4) times faster (the nominal duration counts
the burst's extra requests). Each class is its own Poisson process.

`rate` scales all three class rates together so that their nominal sum (125 req/s) becomes
`rate`; the burst multiplies on top.
"""

from __future__ import annotations

import heapq
import random

import numpy as np

from kvbaton.bench.arrivals import piecewise_poisson_arrivals
from kvbaton.bench.tokens import random_token_rows, random_tokens
from kvbaton.bench.workloads.base import Draft, check_positive

CLASS_NAMES = ("A", "B", "C")


def generate_hot_prefix_burst(*, num_requests: int | None, vocab_size: int, rng: np.random.Generator,
                              arrival_rng: random.Random, rate: float | None, system_prompt_tokens: int = 8000,
                              a_tokens: int = 200, b_tokens: int = 400, question_tokens: int = 16,
                              num_b_customers: int = 4, rate_a: float = 100.0, rate_b: float = 5.0,
                              rate_c: float = 20.0, output_tokens: int = 32, burst_factor: float = 4.0,
                              burst_start_frac: float = 0.4, burst_frac: float = 0.2) -> list[Draft]:
    total = num_requests or 1000
    check_positive(total=total, rate_a=rate_a, rate_b=rate_b, rate_c=rate_c, burst_factor=burst_factor,
                   question_tokens=question_tokens, output_tokens=output_tokens, num_b_customers=num_b_customers)
    scale = rate / (rate_a + rate_b + rate_c) if rate is not None else 1.0
    rates = (rate_a * scale, rate_b * scale, rate_c * scale)
    # Expected length including the extra class-A arrivals of the burst, so the burst window
    # sits at burst_start_frac..+burst_frac of the run that `total` requests actually span.
    nominal_s = total / (sum(rates) + (burst_factor - 1) * rates[0] * burst_frac)
    burst_start_s, burst_end_s = burst_start_frac * nominal_s, (burst_start_frac + burst_frac) * nominal_s
    a_schedule = [(0.0, rates[0])]
    if burst_frac > 0 and burst_start_s > 0:
        a_schedule += [(burst_start_s, rates[0] * burst_factor), (burst_end_s, rates[0])]
    # Each class stream gets `total` arrivals; the first `total` of the merge are then exact
    # (no stream can run dry before the merged total-th arrival).
    streams = [piecewise_poisson_arrivals(arrival_rng, total, a_schedule),
               piecewise_poisson_arrivals(arrival_rng, total, [(0.0, rates[1])]),
               piecewise_poisson_arrivals(arrival_rng, total, [(0.0, rates[2])])]
    merged = list(heapq.merge(*[[(t, c) for t in s] for c, s in enumerate(streams)]))[:total]

    system = random_tokens(rng, system_prompt_tokens, vocab_size)
    a_instruction = random_tokens(rng, a_tokens, vocab_size)
    b_instructions = [random_tokens(rng, b_tokens, vocab_size) for _ in range(num_b_customers)]
    questions = random_token_rows(rng, total, question_tokens, vocab_size)
    drafts = []
    for (arrival_s, cls), question in zip(merged, questions):
        if cls == 0:
            parts, group = (system, a_instruction, question), "A"
        elif cls == 1:
            customer = int(rng.integers(num_b_customers))
            parts, group = (system, b_instructions[customer], question), f"B{customer}"
        else:
            parts, group = (system, question), "C"
        drafts.append(Draft(prompt_parts=parts, output_tokens=output_tokens, slo_class=CLASS_NAMES[cls],
                            group=group, arrival_s=arrival_s))
    return drafts
