"""A migrated request resumes after the tokens it already produced (`Engine.add_request(output_token_ids=...)`): the
rest of its tokens, text and finish reason equal what one uninterrupted engine gives, whatever the sampling
options that read the output so far (stop strings, min_tokens, penalties, a grammar, a seed)."""

from __future__ import annotations

import pytest

from kvbaton.core.errors import InvalidRequestError
from kvbaton.core.sampling import SamplingParams
from kvbaton.core.step import TokenDelta
from kvbaton.engine.structured import grammar_for
from kvbaton.model.registry import LoadedModel, load_model
from tests.engine.test_handoff import Clock, make_engine

PROMPT = [(5 * i + 11) % 60 + 3 for i in range(23)]

CASES: dict[str, SamplingParams] = {
    "greedy_penalties": SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, repetition_penalty=1.5,
                                       frequency_penalty=0.5),
    "seeded": SamplingParams(max_tokens=20, temperature=1.0, top_k=20, seed=99, ignore_eos=True,
                             presence_penalty=0.3),
    "seeded_min_tokens_stop": SamplingParams(max_tokens=30, temperature=0.8, seed=7, min_tokens=12, stop=("e",)),
    "grammar_json": SamplingParams(max_tokens=30, temperature=0.0, grammar=grammar_for("json_schema", {
        "type": "object", "additionalProperties": False, "required": ["a"],
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}}})),
    "grammar_regex_seeded": SamplingParams(max_tokens=24, temperature=1.0, seed=3,
                                           grammar=grammar_for("regex", "(ab|ba){3,}c")),
}


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random", "float32")


def run(tiny: LoadedModel, params: SamplingParams, output_token_ids: tuple[int, ...] = ()) -> list[TokenDelta]:
    engine = make_engine(tiny, Clock())
    engine.add_request(PROMPT, params, request_id="r", output_token_ids=output_token_ids)
    outputs: list[TokenDelta] = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    engine.check_invariants()
    return outputs


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_resumed_request_goes_on_exactly_as_the_uninterrupted_one(tiny: LoadedModel, name: str) -> None:
    params = CASES[name]
    whole = run(tiny, params)
    assert all(len(out.new_token_ids) == 1 for out in whole)
    assert len(whole) >= 6, [out.new_text for out in whole]
    for num_done in (1, len(whole) // 2, len(whole) - 1):
        rest = run(tiny, params, tuple(out.new_token_ids[0] for out in whole[:num_done]))
        assert [out.new_token_ids for out in rest] == [out.new_token_ids for out in whole[num_done:]], num_done
        assert "".join(out.new_text for out in rest) == "".join(out.new_text for out in whole[num_done:])
        assert rest[-1].finish_reason == whole[-1].finish_reason


def test_a_resumed_output_that_leaves_nothing_to_generate_is_refused(tiny: LoadedModel) -> None:
    engine = make_engine(tiny, Clock())
    with pytest.raises(InvalidRequestError, match="leaves no token to generate"):
        engine.add_request(PROMPT, SamplingParams(max_tokens=3), output_token_ids=(5, 6, 7))
    with pytest.raises(InvalidRequestError, match="resumed output token ids"):
        engine.add_request(PROMPT, SamplingParams(max_tokens=3), output_token_ids=(10 ** 9,))
    assert not engine.has_unfinished_requests()
