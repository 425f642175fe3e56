"""Logit bias and penalties (engine/sampler.py): the math against transformers' processor and OpenAI's formula,
raw logprobs, range checks, and greedy generation with a repetition penalty equal to a transformers loop (the
same tokens through a prefill -> decode handoff: tests/engine/test_handoff.py)."""

from __future__ import annotations

import pytest
import torch

from kvbaton.core.errors import InvalidRequestError
from kvbaton.core.request import Request
from kvbaton.core.sampling import SamplingParams
from kvbaton.llm import LLM
from kvbaton.engine.sampler import Sampler, adjust_logits
from kvbaton.model.tiny import create_tiny_random_model

transformers = pytest.importorskip("transformers")


def _request(prompt: list[int], output: list[int], params: SamplingParams) -> Request:
    request = Request("r", prompt, params, 0.0)
    request.output_token_ids.extend(output)
    return request


def test_repetition_penalty_is_transformers_processor() -> None:
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))
    prompt, output = [1, 2, 3, 7], [7, 9, 40]
    ours = logits[0].clone()
    adjust_logits(ours, SamplingParams(repetition_penalty=1.3), prompt, output)
    theirs = transformers.RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits.clone())
    assert torch.allclose(ours, theirs[0])
    assert torch.equal(ours[10:40], logits[0, 10:40])  # tokens never seen are untouched


def test_frequency_and_presence_penalties_follow_openais_formula_over_the_output_only() -> None:
    logits = torch.zeros(16)
    adjust_logits(logits, SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [4, 4, 4], [5, 6, 5, 5])
    expected = torch.zeros(16)
    expected[5] = -(0.5 * 3 + 0.25)  # logit - count * frequency - presence
    expected[6] = -(0.5 * 1 + 0.25)
    assert torch.equal(logits, expected)  # prompt token 4 is not penalised


def test_logit_bias_steers_greedy_and_logprobs_stay_raw() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]])
    params = SamplingParams(temperature=0.0, logprobs=1, logit_bias=((2, 10.0), (1, -100.0)))
    (token,) = Sampler(0).sample(logits, ["r"], [params], [_request([0], [], params)])
    assert token.token_id == 2
    raw = torch.log_softmax(logits[0], dim=-1)
    assert token.logprob == pytest.approx(float(raw[2])) and token.top_logprobs[0][0] == 1
    assert torch.equal(logits, torch.tensor([[0.0, 5.0, 1.0, 2.0]]))  # the caller's logits are not changed


def test_min_p_keeps_only_tokens_near_the_most_likely() -> None:
    # softmax of [2, 1.9, 0, -1]: token 1 is 0.90x as likely as token 0, tokens 2 and 3 under 0.14x.
    logits = torch.tensor([[2.0, 1.9, 0.0, -1.0]])
    drawn = {Sampler(seed).sample(logits, ["r"], [SamplingParams(temperature=1.0, min_p=0.5)])[0].token_id
             for seed in range(200)}
    assert drawn == {0, 1}
    wide = {Sampler(seed).sample(logits, ["r"], [SamplingParams(temperature=1.0)])[0].token_id for seed in range(200)}
    assert wide == {0, 1, 2, 3}  # without min_p every token turns up in 200 draws


def test_penalties_need_the_rows_request() -> None:
    with pytest.raises(ValueError, match="need each row's request"):
        Sampler(0).sample(torch.zeros(1, 4), ["r"], [SamplingParams(presence_penalty=1.0)])


@pytest.mark.parametrize("kwargs", [{"presence_penalty": 2.5}, {"frequency_penalty": -2.01},
                                    {"repetition_penalty": 0.0}, {"logit_bias": ((-1, 1.0),)}, {"min_p": 1.5},
                                    {"logit_bias": ((3, 100.5),)}, {"logit_bias": tuple((i, 1.0) for i in range(301))}])
def test_out_of_range_values_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_greedy_with_repetition_penalty_equals_a_transformers_loop() -> None:
    from tests.model.test_llama import hf_model

    config, state = create_tiny_random_model(seed=0, dtype=torch.float32)
    reference = hf_model(config, state)
    processor = transformers.RepetitionPenaltyLogitsProcessor(1.5)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(12):
            logits = reference(torch.tensor([ids])).logits[:, -1].float()
            ids.append(int(processor(torch.tensor([ids]), logits).argmax()))
    llm = LLM("tiny-random", dtype="float32", block_size=4)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=1.5)
    penalised = llm.generate(prompt, params)[0].outputs[0].token_ids
    assert list(penalised) == ids[len(prompt):]
    plain = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].outputs[0]
    assert list(plain.token_ids) != list(penalised)  # the penalty did change the continuation


def test_min_tokens_holds_off_the_end_of_sequence_then_lets_it_end() -> None:
    # A +100 bias on tiny-random's end-of-sequence token makes greedy end at once; min_tokens keeps it out of the
    # first 5 tokens (the sampler masks it), and the 6th is the end-of-sequence token again.
    llm = LLM("tiny-random", dtype="float32", block_size=4)
    eos = llm.engine.tokenizer.eos_token_id
    biased = {"max_tokens": 20, "temperature": 0.0, "logit_bias": ((eos, 100.0),)}
    (at_once,) = llm.generate([5, 6, 7], SamplingParams(**biased))[0].outputs  # type: ignore[arg-type]
    assert list(at_once.token_ids) == [eos] and at_once.finish_reason == "stop"
    (held,) = llm.generate([5, 6, 7], SamplingParams(**biased, min_tokens=5))[0].outputs  # type: ignore[arg-type]
    assert len(held.token_ids) == 6 and eos not in held.token_ids[:5] and held.token_ids[5] == eos
    assert held.finish_reason == "stop"


def test_min_tokens_keeps_stop_strings_from_ending_the_first_tokens() -> None:
    llm = LLM("tiny-random", dtype="float32", block_size=4)
    greedy = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    text = llm.generate([5, 6, 7], SamplingParams(**greedy))[0].outputs[0].text  # type: ignore[arg-type]
    stop = text[1]  # a character of the first tokens' text
    (early,) = llm.generate([5, 6, 7], SamplingParams(**greedy, stop=(stop,)))[0].outputs  # type: ignore[arg-type]
    assert early.finish_reason == "stop" and stop not in early.text and len(early.token_ids) < 12
    (late,) = llm.generate([5, 6, 7], SamplingParams(**greedy, stop=(stop,), min_tokens=12))[0].outputs  # type: ignore[arg-type]
    assert late.text == text and late.finish_reason == "length"


def test_min_tokens_masks_stop_tokens_and_skips_ids_past_the_vocabulary() -> None:
    row = torch.zeros(8)
    params = SamplingParams(min_tokens=2, stop_token_ids=(3, 50))  # 50 is past this vocabulary: ignored, no error
    adjust_logits(row, params, [1], [4], eos_token_id=7)
    assert row[3] == float("-inf") and row[7] == float("-inf") and int(torch.isinf(row).sum()) == 2
    after = torch.zeros(8)
    adjust_logits(after, params, [1], [4, 5], eos_token_id=7)  # two outputs: min_tokens reached
    assert not torch.isinf(after).any()
