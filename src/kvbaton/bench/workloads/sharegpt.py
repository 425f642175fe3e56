"""`sharegpt-like`: chat requests with ShareGPT-shaped lengths and no deliberate sharing.

Without a file, lengths are log-normal stand-ins for ShareGPT_V3 after the usual filtering
(vLLM / SGLang bench_serving keep the first human turn as the prompt and the first reply's
length as the output): prompt 250 ± 300 tokens (4..4,096), output 200 ± 200 (1..2,048). These
are rough figures for a control workload, not measurements; pass `sharegpt_path` (or --trace)
to use a real ShareGPT-format JSON file: a list of {"conversations": [{"from": "human"|"gpt",
"value": text}, ...]}; the first human turn is the prompt, the following gpt turn sets the
output length. Text becomes token ids through `word_tokens` (one id per word, a stable hash)
unless a `tokenize` callable is given.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from kvbaton.bench.tokens import TokenIds, as_token_array, random_tokens, word_tokens
from kvbaton.bench.workloads.base import Draft, check_positive, lognormal_lengths
from kvbaton.core.errors import InvalidRequestError


def read_sharegpt(path: str | Path) -> list[tuple[str, str]]:
    """(prompt, reply) pairs from the first exchange of each conversation that has one."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequestError(f"cannot read ShareGPT file {path}: {exc}") from None
    if not isinstance(data, list):
        raise InvalidRequestError(f"{path}: expected a JSON list of conversations")
    pairs = []
    for number, item in enumerate(data):
        turns = item.get("conversations", []) if isinstance(item, dict) else []
        if not isinstance(turns, list) or not all(isinstance(turn, dict) for turn in turns[:2]):
            raise InvalidRequestError(f"{path}: conversation {number} is not a list of "
                                      '{"from": ..., "value": ...} turns')
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            pairs.append((str(turns[0].get("value", "")), str(turns[1].get("value", ""))))
    return pairs


def generate_sharegpt_like(*, num_requests: int | None, vocab_size: int, rng: np.random.Generator,
                           arrival_rng: random.Random, rate: float | None, sharegpt_path: str | Path | None = None,
                           trace: str | Path | None = None, prompt_mean_tokens: float = 250,
                           prompt_std_tokens: float = 300, output_mean_tokens: float = 200,
                           output_std_tokens: float = 200, max_output_tokens: int = 2048,
                           tokenize: Callable[[str], Sequence[int]] | None = None) -> list[Draft]:
    check_positive(max_output_tokens=max_output_tokens)
    path = sharegpt_path or trace
    if path is None:
        total = num_requests or 1000
        prompt_lengths = lognormal_lengths(rng, total, prompt_mean_tokens, prompt_std_tokens, low=4, high=4096)
        output_lengths = lognormal_lengths(rng, total, output_mean_tokens, output_std_tokens, low=1,
                                           high=max_output_tokens)
        return [Draft(prompt_parts=(random_tokens(rng, p, vocab_size),), output_tokens=o, group=f"c{i}")
                for i, (p, o) in enumerate(zip(prompt_lengths, output_lengths))]

    def encode(text: str) -> TokenIds:
        return as_token_array(list(tokenize(text))) if tokenize else word_tokens(text, vocab_size)

    pairs = read_sharegpt(path)
    order = rng.permutation(len(pairs))  # a seeded sample, as bench_serving does
    drafts: list[Draft] = []
    for i in order:
        prompt, reply = pairs[int(i)]
        prompt_ids = encode(prompt)
        if len(prompt_ids) < 4:
            continue  # bench_serving drops near-empty prompts too
        output_tokens = min(max(1, len(encode(reply))), max_output_tokens)
        drafts.append(Draft(prompt_parts=(prompt_ids,), output_tokens=output_tokens, group=f"c{int(i)}"))
        if num_requests is not None and len(drafts) == num_requests:
            break
    if not drafts:
        raise InvalidRequestError(f"{path}: no usable human/gpt exchanges")
    return drafts


def generate_shifting_mix(*, num_requests: int | None, vocab_size: int, rng: np.random.Generator,
                          arrival_rng: random.Random, rate: float | None, shift_fraction: float = 0.5,
                          first_prompt_mean_tokens: float = 1500, first_output_mean_tokens: float = 20,
                          second_prompt_mean_tokens: float = 150, second_output_mean_tokens: float = 400,
                          max_output_tokens: int = 2048) -> list[Draft]:
    """A prompt/output mix that shifts once: long prompts with short outputs, then (from `shift_fraction` of
    the requests on) short prompts with long outputs; a pool split sized for one phase is wrong for the other.
    Lengths are lognormal with a std of a third of the mean; the group ("phase1"/"phase2") names the phase."""
    if not 0.0 < shift_fraction < 1.0:
        raise InvalidRequestError(f"shift_fraction must be in (0, 1), got {shift_fraction}")
    check_positive(max_output_tokens=max_output_tokens)
    total = num_requests or 1000
    first = max(1, min(total - 1, round(total * shift_fraction)))
    drafts: list[Draft] = []
    for phase, count, prompt_mean, output_mean in (
            ("phase1", first, first_prompt_mean_tokens, first_output_mean_tokens),
            ("phase2", total - first, second_prompt_mean_tokens, second_output_mean_tokens)):
        prompts = lognormal_lengths(rng, count, prompt_mean, prompt_mean / 3, low=4, high=8192)
        outputs = lognormal_lengths(rng, count, output_mean, output_mean / 3, low=1, high=max_output_tokens)
        drafts += [Draft(prompt_parts=(random_tokens(rng, p, vocab_size),), output_tokens=o, group=phase)
                   for p, o in zip(prompts, outputs)]
    return drafts
