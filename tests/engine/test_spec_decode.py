"""Speculative decoding in the engine (prompt lookup, engine/sampler.py's verify): greedy outputs are exactly those
without drafts — text, tokens, stop strings, finish reasons and logprobs — while drafts are accepted; sampled
verification leaves each token distributed as the model's distribution; block accounting holds throughout."""

from __future__ import annotations

import pytest
import torch

from kvbaton import LLM, SamplingParams
from kvbaton.core.request import FinishReason
from kvbaton.engine.sampler import Sampler

# Repetitive prompts: tiny-random's greedy continuation of a repeated pattern repeats, so drafts get accepted.
PROMPTS = [[5, 6, 7, 8] * 6, list(range(20, 40)) * 2, [9, 3] * 10 + [4]]


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM("tiny-random", dtype="float32", block_size=4)


@pytest.fixture(scope="module")
def speculative() -> LLM:
    return LLM("tiny-random", dtype="float32", block_size=4, num_speculative_tokens=4)


def test_greedy_outputs_are_exactly_those_without_drafts(plain: LLM, speculative: LLM) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)
    expected = plain.generate(PROMPTS, params)
    got = speculative.generate(PROMPTS, params)
    scheduler = speculative.engine.scheduler
    assert scheduler.num_accepted_tokens > 0, "no draft was accepted: the test proves nothing"
    for want, have in zip(expected, got):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
        assert have.outputs[0].text == want.outputs[0].text
        assert have.outputs[0].finish_reason is want.outputs[0].finish_reason == FinishReason.LENGTH
        for a, b in zip(want.outputs[0].logprobs, have.outputs[0].logprobs):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
    speculative.engine.check_invariants()


def test_stop_strings_and_max_tokens_end_where_they_would_without_drafts(plain: LLM, speculative: LLM) -> None:
    text = plain.generate(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    stop = text.outputs[0].text[9:11]
    for params in (SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=(stop,)),
                   SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)):
        want = plain.generate(PROMPTS[0], params)[0].outputs[0]
        have = speculative.generate(PROMPTS[0], params)[0].outputs[0]
        assert (have.text, have.token_ids, have.finish_reason) == (want.text, want.token_ids, want.finish_reason)
    speculative.engine.check_invariants()


def test_preempted_speculating_requests_still_match() -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    small = LLM("tiny-random", dtype="float32", block_size=4, num_blocks=40, num_speculative_tokens=4)
    got = small.generate(PROMPTS, params)
    assert small.engine.stats().num_preemptions > 0
    want = LLM("tiny-random", dtype="float32", block_size=4).generate(PROMPTS, params)
    assert [r.outputs[0].token_ids for r in got] == [r.outputs[0].token_ids for r in want]
    small.engine.check_invariants()


def test_sampled_verification_keeps_the_models_distribution() -> None:
    # Two positions over a 4-token vocabulary and one draft: the first token must be distributed as p0 whatever
    # the draft, and after an accepted draft the second as p1 (speculative sampling's guarantee).
    rows = torch.log(torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.25, 0.25, 0.4, 0.1]]))
    params = SamplingParams(temperature=1.0, seed=11)
    sampler = Sampler(0)
    first = torch.zeros(4)
    second = torch.zeros(4)
    trials = 20000
    for _ in range(trials):
        tokens = sampler.verify(rows, (1,), params, "r")
        first[tokens[0].token_id] += 1
        if len(tokens) == 2:
            second[tokens[1].token_id] += 1
    assert torch.allclose(first / trials, torch.tensor([0.1, 0.5, 0.3, 0.1]), atol=0.015)
    assert first[1] == second.sum()  # the draft was accepted exactly when the model drew it
    assert torch.allclose(second / second.sum(), torch.tensor([0.25, 0.25, 0.4, 0.1]), atol=0.02)


def test_sampled_requests_speculate_and_stay_reproducible_with_a_seed(speculative: LLM) -> None:
    params = SamplingParams(max_tokens=30, temperature=0.7, seed=5, ignore_eos=True)
    a = speculative.generate(PROMPTS[0], params)[0].outputs[0].token_ids
    b = speculative.generate(PROMPTS[0], params)[0].outputs[0].token_ids
    assert a == b and len(a) == 30
    speculative.engine.check_invariants()
