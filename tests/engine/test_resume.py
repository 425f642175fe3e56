"""A migrated request resumes after the tokens it already produced (`Engine.add_request(output_token_ids=...)`): the
rest of its tokens, text and finish reason equal what one uninterrupted engine gives, whatever the sampling
options that read the output so far (stop strings, min_tokens, penalties, a grammar, a seed), with speculative decoding
too."""

from __future__ import annotations

import pytest

from kvbaton.core.config import CacheConfig, EngineConfig, SchedulerConfig
from kvbaton.core.errors import InvalidRequestError
from kvbaton.core.sampling import SamplingParams
from kvbaton.core.step import TokenDelta
from kvbaton.engine.engine import Engine
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


SPEC_PROMPT = [3, 4, 5, 6, 7, 8] * 5  # repeats: prompt lookup proposes drafts
SPEC_SEEDED = SamplingParams(max_tokens=40, temperature=0.7, top_k=3, seed=5, ignore_eos=True)


def run_spec(tiny: LoadedModel, num_speculative_tokens: int, params: SamplingParams,
             output_token_ids: tuple[int, ...] = ()) -> tuple[list[int], int]:
    """The tokens generated, and the drafts accepted."""
    engine = Engine(EngineConfig(model="tiny-random", cache=CacheConfig(16, 64, True),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=16,
                                                           num_speculative_tokens=num_speculative_tokens)),
                    loaded=tiny, clock=Clock())
    engine.add_request(SPEC_PROMPT, params, request_id="r", output_token_ids=output_token_ids)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
    engine.check_invariants()
    return tokens, engine.scheduler.num_accepted_tokens


def test_a_seeded_request_draws_the_same_tokens_with_speculative_decoding_or_without(tiny: LoadedModel) -> None:
    # Each output position draws from its own seeded stream, and verification keeps a draft only when it is the
    # token that position draws: the drafts change how many steps it takes, not the tokens.
    plain, _ = run_spec(tiny, 0, SPEC_SEEDED)
    speculative, num_accepted = run_spec(tiny, 3, SPEC_SEEDED)
    assert num_accepted > 0
    assert speculative == plain
    other_seed, _ = run_spec(tiny, 3, SamplingParams(max_tokens=40, temperature=0.7, top_k=3, seed=6,
                                                     ignore_eos=True))
    assert other_seed != plain  # the seed does choose the tokens


def test_a_seeded_speculative_request_resumed_goes_on_exactly_as_the_uninterrupted_one(tiny: LoadedModel) -> None:
    # Was a gap: the resumed request's generator moved past one draw per token given, but verification draws a
    # varying number per token, so a seeded request migrated under --speculative-tokens drew other tokens.
    whole, _ = run_spec(tiny, 3, SPEC_SEEDED)
    for num_done in (1, 7, len(whole) // 2, len(whole) - 1):
        rest, _ = run_spec(tiny, 3, SPEC_SEEDED, tuple(whole[:num_done]))
        assert rest == whole[num_done:], num_done
