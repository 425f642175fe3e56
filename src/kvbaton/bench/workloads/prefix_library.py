"""`tool-use` and `programming`: a library of long shared prefixes picked by popularity, plus a unique tail.

Both follow Preble (Srivatsa et al., ICLR 2025, arXiv 2407.00023), Table 1 / Section 2.1, whose
figures we quote from the paper as we read it (prompt and output lengths are mean ± std in
tokens; "sharing" is the fraction of prompt tokens shared with other requests):

- tool use (ToolBench): prompt 1,835 ± 742, output 43 ± 16, sharing 85 %; prompts are an
  instruction header, the schema of the tool the request may call, then the user query; tool
  popularity is Zipf with exponent 1.1. We use 64 tool schemas of 1,450 ± 700 tokens behind a
  300-token header and 130 ± 50-token queries.
- programming (APPS): prompt 3,871 ± 1,656, output 190 ± 343, sharing 97 %; prompts are
  few-shot solved examples (shared) followed by the problem statement. We use 8 few-shot sets
  of 3,700 ± 1,650 tokens and 130 ± 50-token problems, uniform popularity.

The lengths are chosen so that the mean prompt matches the paper and the *measured* sharing
(`kvbaton bench --describe`, shared with an earlier request at the token level) lands in the
paper's 85–97 % band at the default request count; fewer requests share less (each prefix's
first use is a miss), more requests share more.
"""

from __future__ import annotations

import random

import numpy as np

from kvbaton.bench.tokens import random_tokens
from kvbaton.bench.workloads.base import (
    Draft, check_positive, choose_indices, lognormal_lengths, scaled, split_rng, zipf_weights,
)


def _library_workload(*, num_requests: int, vocab_size: int, rng: np.random.Generator, header_tokens: int,
                      num_prefixes: int, prefix_mean_tokens: float, prefix_std_tokens: float,
                      tail_mean_tokens: float, tail_std_tokens: float, output_mean_tokens: float,
                      output_std_tokens: float, max_output_tokens: int, zipf_exponent: float,
                      length_scale: float, group_label: str) -> list[Draft]:
    check_positive(num_requests=num_requests, num_prefixes=num_prefixes, length_scale=length_scale)
    rng, token_rng = split_rng(rng)
    header = random_tokens(token_rng, scaled(header_tokens, length_scale), vocab_size) if header_tokens > 0 else None
    prefix_lengths = lognormal_lengths(rng, num_prefixes, prefix_mean_tokens, prefix_std_tokens, low=64)
    prefixes = [random_tokens(token_rng, scaled(n, length_scale), vocab_size) for n in prefix_lengths]
    picks = choose_indices(rng, num_requests, zipf_weights(num_prefixes, zipf_exponent))
    tail_lengths = lognormal_lengths(rng, num_requests, tail_mean_tokens, tail_std_tokens, low=4)
    output_lengths = lognormal_lengths(rng, num_requests, output_mean_tokens, output_std_tokens, low=1,
                                       high=max_output_tokens)
    drafts = []
    for pick, tail_len, out_len in zip(picks, tail_lengths, output_lengths):
        tail = random_tokens(token_rng, scaled(tail_len, length_scale), vocab_size)
        parts = (header, prefixes[pick], tail) if header is not None else (prefixes[pick], tail)
        drafts.append(Draft(prompt_parts=parts, output_tokens=out_len, group=f"{group_label}{pick}"))
    return drafts


def generate_tool_use(*, num_requests: int | None, vocab_size: int, rng: np.random.Generator,
                      arrival_rng: random.Random, rate: float | None, num_tools: int = 64,
                      header_tokens: int = 300, tool_mean_tokens: float = 1450, tool_std_tokens: float = 700,
                      query_mean_tokens: float = 130, query_std_tokens: float = 50, output_mean_tokens: float = 43,
                      output_std_tokens: float = 16, zipf_exponent: float = 1.1,
                      length_scale: float = 1.0) -> list[Draft]:
    return _library_workload(
        num_requests=num_requests or 1000, vocab_size=vocab_size, rng=rng, header_tokens=header_tokens,
        num_prefixes=num_tools, prefix_mean_tokens=tool_mean_tokens, prefix_std_tokens=tool_std_tokens,
        tail_mean_tokens=query_mean_tokens, tail_std_tokens=query_std_tokens, output_mean_tokens=output_mean_tokens,
        output_std_tokens=output_std_tokens, max_output_tokens=512, zipf_exponent=zipf_exponent,
        length_scale=length_scale, group_label="tool")


def generate_programming(*, num_requests: int | None, vocab_size: int, rng: np.random.Generator,
                         arrival_rng: random.Random, rate: float | None, num_example_sets: int = 8,
                         examples_mean_tokens: float = 3700, examples_std_tokens: float = 1650,
                         problem_mean_tokens: float = 130, problem_std_tokens: float = 50,
                         output_mean_tokens: float = 190, output_std_tokens: float = 343, zipf_exponent: float = 0.0,
                         length_scale: float = 1.0) -> list[Draft]:
    return _library_workload(
        num_requests=num_requests or 1000, vocab_size=vocab_size, rng=rng, header_tokens=0,
        num_prefixes=num_example_sets, prefix_mean_tokens=examples_mean_tokens,
        prefix_std_tokens=examples_std_tokens, tail_mean_tokens=problem_mean_tokens,
        tail_std_tokens=problem_std_tokens, output_mean_tokens=output_mean_tokens,
        output_std_tokens=output_std_tokens, max_output_tokens=4096, zipf_exponent=zipf_exponent,
        length_scale=length_scale, group_label="fewshot")
