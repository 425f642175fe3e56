"""Prompt logprobs (SamplingParams.prompt_logprobs; echo + logprobs on the completions endpoint): each prompt
token's logprob given the tokens before it equals transformers' over the same weights, across chunked prefill,
with the top-k; such a request reads nothing from the prefix cache, and a preempted one reports each position once.
"""

from __future__ import annotations

import pytest
import torch

from kvbaton import LLM, SamplingParams
from kvbaton.core.errors import InvalidRequestError
from kvbaton.model.tiny import create_tiny_random_model

transformers = pytest.importorskip("transformers")


def reference_logprobs(prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i is the distribution of prompt[i + 1] given prompt[: i + 1]."""
    from tests.model.test_llama import hf_model

    config, state = create_tiny_random_model(seed=0, dtype=torch.float32)
    with torch.inference_mode():
        logits = hf_model(config, state)(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("chunk", [512, 16])  # one prefill step, or the prompt in chunks of 16 tokens
def test_prompt_logprobs_equal_transformers(chunk: int) -> None:
    prompt = [(7 * i) % 300 + 3 for i in range(70)]
    llm = LLM("tiny-random", dtype="float32", block_size=4, max_num_batched_tokens=chunk)
    result = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3))[0]
    expected = reference_logprobs(prompt)
    entries = result.prompt_logprobs
    assert entries is not None and entries[0] is None and len(entries) == len(prompt)
    for position, entry in enumerate(entries[1:], start=1):
        assert entry.token_id == prompt[position]
        assert entry.logprob == pytest.approx(float(expected[position - 1, prompt[position]]), abs=1e-4)
        values, ids = torch.topk(expected[position - 1], 3)
        assert [t for t, _ in entry.top_logprobs] == ids.tolist()
        assert [lp for _, lp in entry.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)
        own = expected[position - 1, prompt[position]]
        assert entry.rank == 1 + int((expected[position - 1] > own + 1e-4).sum())  # vLLM's rank: 1 + those above
    assert {entry.rank for entry in entries[1:]} != {1}  # not every prompt token is the model's favourite
    llm.engine.check_invariants()


def test_a_prompt_logprobs_request_computes_its_whole_prompt() -> None:
    llm = LLM("tiny-random", dtype="float32", block_size=4)
    prompt = list(range(10, 50))
    llm.generate(prompt, SamplingParams(max_tokens=1))  # the prompt is now cached
    hit = llm.generate(prompt, SamplingParams(max_tokens=1))[0]
    assert hit.num_cached_tokens > 0 and hit.prompt_logprobs is None
    full = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert full.num_cached_tokens == 0 and len(full.prompt_logprobs) == len(prompt)
    assert all(entry.top_logprobs == () for entry in full.prompt_logprobs[1:])


def test_preempted_requests_report_each_prompt_position_once() -> None:
    small = LLM("tiny-random", dtype="float32", num_blocks=24, block_size=4)
    prompts = [[5 + i] * 20 for i in range(4)]
    results = small.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                     prompt_logprobs=1))
    assert small.engine.stats().num_preemptions > 0
    for prompt, result in zip(prompts, results):
        assert [entry.token_id for entry in result.prompt_logprobs[1:]] == prompt[1:]
    small.engine.check_invariants()


@pytest.mark.parametrize("value", [-1, 21, True, 1.5])
def test_bad_prompt_logprobs(value: object) -> None:
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)  # type: ignore[arg-type]
