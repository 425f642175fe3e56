"""Structured outputs (engine/structured.py): grammars from each constraint kind, the sampler's mask, and engine
outputs on tiny-random that fit their grammar however the model leans (greedy, sampled, n > 1), end with "stop"
and leave block accounting at baseline; a token that does not fit ends the request with a reason.
The grammar across a prefill -> decode handoff: tests/engine/test_handoff.py."""

from __future__ import annotations

import json
import re

import pytest
import torch

from kvbaton import LLM, SamplingParams
from kvbaton.core.errors import InvalidRequestError
from kvbaton.core.request import FinishReason, Request
from kvbaton.core.step import SampledToken
from kvbaton.engine.sampler import Sampler
from kvbaton.engine.structured import RequestGrammar, grammar_for, grammar_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["ok", "size", "color"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-random", dtype="float32", num_blocks=256)


def _check_schema(value: object) -> None:
    assert isinstance(value, dict) and list(value) == ["ok", "size", "color"]  # the schema's order
    assert isinstance(value["ok"], bool) and 0 <= value["size"] <= 99 and value["color"] in SCHEMA["properties"]["color"]["enum"]


def generate(llm: LLM, params: SamplingParams, prompt: str = "Answer:") -> list:
    outputs = llm.generate(prompt, params)[0].outputs
    llm.engine.check_invariants()
    return outputs


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_parses_and_fits(llm: LLM, temperature: float) -> None:
    params = SamplingParams(max_tokens=64, temperature=temperature, seed=3, n=3, grammar=grammar_for("json_schema", SCHEMA))
    for out in generate(llm, params):
        _check_schema(json.loads(out.text))
        assert out.finish_reason == FinishReason.STOP


def test_regex_choice_and_lark_outputs_fit(llm: LLM) -> None:
    regex = generate(llm, SamplingParams(max_tokens=32, temperature=1.0, seed=1,
                                         grammar=grammar_for("regex", r"(yes|no), [0-9]{3}")))[0]
    assert re.fullmatch(r"(yes|no), [0-9]{3}", regex.text) and regex.finish_reason == FinishReason.STOP
    choices = ["alpha", "beta", "gamma delta"]
    for out in generate(llm, SamplingParams(max_tokens=32, temperature=1.0, n=4, grammar=grammar_for("choice", choices))):
        assert out.text in choices
    lark = 'start: "x=" NUM ";"\nNUM: /[1-9][0-9]?/'
    out = generate(llm, SamplingParams(max_tokens=16, temperature=0.0, grammar=grammar_for("grammar", lark)))[0]
    assert re.fullmatch(r"x=[1-9][0-9]?;", out.text)
    gbnf = 'root ::= "v" [0-9] [0-9]'  # llama.cpp's GBNF is converted to Lark
    out = generate(llm, SamplingParams(max_tokens=16, temperature=1.0, grammar=grammar_for("grammar", gbnf)))[0]
    assert re.fullmatch(r"v[0-9]{2}", out.text)


def test_any_json_object(llm: LLM) -> None:
    out = generate(llm, SamplingParams(max_tokens=48, temperature=0.0, grammar=grammar_for("json_object", None)))[0]
    if out.finish_reason == FinishReason.STOP:
        assert isinstance(json.loads(out.text), dict)
    else:  # cut by max_tokens: a prefix of an object
        assert out.finish_reason == FinishReason.LENGTH and out.text.startswith("{")


def test_without_grammar_the_model_says_something_else(llm: LLM) -> None:
    # The mask is what makes the outputs above fit: unconstrained, greedy tiny-random does not write JSON.
    out = generate(llm, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    with pytest.raises(ValueError):
        json.loads(out.text)


def test_length_cut_leaves_a_valid_prefix_and_the_grammar_is_freed(llm: LLM) -> None:
    out = generate(llm, SamplingParams(max_tokens=3, temperature=0.0, grammar=grammar_for("json_schema", SCHEMA)))[0]
    assert out.finish_reason == FinishReason.LENGTH and len(out.token_ids) == 3 and out.text.startswith('{"')


@pytest.mark.parametrize(("kind", "spec", "message"), [
    ("regex", "(a", "invalid regex"),
    ("regex", "", "non-empty"),
    ("json_schema", {"type": "objectx"}, "invalid json schema"),
    ("json_schema", "{not json", "invalid json schema"),
    ("json_schema", [1, 2], "must be an object"),
    ("choice", [], "non-empty list"),
    ("choice", ["a", 3], "non-empty list"),
    ("grammar", "start: foo", "invalid grammar"),
    ("grammar", "  ", "non-empty"),
    ("xml", "<a/>", "unknown structured output kind"),
])
def test_bad_constraints_are_refused_with_a_reason(kind: str, spec: object, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        grammar_for(kind, spec)


def test_a_grammar_that_does_not_build_is_refused_before_anything_is_queued(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="structured output grammar"):
        llm.engine.add_request("Hi", SamplingParams(grammar='{"grammars": [{"lark_grammar": "start: undefined_rule"}]}'))
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_invariants()


def test_the_mask_applies_before_sampling_and_logprobs() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]])
    params = SamplingParams(temperature=0.0, logprobs=0)
    allowed = torch.tensor([True, False, True, False])
    (token,) = Sampler(0).sample(logits, ["r"], [params], [Request("r", [0], params, 0.0)], [allowed])
    assert token.token_id == 2  # the best allowed token, not the best token
    assert token.logprob == pytest.approx(float(torch.log_softmax(torch.tensor([0.0, 1.0]), dim=0)[1]))
    assert torch.equal(logits, torch.tensor([[0.0, 5.0, 1.0, 2.0]]))  # the model's logits are left as they were


def test_request_grammar_masks_and_consumes(llm: LLM) -> None:
    tokenizer = llm.engine.tokenizer
    grammar = RequestGrammar(grammar_tokenizer(tokenizer, llm.engine.loaded.config.vocab_size),
                             grammar_for("choice", ["ab"]))
    allowed = grammar.allowed()
    assert allowed.shape == (llm.engine.loaded.config.vocab_size,)
    (a,) = tokenizer.encode("a")
    assert allowed[a] and int(allowed.sum()) <= 2  # "a" (or a merged "ab")
    assert grammar.consume(tokenizer.encode("z")[0])  # does not fit: a reason
    fresh = RequestGrammar(grammar_tokenizer(tokenizer, llm.engine.loaded.config.vocab_size),
                           grammar_for("choice", ["ab"]))
    for token in tokenizer.encode("ab"):
        assert fresh.consume(token) == ""
    assert fresh.complete


def test_an_adopted_first_token_that_does_not_fit_fails_the_request_and_frees_its_blocks(llm: LLM) -> None:
    # A decode engine adopting a handoff replays the prefill's first token through its own matcher; one that
    # the grammar refuses (a mismatched prefill) ends the request with a reason, and its blocks come back.
    engine = llm.engine
    prompt = engine.tokenizer.encode("Answer: yes or no?")
    blocks = engine.pool.allocate(-(-len(prompt) // engine.config.cache.block_size))
    (bad,) = engine.tokenizer.encode("z")
    output = engine.adopt_request(prompt, SamplingParams(max_tokens=8, grammar=grammar_for("choice", ["yes", "no"])),
                                  "adopted", SampledToken(bad), blocks)
    assert output is not None and output.finished and output.finish_reason == FinishReason.ERROR
    assert "structured output" in output.error
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_invariants()


def test_outputs_still_fit_when_requests_are_preempted_and_recomputed() -> None:
    # Preemption keeps a request's output tokens and its matcher (which has consumed exactly them); the recompute
    # samples the next token under the same grammar state.
    small = LLM("tiny-random", dtype="float32", num_blocks=24, block_size=4)
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=0, grammar=grammar_for("regex", "[a-z]{30}!"))
    results = small.generate(["one", "two", "three", "four"], params)
    assert small.engine.stats().num_preemptions > 0
    for result in results:
        assert re.fullmatch("[a-z]{30}!", result.outputs[0].text) and result.outputs[0].finish_reason == FinishReason.STOP
    small.engine.check_invariants()
