"""Handoff parity: every sampling option means the same through a prefill engine and a decode engine as on one.

Each case runs its prompts concurrently through the real handoff drivers (`Pair`: the prefill engine samples
the first token under `prefill_leg_params`, the decode engine adopts the KV and goes on from it) and each prompt
alone through a colocated engine, and compares the whole answer: tokens, text, finish reason, usage counts and
per-token logprobs; afterwards neither engine holds a block beyond its prefix cache and no leg is left. Cases that
hinge on the first tokens (a stop token equal to the first token, a stop string across the first two) derive their
parameters from each prompt's colocated greedy output.

A min_tokens >= 2 request once killed the prefill worker (the leg's one-token params were invalid): no test had
sent such a request through a handoff. This file sends every option, and the combinations that interact with the
first token, through one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest

from kvbaton.core.sampling import SamplingParams
from kvbaton.core.step import SampledToken, TokenDelta
from kvbaton.engine.structured import grammar_for
from kvbaton.model.registry import LoadedModel, load_model
from tests.engine.test_handoff import Clock, Pair, make_engine

# Three prompts with no shared block (block size 4) whose greedy outputs start with two printable characters.
TEXTS = ["Once upon a time in a land", "0123456789 0123456789", "Hi"]
EOS = 2  # tiny-random's end-of-sequence token


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    # float32: in bfloat16 a different batch (three prompts at once here, one colocated) moves logprobs by ~0.05.
    return load_model("tiny-random", "float32")


def prompts_of(loaded: LoadedModel) -> list[list[int]]:
    return [loaded.tokenizer.encode(text) for text in TEXTS]


@dataclass(frozen=True, slots=True)
class Answer:
    """Everything a client sees of one request: the concatenated deltas and the final output's fields."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: tuple[SampledToken, ...]
    error: str


def answer_of(outputs: list[TokenDelta]) -> Answer:
    *deltas, final = outputs
    assert final.finished and not any(out.finished for out in deltas), outputs
    assert final.finish_reason is not None
    return Answer(tuple(t for out in outputs for t in out.new_token_ids), "".join(out.new_text for out in outputs),
                  final.finish_reason, final.num_prompt_tokens, final.num_cached_tokens,
                  tuple(lp for out in outputs for lp in out.logprobs), final.error)


def colocated_answer(loaded: LoadedModel, prompts: list[list[int]], params: SamplingParams) -> Answer:
    """The last of `prompts` answered by one engine that ran them one after another (earlier ones warm its cache)."""
    engine = make_engine(loaded, Clock())
    outputs: list[TokenDelta] = []
    for i, prompt in enumerate(prompts):
        outputs = []
        engine.add_request(prompt, params, request_id=f"ref{i}")
        while engine.has_unfinished_requests():
            outputs += engine.step()
    engine.check_invariants()
    return answer_of(outputs)


def assert_same(got: Answer, expected: Answer, label: str) -> None:
    assert got.token_ids == expected.token_ids, label
    assert (got.text, got.finish_reason, got.error) == (expected.text, expected.finish_reason, expected.error), label
    assert (got.num_prompt_tokens, got.num_cached_tokens) == (expected.num_prompt_tokens,
                                                              expected.num_cached_tokens), label
    # The two run different batches, so the logits may differ in the last bits.
    assert [t.token_id for t in got.logprobs] == [t.token_id for t in expected.logprobs], label
    assert [t.logprob for t in got.logprobs] == pytest.approx([t.logprob for t in expected.logprobs], abs=1e-4), label
    for g, e in zip(got.logprobs, expected.logprobs, strict=True):
        assert [i for i, _ in g.top_logprobs] == [i for i, _ in e.top_logprobs], label
        assert [lp for _, lp in g.top_logprobs] == pytest.approx([lp for _, lp in e.top_logprobs], abs=1e-4), label


@dataclass(frozen=True, slots=True)
class Greedy:
    """A prompt's colocated greedy output: its first tokens and their text, token by token."""

    token_ids: tuple[int, ...]
    texts: tuple[str, ...]  # texts[i]: the text of token_ids[: i + 1]


def greedy_of(loaded: LoadedModel, prompt: list[int]) -> Greedy:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    tokens = colocated_answer(loaded, [prompt], params).token_ids
    return Greedy(tokens, tuple(loaded.tokenizer.decode(list(tokens[: i + 1])) for i in range(len(tokens))))


def spanning_stop(g: Greedy) -> str:
    """A stop string made of the first token's last character and the second token's first."""
    first, both = g.texts[0], g.texts[1]
    assert first and len(both) > len(first) and both.startswith(first), g
    return both[len(first) - 1:len(first) + 1]


Case = Callable[[Greedy], SamplingParams]


def greedy(**kwargs: object) -> Case:
    fields: dict[str, object] = {"max_tokens": 8, "temperature": 0.0}
    fields.update(kwargs)
    return lambda g: SamplingParams(**fields)  # type: ignore[arg-type]


def derived(build: Callable[[Greedy], dict[str, object]], **kwargs: object) -> Case:
    return lambda g: greedy(**{**kwargs, **build(g)})(g)


CASES: dict[str, Case] = {
    "plain": greedy(),
    "ignore_eos": greedy(ignore_eos=True),
    "max_tokens_1": greedy(max_tokens=1),
    "max_tokens_2": greedy(max_tokens=2),
    "min_tokens_1": greedy(min_tokens=1),
    "min_tokens_2": greedy(min_tokens=2),
    "min_tokens_eq_max": greedy(min_tokens=8),
    "min_tokens_eq_max_1": greedy(max_tokens=1, min_tokens=1),
    "min_tokens_eq_max_2": greedy(max_tokens=2, min_tokens=2),
    # EOS made the likeliest token: it ends the output at once, after min_tokens, or never (ignore_eos).
    "eos_first": greedy(logit_bias=((EOS, 100.0),)),
    "eos_after_min_tokens_1": greedy(logit_bias=((EOS, 100.0),), min_tokens=1),
    "eos_after_min_tokens_3": greedy(logit_bias=((EOS, 100.0),), min_tokens=3),
    "eos_ignored": greedy(logit_bias=((EOS, 100.0),), ignore_eos=True),
    "eos_ignored_min_tokens": greedy(logit_bias=((EOS, 100.0),), ignore_eos=True, min_tokens=2),
    "eos_first_max_tokens_1": greedy(logit_bias=((EOS, 100.0),), max_tokens=1),
    "eos_skip_special_false": greedy(logit_bias=((EOS, 100.0),), ignore_eos=True, skip_special_tokens=False,
                                     max_tokens=3),
    # Stop tokens: the first token (ends the output after it, or banned by min_tokens), the second.
    "stop_token_first": derived(lambda g: {"stop_token_ids": (g.token_ids[0],)}),
    "stop_token_first_min_tokens_1": derived(lambda g: {"stop_token_ids": (g.token_ids[0],)}, min_tokens=1),
    "stop_token_first_min_tokens_2": derived(lambda g: {"stop_token_ids": (g.token_ids[0],)}, min_tokens=2),
    "stop_token_first_max_tokens_1": derived(lambda g: {"stop_token_ids": (g.token_ids[0],)}, max_tokens=1),
    "stop_token_second": derived(lambda g: {"stop_token_ids": (g.token_ids[1],)}),
    "stop_token_first_two_min_tokens_2": derived(lambda g: {"stop_token_ids": g.token_ids[:2]}, min_tokens=2),
    "stop_token_out_of_vocab_min_tokens": greedy(stop_token_ids=(10**6,), min_tokens=3),
    # Stop strings: across the first two tokens, the whole first token, held off by min_tokens.
    "stop_spanning": derived(lambda g: {"stop": (spanning_stop(g),)}),
    "stop_spanning_included": derived(lambda g: {"stop": (spanning_stop(g),)}, include_stop_str_in_output=True),
    "stop_spanning_max_tokens_2": derived(lambda g: {"stop": (spanning_stop(g),)}, max_tokens=2),
    "stop_spanning_min_tokens_2": derived(lambda g: {"stop": (spanning_stop(g),)}, min_tokens=2),
    "stop_first_token": derived(lambda g: {"stop": (g.texts[0],)}),
    "stop_first_token_included": derived(lambda g: {"stop": (g.texts[0],)}, include_stop_str_in_output=True),
    "stop_first_token_max_tokens_1": derived(lambda g: {"stop": (g.texts[0],)}, max_tokens=1),
    "stop_first_token_min_tokens_1": derived(lambda g: {"stop": (g.texts[0],)}, min_tokens=1),
    "stop_never": greedy(stop=("\x00never\x00",)),
    "stop_string_and_token": derived(lambda g: {"stop": (spanning_stop(g),), "stop_token_ids": (g.token_ids[1],)}),
    "skip_special_false": greedy(skip_special_tokens=False),
    # Logprobs: the first token's come from the prefill engine.
    "logprobs_0": greedy(logprobs=0),
    "logprobs_5": greedy(logprobs=5),
    "logprobs_20_max_tokens_1": greedy(logprobs=20, max_tokens=1),
    "logprobs_stop_first_token": derived(lambda g: {"stop_token_ids": (g.token_ids[0],)}, logprobs=3),
    # Logit adjustments see the first token as part of the output on the decode engine.
    "presence_penalty": greedy(presence_penalty=2.0, max_tokens=12),
    "frequency_penalty": greedy(frequency_penalty=2.0, max_tokens=12),
    "negative_penalties": greedy(presence_penalty=-2.0, frequency_penalty=-1.0, max_tokens=12),
    "repetition_penalty": greedy(repetition_penalty=2.0, max_tokens=12),
    "repetition_penalty_below_1": greedy(repetition_penalty=0.5, max_tokens=12),
    "logit_bias": derived(lambda g: {"logit_bias": ((g.token_ids[0], -100.0), (g.token_ids[1], -100.0),
                                                    (77, 5.0))}),
    "penalties_logprobs_min_tokens": greedy(repetition_penalty=1.5, frequency_penalty=0.5, logprobs=2,
                                            min_tokens=4, max_tokens=10),
    # Greedy whatever the truncation: temperature 0, or top_k 1 at any temperature.
    "min_p_top_k_top_p": greedy(min_p=0.5, top_k=3, top_p=0.5),
    "top_k_1_hot": greedy(temperature=1.5, top_k=1),
    "seed_greedy": greedy(seed=1234),
    "grammar_regex": greedy(grammar=grammar_for("regex", "(ab|ba){2,}c"), max_tokens=24),
    "grammar_regex_min_tokens": greedy(grammar=grammar_for("regex", "[a-z]{1,6}"), min_tokens=2, max_tokens=24),
    "grammar_json": greedy(grammar=grammar_for("json_schema", {
        "type": "object", "additionalProperties": False, "required": ["a"],
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}}}), max_tokens=24),
    "grammar_choice_logprobs": greedy(grammar=grammar_for("choice", ["yes", "no", "maybe"]), logprobs=2),
    "priority": greedy(priority=-7),
    "n_sample": greedy(n=3, seed=5),  # the router expands n; a sample's params keep n's value here
    # What `kvbaton bench` sends: min_tokens = max_tokens, EOS not ignored.
    "bench": greedy(max_tokens=10, min_tokens=10, logprobs=1),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_handoff_answers_exactly_as_one_engine(tiny: LoadedModel, name: str) -> None:
    prompts = prompts_of(tiny)
    pair = Pair(tiny)
    params = {}
    for i, prompt in enumerate(prompts):
        params[i] = CASES[name](greedy_of(tiny, prompt))
        pair.submit(f"r{i}", prompt, params[i])
    pair.run()
    for i, prompt in enumerate(prompts):
        assert_same(answer_of(pair.outputs[f"r{i}"]), colocated_answer(tiny, [prompt], params[i]), f"{name} r{i}")
    assert not pair.p.take_reports() and pair.d.counters.num_recomputed == 0
    assert pair.p.counters.num_completed == pair.d.counters.num_completed == len(prompts)
    pair.p.check_invariants()
    pair.d.check_invariants()
    pair.assert_nothing_held()


def test_a_prefix_hit_on_the_prefill_engine_reports_the_same_usage(tiny: LoadedModel) -> None:
    # The prefill engine's cache hit travels with the first token (usage.cached_tokens); a colocated engine that
    # ran the same requests before reports the same hit.
    shared = list(range(10, 30))
    prompts = [shared + [1, 2, 3], shared + [4, 5], shared + [4, 5]]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=1)
    pair = Pair(tiny)
    for i, prompt in enumerate(prompts):
        pair.submit(f"r{i}", prompt, params)
        pair.run()
        expected = colocated_answer(tiny, prompts[: i + 1], params)
        assert_same(answer_of(pair.outputs[f"r{i}"]), expected, f"r{i}")
    assert [answer_of(pair.outputs[f"r{i}"]).num_cached_tokens for i in range(3)] == [0, 20, 20]
    pair.assert_nothing_held()


@pytest.mark.parametrize("extra", [{}, {"top_k": 5}, {"top_p": 0.8, "min_p": 0.05}, {"repetition_penalty": 1.3}])
def test_a_seeded_sample_is_the_same_through_a_handoff(tiny: LoadedModel, extra: dict[str, object]) -> None:
    # A seed makes a sampled request reproducible: the same tokens whether the router hands it off or not (short
    # prompts skip the handoff, so the same request may take either path).
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=42, ignore_eos=True, **extra)  # type: ignore[arg-type]
    prompts = prompts_of(tiny)
    pair = Pair(tiny)
    for i, prompt in enumerate(prompts):
        pair.submit(f"r{i}", prompt, replace(params, seed=42 + i))
    pair.run()
    for i, prompt in enumerate(prompts):
        expected = colocated_answer(tiny, [prompt], replace(params, seed=42 + i))
        assert answer_of(pair.outputs[f"r{i}"]).token_ids == expected.token_ids, i
    pair.assert_nothing_held()
