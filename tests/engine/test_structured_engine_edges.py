"""Regressions in structured outputs (engine/structured.py and the engine's use of it), on tiny-random."""

from __future__ import annotations

import pytest

from kvbaton import LLM, SamplingParams
from kvbaton.core.request import FinishReason
from kvbaton.engine.structured import grammar_for


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-random", dtype="float32", num_blocks=256)


@pytest.mark.parametrize("kind, spec, text", [
    ("regex", "abc", "abc"),
    ("json_schema", {"type": "object", "properties": {"a": {"const": 1}}, "required": ["a"],
                     "additionalProperties": False}, '{"a":1}'),
])
def test_a_grammar_completed_by_the_last_allowed_token_ends_with_stop(llm: LLM, kind: str, spec: object,
                                                                       text: str) -> None:
    # The grammar's end is the request's end-of-sequence: completed by the max_tokens-th token, the output is whole
    # and ends with "stop" (as an EOS there would), not "length" — or a forced tool call made exactly within
    # max_tokens would come back as content, and a client's parse() would refuse a complete JSON answer.
    num_tokens = len(llm.engine.tokenizer.encode(text))
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, grammar=grammar_for(kind, spec))
    out = llm.generate("Answer:", params)[0].outputs[0]
    assert out.text == text and len(out.token_ids) == num_tokens
    assert out.finish_reason == FinishReason.STOP
    llm.engine.check_invariants()
