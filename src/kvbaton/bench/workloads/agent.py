"""`agent`: multi-turn episodes whose context grows by one observation/action step each turn.

Shape from Preble (ICLR 2025, arXiv 2407.00023) Table 1, embodied agent on ALFWorld, as we read
the paper: prompt 2,285 ± 471 tokens, output 16 ± 13, sharing 97 %. An episode's prompt is the
few-shot examples of its task type (ALFWorld has 6 task types; one example set of 1,450 ± 150
tokens per type), the 40-token task description, then every earlier step (70 ± 30 tokens each):
turn t repeats turn t-1's whole prompt and appends one step, so a prefix cache can reuse all but
the new step. Episodes run 5..35 turns (uniform), which puts the mean prompt near 2,300 tokens;
16 episodes are open at once and their turns interleave in time, turn order kept.
"""

from __future__ import annotations

import random

import numpy as np

from kvbaton.bench.tokens import random_tokens
from kvbaton.bench.workloads.base import (
    Draft, check_positive, interleave_sessions, lognormal_lengths, scaled, split_rng,
)
from kvbaton.core.errors import InvalidRequestError


def generate_agent(*, num_requests: int | None, vocab_size: int, rng: np.random.Generator,
                   arrival_rng: random.Random, rate: float | None, num_task_types: int = 6,
                   fewshot_mean_tokens: float = 1450, fewshot_std_tokens: float = 150, task_tokens: int = 40,
                   step_mean_tokens: float = 70, step_std_tokens: float = 30, min_turns: int = 5,
                   max_turns: int = 35, output_mean_tokens: float = 16, output_std_tokens: float = 13,
                   num_active_episodes: int = 16, length_scale: float = 1.0) -> list[Draft]:
    total = num_requests or 1000
    check_positive(num_task_types=num_task_types, min_turns=min_turns, length_scale=length_scale)
    rng, token_rng = split_rng(rng)
    if max_turns < min_turns:
        raise InvalidRequestError(f"max_turns ({max_turns}) < min_turns ({min_turns})")
    fewshots = [random_tokens(token_rng, scaled(n, length_scale), vocab_size)
                for n in lognormal_lengths(rng, num_task_types, fewshot_mean_tokens, fewshot_std_tokens, low=64)]
    episodes: list[list[Draft]] = []
    num_drafted = 0
    while num_drafted < total:
        episode_id = len(episodes)
        task_type = int(rng.integers(num_task_types))
        num_turns = int(rng.integers(min_turns, max_turns + 1))
        context = (fewshots[task_type], random_tokens(token_rng, scaled(task_tokens, length_scale), vocab_size))
        step_lengths = lognormal_lengths(rng, num_turns, step_mean_tokens, step_std_tokens, low=4)
        output_lengths = lognormal_lengths(rng, num_turns, output_mean_tokens, output_std_tokens, low=1, high=256)
        turns = []
        for turn in range(num_turns):
            if turn > 0:
                context = context + (random_tokens(token_rng, scaled(step_lengths[turn], length_scale), vocab_size),)
            turns.append(Draft(prompt_parts=context, output_tokens=output_lengths[turn], group=f"ep{episode_id}"))
        episodes.append(turns)
        num_drafted += num_turns
    return interleave_sessions(rng, episodes, num_active_episodes, total)
