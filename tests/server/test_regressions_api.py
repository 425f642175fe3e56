"""Regressions found by the second bug hunt (HTTP layer): each test names the bug it guards, which it showed on the
code it was written against."""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator, Iterator

import pytest
from fastapi.testclient import TestClient

from kvbaton.core.step import SampledToken
from kvbaton.model.registry import load_model
from kvbaton.model.tokenizer import Tokenizer
from kvbaton.server.api import create_app
from kvbaton.server.base import GenerateCall, TokenDelta
from tests.server.api_fakes import FakeCluster

MODEL = "tiny-random"
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_model("tiny-random").tokenizer


def _strict_json(text: str) -> object:
    """JSON as every non-Python client parses it: NaN / Infinity / -Infinity are not JSON."""
    def refuse(constant: str) -> object:
        raise ValueError(f"{constant} is not valid JSON")
    return json.loads(text, parse_constant=refuse)


class MaskedLogprobsCluster(FakeCluster):
    """Answers as a worker does under a structured-output grammar: the top logprobs of the tokens the grammar
    forbids are -inf (the engine's `torch.topk` over the masked log-softmax; see engine/sampler.py `_sampled`,
    reproduced with a real Engine and `grammar_for("choice", ["yes", "no"])`, logprobs=5)."""

    async def _generate(self, call: GenerateCall) -> AsyncIterator[TokenDelta]:
        self.calls.append(call)
        token_id = self.reply_ids[0]
        top = ((token_id, 0.0), (3, float("-inf")), (4, float("-inf")))[: call.sampling.logprobs or 1]
        self.finished[call.request_id] = "stop"
        text = self.tokenizer.decode([token_id])  # type: ignore[attr-defined]
        yield TokenDelta(call.request_id, (token_id,), text, True, "stop",
                         num_prompt_tokens=len(call.prompt_token_ids),
                         logprobs=(SampledToken(token_id, 0.0, top),), worker_id="fake-0")


@pytest.fixture()
def masked_client(tokenizer: Tokenizer) -> Iterator[TestClient]:
    app = create_app(MaskedLogprobsCluster(tokenizer), tokenizer, MODEL, max_model_len=64)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


# Was a bug: a grammar-masked token's logprob is -inf, and the streaming path renders it with json.dumps
# (protocol_responses.sse), which writes the non-JSON literal `-Infinity`: every SSE chunk carrying it is
# unparseable by JSON.parse / strict clients. Fixed: clamped to -9999.0 in the response builders, as vLLM does.
@pytest.mark.parametrize("path, extra", [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 3}),
    ("/v1/completions", {"logprobs": 3}),
])
def test_streamed_logprobs_of_masked_tokens_are_valid_json(masked_client: TestClient, path: str, extra: dict) -> None:
    body = {**CHAT, "prompt": "Hi", "stream": True, "structured_outputs": {"choice": ["yes", "no"]}, **extra}
    r = masked_client.post(path, json=body)
    assert r.status_code == 200, r.text
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: {")]
    assert events
    for event in events:
        _strict_json(event)


# Was a bug: the same -inf logprobs in a whole (non-streamed) answer go through orjson (FastJSONResponse), which writes
# them as null: OpenAI's schema (and the openai client's pydantic models) require a number for every logprob.
def test_whole_answer_logprobs_of_masked_tokens_are_numbers(masked_client: TestClient) -> None:
    body = {**CHAT, "logprobs": True, "top_logprobs": 3, "structured_outputs": {"choice": ["yes", "no"]}}
    r = masked_client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    (content,) = r.json()["choices"][0]["logprobs"]["content"]
    assert all(isinstance(top["logprob"], float) for top in content["top_logprobs"]), content


# A chat template in the style of Qwen2.5's (and others'): an assistant message's tool calls are rendered with
# `tool_call.arguments | tojson`.
TOOL_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] }}"
    "{% for tool_call in message.tool_calls or [] %}{% if tool_call.function is defined %}"
    "{% set tool_call = tool_call.function %}{% endif %}"
    "{{ '<tool_call>{\"name\": \"' + tool_call.name + '\", \"arguments\": ' + (tool_call.arguments | tojson) "
    "+ '}</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


# Was a bug: Tokenizer.apply_chat_template (model/tokenizer.py) passes `tool_calls` to the template unvalidated and only
# turns jinja2.TemplateError into InvalidRequestError; a malformed tool call (no "arguments", or tool_calls not a
# list) makes the template raise TypeError (`tojson(Undefined)`, iterating an int), which reaches the client as a
# 500 "internal server error" on /v1/chat/completions and /tokenize instead of a 400 naming `messages`. Fixed:
# tool_calls are validated with the messages, and a template's TypeError/ValueError is a 400 too.
@pytest.mark.parametrize("tool_calls", [[{"type": "function", "function": {"name": "f"}}], 5])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_malformed_tool_calls_in_messages_are_a_400(tokenizer: Tokenizer, tool_calls: object, path: str) -> None:
    templated = copy.copy(tokenizer)
    templated.chat_template = TOOL_TEMPLATE
    cluster = FakeCluster(templated)
    app = create_app(cluster, templated, MODEL, max_model_len=512)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": tool_calls},
                {"role": "user", "content": "go on"}]
    with TestClient(app, raise_server_exceptions=False) as client:
        good = [{"type": "function", "id": "a", "function": {"name": "f", "arguments": "{}"}}]
        ok = client.post(path, json={"messages": [*messages[:1], {**messages[1], "tool_calls": good}, *messages[2:]],
                                     "max_tokens": 2})
        assert ok.status_code == 200, ok.text
        r = client.post(path, json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages"
    assert len(cluster.calls) == (1 if path == "/v1/chat/completions" else 0)  # only the well-formed request ran


# Smaller findings of the same hunt, each fixed with its test.
@pytest.mark.parametrize("field", [None, True])
def test_parallel_tool_calls_null_is_the_default(tokenizer: Tokenizer, field: object) -> None:
    cluster = FakeCluster(tokenizer)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    with TestClient(create_app(cluster, tokenizer, MODEL, max_model_len=512)) as client:
        r = client.post("/v1/chat/completions", json={**CHAT, "tools": [tool], "tool_choice": "required",
                                                      "parallel_tool_calls": field})
    assert r.status_code == 200, r.text


def test_stop_token_ids_are_bounded(tokenizer: Tokenizer) -> None:
    with TestClient(create_app(FakeCluster(tokenizer), tokenizer, MODEL, max_model_len=512)) as client:
        r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stop_token_ids": list(range(1025))})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids", r.text


def test_the_router_accepts_no_request_longer_than_a_workers_kv_pool() -> None:
    from kvbaton.model.registry import read_model_source, resolve_model_source
    from kvbaton.server.launcher import ServeConfig, serving_max_model_len

    model_config = read_model_source(resolve_model_source(MODEL))[0]
    assert serving_max_model_len(ServeConfig(num_blocks=64, block_size=16), model_config) == 1024
    assert serving_max_model_len(ServeConfig(num_blocks=4096), model_config) == model_config.max_position_embeddings
