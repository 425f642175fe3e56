"""Greedy outputs of the whole engine do not depend on batching, chunking, block size or the prefix cache."""

from __future__ import annotations

import pytest

from kvbaton import LLM, SamplingParams

PROMPTS = [
    "The quick brown fox jumps over the lazy dog because it can.",
    "Hello",
    "In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole, filled with the ends of worms "
    "and an oozy smell, nor yet a dry, bare, sandy hole with nothing in it to sit down on or to eat.",
    "0123456789 " * 12,
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
]
SHARED = "System: you are a careful assistant who answers briefly and precisely. " * 3
PREFIXED = [SHARED + "Q: what is two plus two?", SHARED + "Q: name a colour.", SHARED + "Q: who are you?"]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def _run(prompts: list[str], one_at_a_time: bool = False, **engine_kwargs: object) -> list[list[int]]:
    llm = LLM("tiny-random", dtype="float32", **engine_kwargs)  # type: ignore[arg-type]
    if one_at_a_time:
        outs = [llm.generate(p, GREEDY)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, GREEDY)
    llm.engine.check_invariants()
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return _run(PROMPTS + PREFIXED, one_at_a_time=True, enable_prefix_cache=False, max_num_batched_tokens=2048)


def test_outputs_are_not_degenerate(reference: list[list[int]]) -> None:
    assert all(len(r) == 32 for r in reference)
    assert len({tuple(r) for r in reference}) == len(reference)


@pytest.mark.parametrize("chunk", [16, 64, 512])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("prefix_cache", [True, False])
def test_batched_chunked_equals_alone(reference: list[list[int]], chunk: int, block_size: int,
                                      prefix_cache: bool) -> None:
    got = _run(PROMPTS + PREFIXED, max_num_batched_tokens=chunk, block_size=block_size,
               enable_prefix_cache=prefix_cache)
    assert got == reference


def test_prefix_hit_equals_cold(reference: list[list[int]]) -> None:
    llm = LLM("tiny-random", dtype="float32")
    first = llm.generate(PREFIXED[0], GREEDY)[0]
    second = llm.generate(PREFIXED[1], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens > 0 and second.num_cached_tokens % 16 == 0
    assert second.outputs[0].token_ids == reference[len(PROMPTS) + 1]
    # the same prompt again hits everything but the last (partial) block
    again = llm.generate(PREFIXED[0], GREEDY)[0]
    n = len(again.prompt_token_ids)
    assert again.num_cached_tokens == ((n - 1) // 16) * 16
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    llm.engine.check_invariants()


def test_preemption_under_tiny_pool_keeps_outputs(reference: list[list[int]]) -> None:
    # 24 blocks of 16 tokens hold any one request but not all eight at once: some are preempted and recomputed
    got = _run(PROMPTS + PREFIXED, num_blocks=24, max_num_batched_tokens=64)
    assert got == reference
