"""Every sampling parameter anywhere in the range validation accepts draws a token (engine/sampler.py): a search over
temperature, top-p, top-k, min-p, the penalties, logit bias, min_tokens' bans, seeds, logprobs and grammar masks,
subnormal floats included, through `sample` and a speculative `verify`; the two values that once made a NaN
distribution and killed the worker and every worker the request then moved to (top_p=5e-324, which float32 holds
as 0; repetition_penalty=5e-324 on a masked token, -inf * 0); and a row that cannot be drawn fails only its own
request, with its reason, while the batch's others finish and every block comes back."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvbaton import LLM
from kvbaton.core.request import FinishReason, Request
from kvbaton.core.sampling import SamplingParams
from kvbaton.engine.sampler import Sampler

VOCAB = 16
EOS = 2


def _request(prompt: list[int], output: list[int], params: SamplingParams) -> Request:
    request = Request("r", prompt, params, 0.0)
    request.eos_token_id = EOS
    request.output_token_ids.extend(output)
    return request


def _unit(draw: st.DrawFn, open_below: bool) -> float:
    value = draw(st.floats(0.0, 1.0, allow_subnormal=True))
    return value if value > 0.0 or not open_below else 5e-324


@st.composite
def cases(draw: st.DrawFn) -> tuple[torch.Tensor, SamplingParams, list[int], list[int], list[bool] | None]:
    logits = draw(st.lists(st.floats(-1e4, 1e4, width=32), min_size=VOCAB, max_size=VOCAB))
    mask = draw(st.one_of(st.none(), st.lists(st.booleans(), min_size=VOCAB, max_size=VOCAB)))
    params = SamplingParams(
        max_tokens=8,
        temperature=draw(st.one_of(st.just(1.0), st.floats(0.0, 100.0, allow_subnormal=True))),
        top_p=_unit(draw, open_below=True), top_k=draw(st.integers(0, VOCAB + 2)), min_p=_unit(draw, open_below=False),
        presence_penalty=draw(st.floats(-2.0, 2.0, allow_subnormal=True)),
        frequency_penalty=draw(st.floats(-2.0, 2.0, allow_subnormal=True)),
        repetition_penalty=draw(st.floats(0.0, 10.0, allow_subnormal=True, exclude_min=True)),
        logit_bias=tuple(draw(st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100.0, 100.0),
                                              max_size=4)).items()),
        min_tokens=draw(st.integers(0, 8)), stop_token_ids=tuple(draw(st.lists(st.integers(0, VOCAB + 3), max_size=3))),
        seed=draw(st.one_of(st.none(), st.integers(0, 2**63))), logprobs=draw(st.one_of(st.none(), st.integers(0, 5))),
        grammar="a grammar" if mask is not None else "")  # the mask stands for its grammar's
    prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6))
    output = draw(st.lists(st.integers(0, VOCAB - 1), max_size=6))
    return torch.tensor([logits]), params, prompt, output, mask


@settings(max_examples=400, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(cases())
@example((torch.zeros(1, VOCAB), SamplingParams(top_p=5e-324), [1], [], None))
@example((torch.zeros(1, VOCAB), SamplingParams(repetition_penalty=5e-324, min_tokens=4), [EOS, 5], [], None))
def test_every_accepted_parameter_draws_a_token(case: tuple[torch.Tensor, SamplingParams, list[int], list[int],
                                                            list[bool] | None]) -> None:
    logits, params, prompt, output, mask = case
    sampler = Sampler(0)
    allowed = None if mask is None else [torch.tensor(mask)]
    [token] = sampler.sample(logits, ["r"], [params], [_request(prompt, output, params)], allowed)
    assert sampler.take_failed() == {}
    assert 0 <= token.token_id < VOCAB
    if mask is not None and any(mask) and len(output) >= params.min_tokens:
        assert mask[token.token_id]  # a grammar's forbidden token is never drawn
    verdict = sampler.verify(logits.repeat(3, 1), [1, 3], params, "r")
    assert sampler.take_failed() == {} and 1 <= len(verdict) <= 3
    assert all(0 <= t.token_id < VOCAB for t in verdict)


def test_a_top_p_below_float32s_least_value_keeps_the_most_likely_token() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9]])
    sampler = Sampler(0)
    params = SamplingParams(top_p=5e-324, temperature=1.0)
    assert {sampler.sample(logits, ["r"], [params])[0].token_id for _ in range(20)} == {1}


def test_a_vanishing_repetition_penalty_leaves_a_banned_token_banned() -> None:
    params = SamplingParams(repetition_penalty=5e-324, min_tokens=4)
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 50.0  # the end of sequence, seen in the prompt and banned below min_tokens
    tokens = {Sampler(seed).sample(logits, ["r"], [params], [_request([EOS, 5], [], params)])[0].token_id
              for seed in range(20)}
    assert EOS not in tokens and len(tokens) > 1


def _nan_for(seed: int, probs):  # noqa: ANN001, ANN202
    """`Sampler._probs` with a NaN distribution for requests seeded `seed`: a row torch refuses to draw from."""
    def probs_or_nan(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        return torch.full_like(row, float("nan")) if p.seed == seed else probs(row, p)
    return probs_or_nan


def test_a_row_that_cannot_be_drawn_is_reported_and_gets_greedys_token(monkeypatch: pytest.MonkeyPatch) -> None:
    sampler = Sampler(0)
    monkeypatch.setattr(sampler, "_probs", _nan_for(13, sampler._probs))
    logits = torch.tensor([[0.0, 2.0, 1.0], [0.0, 0.5, 4.0]])
    poisoned, healthy = SamplingParams(seed=13), SamplingParams(seed=14, top_k=1)
    tokens = sampler.sample(logits, ["bad", "good"], [poisoned, healthy])
    assert [t.token_id for t in tokens] == [1, 2]
    failed = sampler.take_failed()
    assert list(failed) == ["bad"] and "could not be drawn" in failed["bad"] and sampler.take_failed() == {}
    assert [t.token_id for t in sampler.verify(logits, [7], poisoned, "bad")] == [1]  # it stops at its first row
    assert list(sampler.take_failed()) == ["bad"]


def test_a_request_whose_token_cannot_be_drawn_fails_alone_and_frees_its_blocks(monkeypatch: pytest.MonkeyPatch,
                                                                                ) -> None:
    llm = LLM("tiny-random", dtype="float32", num_blocks=64)
    engine = llm.engine
    alone = llm.generate("the others", SamplingParams(max_tokens=12, seed=5, ignore_eos=True))[0].outputs[0].token_ids
    monkeypatch.setattr(engine.sampler, "_probs", _nan_for(13, engine.sampler._probs))
    bad = engine.add_request("a prompt whose draws fail", SamplingParams(max_tokens=12, seed=13, ignore_eos=True))
    good = engine.add_request("the others", SamplingParams(max_tokens=12, seed=5, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    by_request = {rid: [o for o in outputs if o.request_id == rid] for rid in (bad, good)}
    [bad_end] = [o for o in by_request[bad] if o.finished]
    assert bad_end.finish_reason == FinishReason.ERROR.value and "could not be drawn" in bad_end.error
    assert not any(o.new_token_ids for o in by_request[bad])  # no token of its own reached the client
    assert [t for o in by_request[good] for t in o.new_token_ids] == alone
    assert [o.finish_reason for o in by_request[good] if o.finished] == [FinishReason.LENGTH.value]
    engine.check_invariants()  # idle: only the prefix cache holds blocks
