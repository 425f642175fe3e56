"""`shared-prefix`: G groups of prompts, each group one system prompt plus a unique question.

The shape and defaults are SGLang bench_serving's "generated-shared-prefix" dataset
(`--gsp-num-groups 64 --gsp-prompts-per-group 16 --gsp-system-prompt-len 2048
--gsp-question-len 128 --gsp-output-len 256`). SGLang draws random text; here the prompts are
random token ids, so the lengths are exact. Optional Zipf popularity over groups
(`zipf_exponent` > 0) replaces the equal P-per-group split with skewed draws: group i is picked
with weight 1/(i+1)**s, which is what a hot-prefix experiment sweeps.
"""

from __future__ import annotations

import random

import numpy as np

from kvbaton.bench.tokens import random_token_rows, random_tokens
from kvbaton.bench.workloads.base import Draft, check_positive, choose_indices, zipf_weights


def generate_shared_prefix(*, num_requests: int | None, vocab_size: int, rng: np.random.Generator,
                           arrival_rng: random.Random, rate: float | None, num_groups: int = 64,
                           prompts_per_group: int = 16, system_prompt_tokens: int = 2048,
                           question_tokens: int = 128, output_tokens: int = 256, zipf_exponent: float = 0.0,
                           shuffle: bool = True) -> list[Draft]:
    """num_requests defaults to num_groups * prompts_per_group; groups are filled round-robin
    (equal sizes) unless zipf_exponent > 0; `shuffle` interleaves the groups in time as SGLang does,
    otherwise the groups arrive one after another."""
    check_positive(num_groups=num_groups, prompts_per_group=prompts_per_group, question_tokens=question_tokens,
                   output_tokens=output_tokens)
    total = num_requests if num_requests is not None else num_groups * prompts_per_group
    system_prompts = [random_tokens(rng, system_prompt_tokens, vocab_size) for _ in range(num_groups)]
    if zipf_exponent > 0:
        groups = choose_indices(rng, total, zipf_weights(num_groups, zipf_exponent))
    else:
        group_arr = np.arange(total) % num_groups  # equal group sizes (within one)
        groups = [int(g) for g in (rng.permutation(group_arr) if shuffle else np.sort(group_arr))]
    questions = random_token_rows(rng, total, question_tokens, vocab_size)
    return [Draft(prompt_parts=(system_prompts[g], q), output_tokens=output_tokens, group=f"g{g}")
            for g, q in zip(groups, questions)]
