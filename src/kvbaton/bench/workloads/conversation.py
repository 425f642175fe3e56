"""`conversation`: multi-turn chat sessions, each turn resending the whole history, with heavy-tailed think times.

The traffic Mooncake's store is for (FAST'25 §2: Kimi's conversations): every session opens with one of
a few shared system prompts; turn t's prompt is the system prompt, then every earlier user message and
answer, then the new user message, so turn t+1 repeats turn t's prompt and appends its answer and one
more message. Sessions start as a Poisson process (`session_rate` per second, or `rate` / mean turns
when a request rate is given); a session's next turn arrives a think time after the previous one, drawn
from a Lomax (Pareto II) law of shape `think_shape` (1.5: finite mean, infinite variance) with mean
`think_mean_s`, so most users answer within seconds and a few come back minutes later, when their
prefix has long left a GPU. Many sessions interleave: the requests come back sorted by arrival.

Turns per session are geometric with mean `mean_turns` (at most `max_turns`); user messages and
answers are log-normal (`user_*`, `answer_*`). The answer in turn t+1's prompt is `answer_tokens`
synthetic tokens, not the ids a simulated decode produced, so a cache reuses each turn's prompt, and
the answer is computed again with the new message (a live chat template would resend the real answer).
A session ends early when its next prompt plus answer would pass `max_context_tokens`.
"""

from __future__ import annotations

import random

import numpy as np

from kvbaton.bench.tokens import random_tokens
from kvbaton.bench.workloads.base import Draft, check_positive, lognormal_lengths, scaled, split_rng
from kvbaton.core.errors import InvalidRequestError


def generate_conversation(*, num_requests: int | None, vocab_size: int, rng: np.random.Generator,
                          arrival_rng: random.Random, rate: float | None, num_sessions: int = 400,
                          mean_turns: float = 8.0, max_turns: int = 40, num_system_prompts: int = 4,
                          system_prompt_tokens: int = 1500, user_mean_tokens: float = 150,
                          user_std_tokens: float = 200, answer_mean_tokens: float = 350,
                          answer_std_tokens: float = 300, think_mean_s: float = 60.0, think_shape: float = 1.5,
                          session_rate: float = 2.0, max_context_tokens: int = 32768,
                          length_scale: float = 1.0) -> list[Draft]:
    check_positive(num_sessions=num_sessions, mean_turns=mean_turns, max_turns=max_turns,
                   num_system_prompts=num_system_prompts, system_prompt_tokens=system_prompt_tokens,
                   think_mean_s=think_mean_s, session_rate=session_rate, max_context_tokens=max_context_tokens,
                   length_scale=length_scale)
    if mean_turns < 1 or not think_shape > 1:
        raise InvalidRequestError(f"mean_turns must be >= 1 and think_shape > 1 (a finite mean), got "
                                  f"{mean_turns}, {think_shape}")
    structure_rng, token_rng = split_rng(rng)
    starts_per_s = rate / mean_turns if rate is not None else session_rate
    systems = [random_tokens(token_rng, scaled(system_prompt_tokens, length_scale), vocab_size)
               for _ in range(num_system_prompts)]
    think_scale_s = think_mean_s * (think_shape - 1)  # Lomax mean = scale / (shape - 1)
    drafts: list[Draft] = []
    start_s = 0.0
    for session in range(num_sessions):
        start_s += arrival_rng.expovariate(starts_per_s)
        num_turns = min(max_turns, int(structure_rng.geometric(1.0 / mean_turns)))
        users = lognormal_lengths(structure_rng, num_turns, user_mean_tokens, user_std_tokens, low=4)
        answers = lognormal_lengths(structure_rng, num_turns, answer_mean_tokens, answer_std_tokens, low=1,
                                    high=4096)
        thinks_s = structure_rng.pareto(think_shape, size=num_turns) * think_scale_s
        history: tuple[np.ndarray, ...] = (systems[int(structure_rng.integers(num_system_prompts))],)
        at_s = start_s
        for turn in range(num_turns):
            if turn:
                history += (random_tokens(token_rng, scaled(answers[turn - 1], length_scale), vocab_size),)
                at_s += float(thinks_s[turn])
            history += (random_tokens(token_rng, scaled(users[turn], length_scale), vocab_size),)
            if sum(map(len, history)) + answers[turn] > max_context_tokens:
                break
            drafts.append(Draft(prompt_parts=history, output_tokens=answers[turn], group=f"s{session}",
                                arrival_s=at_s))
    drafts.sort(key=lambda d: d.arrival_s)  # stable: a session's turns keep their order
    return drafts[:num_requests] if num_requests is not None else drafts
