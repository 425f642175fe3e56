"""Simulated output tokens that copy spans of their prompt, so prompt-lookup speculation finds what it finds live.

The simulator's default tokens (`kvbaton.sim.worker.default_token`) never repeat a prompt's n-grams, so a
speculating scheduler (`SchedulerConfig.num_speculative_tokens`) proposes nothing and the simulator cannot
say what speculation buys. Answers that quote their context (RAG, code edits, agents re-reading tool
output) are where it pays. `CopyingOutputs` makes each request's output a seeded mix of spans copied from
its prompt and fresh tokens found nowhere in it:

- a copy span starts at a uniformly drawn prompt position and runs on, ending after each token with
  probability 1 / `mean_span` (or at the prompt's end);
- between spans, fresh tokens run for about `mean_span` x (1 - f) / f tokens, so that a fraction
  f = `copy_fraction` of output tokens is copied in the long run (f = 1: spans follow each other).

The same (seed, request id) gives the same tokens wherever they are asked for (a prefill worker's first
token, the decode worker's next ones), so the scheduler's real `NgramProposer` proposes drafts from the
request's real tokens and the simulated worker accepts the drafts that equal the request's next tokens:
exactly what a greedy model does with drafts live.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

FIRST_FRESH_TOKEN = 1 << 30  # above any vocabulary: a fresh token never matches a prompt's n-gram
_NUM_FRESH_TOKENS = 1 << 30


class CopyingOutputs:
    """`token_for(request_id, output_index)` for the simulator (see the module docstring)."""

    def __init__(self, copy_fraction: float, mean_span: float = 16.0, seed: int = 0) -> None:
        if not 0.0 <= copy_fraction <= 1.0 or mean_span < 1.0:
            raise ValueError(f"need 0 <= copy_fraction <= 1 and mean_span >= 1, got {copy_fraction}, {mean_span}")
        self.copy_fraction = copy_fraction
        self.mean_span = mean_span
        self.seed = seed
        self._end_span = 1.0 / mean_span
        # Before each fresh token a span starts instead with this probability p, so fresh runs (perhaps empty) have
        # (1 - p) / p = mean_span x (1 - f) / f tokens on average.
        self._start_span = copy_fraction / (copy_fraction + mean_span * (1.0 - copy_fraction))
        # request id -> (its output tokens so far, its generator, the prompt position its copy span reads next or -1)
        self._outputs: dict[str, tuple[list[int], random.Random, list[int]]] = {}
        self.prompt_of: Callable[[str], Sequence[int]] | None = None  # set by the simulator that asks

    def __call__(self, request_id: str, output_index: int) -> int:
        entry = self._outputs.get(request_id)
        if entry is None:
            entry = self._outputs[request_id] = ([], random.Random(f"{self.seed}:{request_id}"), [-1])
        tokens = entry[0]
        if output_index >= len(tokens):
            self._extend(request_id, entry, output_index + 1)
        return tokens[output_index]

    def forget(self, request_id: str) -> None:
        """The request ended: its tokens are not asked for again."""
        self._outputs.pop(request_id, None)

    def _extend(self, request_id: str, entry: tuple[list[int], random.Random, list[int]], length: int) -> None:
        assert self.prompt_of is not None, "CopyingOutputs needs prompt_of before the first token"
        prompt = self.prompt_of(request_id)
        tokens, rng, position = entry
        copy_at = position[0]
        while len(tokens) < length:
            if copy_at < 0 and prompt and rng.random() < self._start_span:
                copy_at = rng.randrange(len(prompt))
            if copy_at >= 0:
                tokens.append(prompt[copy_at])
                copy_at += 1
                if copy_at >= len(prompt) or rng.random() < self._end_span:
                    copy_at = -1
            else:
                tokens.append(FIRST_FRESH_TOKEN + rng.randrange(_NUM_FRESH_TOKENS))
        position[0] = copy_at
