"""`distserve-sharegpt`: the prompt/output length mix of DistServe's OPT-13B ShareGPT experiments.

DistServe (OSDI'24) builds its ShareGPT set differently from vLLM/SGLang's bench_serving: its
`0-prepare-dataset.py` keeps conversations of >= 3 turns, joins a random number of leading turns
into the prompt, takes the next turn as the output, tokenizes with OPT's tokenizer and drops
pairs with prompt + output >= 2,048 tokens (OPT's positions). Prompts are therefore long and
spread almost evenly over 0..2,000 tokens, outputs short and heavy-tailed — unlike the log-normal
`sharegpt-like` stand-in. The quantiles below are the prompt and output lengths of the 300
requests DistServe replayed on A100s for its simulator-alignment study (`simdistserve/benchmarks/
alignment/data-ground-truth/opt-13b-sharegpt-workload/distserve-300-3.exp` in LLMServe/DistServe;
the same 300 head a 1,600-request trace there, as seeded sampling does): prompt mean 780, median
758, P90 1,512; output mean 176, median 67, P90 478. A request draws its prompt length from the
prompt quantile function (linear between the 5 % points), then its output length from the output
quantile function cut at 2,047 - prompt: DistServe's own filter, applied as a condition so the
prompt mix keeps its shape.
"""

from __future__ import annotations

import random

import numpy as np

from kvbaton.bench.tokens import random_tokens
from kvbaton.bench.workloads.base import Draft

# Lengths (tokens) at the 0th, 5th, ..., 100th percentile of the trace named in the docstring.
PROMPT_QUANTILES_TOKENS = (9, 31, 94, 180, 279, 345, 430, 501, 573, 658, 758, 821, 867, 972, 1047, 1157, 1319, 1421,
                           1512, 1718, 2003)
OUTPUT_QUANTILES_TOKENS = (2, 5, 9, 12, 14, 18, 23, 33, 36, 48, 67, 112, 164, 201, 236, 278, 337, 403, 478, 594, 1085)
MAX_TOTAL_TOKENS = 2048  # DistServe drops pairs with prompt + output >= this (OPT-13B's context)
_PERCENTS = np.linspace(0.0, 1.0, len(PROMPT_QUANTILES_TOKENS))


def distserve_lengths(rng: np.random.Generator, num: int) -> list[tuple[int, int]]:
    """`num` (prompt, output) token counts, each pair under DistServe's 2,048-token cut."""
    prompts = np.rint(np.interp(rng.random(num), _PERCENTS, PROMPT_QUANTILES_TOKENS)).astype(np.int64)
    # Output: inverse CDF on [0, F(room)), F the output CDF, room the longest output the cut allows.
    room = MAX_TOTAL_TOKENS - 1 - prompts
    top = np.interp(room, OUTPUT_QUANTILES_TOKENS, _PERCENTS)
    outputs = np.interp(rng.random(num) * top, _PERCENTS, OUTPUT_QUANTILES_TOKENS)
    outputs = np.clip(np.rint(outputs), 1, room).astype(np.int64)
    return [(int(p), int(o)) for p, o in zip(prompts, outputs)]


def generate_distserve_sharegpt(*, num_requests: int | None, vocab_size: int, rng: np.random.Generator,
                                arrival_rng: random.Random, rate: float | None) -> list[Draft]:
    pairs = distserve_lengths(rng, num_requests or 300)
    return [Draft(prompt_parts=(random_tokens(rng, p, vocab_size),), output_tokens=o, group=f"c{i}")
            for i, (p, o) in enumerate(pairs)]
