"""End-to-end on the real default model: greedy ids equal transformers' on the same dequantized fp32 weights,
and stay identical with the prefix cache on or off, batched or alone, chunk sizes 16/64/512, block sizes 16/32."""

from __future__ import annotations

import pytest
import torch

from kvbaton import LLM, SamplingParams

pytestmark = pytest.mark.smollm2

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def quicksort(arr):\n",
    "The three primary colours are",
    "Q: What is 12 times 12?\nA:",
]
SHARED = "You are a helpful assistant. Answer every question briefly and accurately, citing facts. " * 4
PREFIXED = [SHARED + "Question: what is the tallest mountain?", SHARED + "Question: what is the largest ocean?"]
NUM_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
PARIS = [7042, 30, 198, 198, 504, 2988, 314, 42, 216, 34, 32, 33, 40, 29, 32, 33, 29, 34, 34, 216]


def _hf_greedy(model, prompt_ids: list[int], num_tokens: int) -> list[int]:  # noqa: ANN001
    """Plain greedy decoding with transformers' own KV cache; unlike generate(min_new_tokens=...) it may
    pick the end-of-sequence token, exactly as our ignore_eos requests may."""
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    cache, generated = out.past_key_values, []
    for _ in range(num_tokens):
        token = int(out.logits[0, -1].argmax())
        generated.append(token)
        out = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
    return generated


@pytest.fixture(scope="module")
def reference(llm_fp32: LLM) -> list[list[int]]:
    from kvbaton.model.hf_reference import load_hf_reference

    model = load_hf_reference("smollm2-135m", "float32")
    tokenizer = llm_fp32.tokenizer
    refs = []
    with torch.inference_mode():
        for prompt in PROMPTS + PREFIXED:
            refs.append(_hf_greedy(model, tokenizer.encode(prompt), NUM_TOKENS))
    return refs


@pytest.fixture(scope="module")
def llm_fp32() -> LLM:
    return LLM("smollm2-135m", dtype="float32", num_blocks=512)


def test_paris(llm_fp32: LLM) -> None:
    result = llm_fp32.generate("The capital of France is", SamplingParams(max_tokens=20, temperature=0.0))[0]
    assert result.prompt_token_ids == [504, 3575, 282, 4649, 314]
    assert result.outputs[0].text.startswith(" Paris.")
    assert result.outputs[0].token_ids == PARIS


def test_default_dtype_still_says_paris() -> None:
    llm = LLM("smollm2-135m", num_blocks=64)
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0.0))[0].outputs[0]
    assert out.text.startswith(" Paris.")


def test_equals_transformers_alone(llm_fp32: LLM, reference: list[list[int]]) -> None:
    got = [llm_fp32.generate(p, GREEDY)[0].outputs[0].token_ids for p in PROMPTS + PREFIXED]
    assert got == reference
    llm_fp32.engine.check_invariants()


@pytest.mark.parametrize(("chunk", "block_size", "prefix_cache"),
                         [(16, 16, True), (64, 32, True), (512, 16, False), (512, 32, True), (64, 16, False)])
def test_equals_transformers_batched(reference: list[list[int]], chunk: int, block_size: int,
                                     prefix_cache: bool) -> None:
    llm = LLM("smollm2-135m", dtype="float32", num_blocks=512, block_size=block_size,
              max_num_batched_tokens=chunk, enable_prefix_cache=prefix_cache)
    if prefix_cache:  # warm the cache so the batched run hits the shared prefix
        llm.generate(SHARED + "warm-up", SamplingParams(max_tokens=1, temperature=0.0))
    results = llm.generate(PROMPTS + PREFIXED, GREEDY)
    assert [r.outputs[0].token_ids for r in results] == reference
    if prefix_cache:
        assert all(r.num_cached_tokens > 0 for r in results[len(PROMPTS):])
    llm.engine.check_invariants()
