"""Regressions in tool calls on the chat endpoint (server/tool_calls.py, server/api_chat.py): logprobs of a streamed
named call, and the characters of parsed calls' arguments; against the fake cluster with tiny-random's tokenizer."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from kvbaton.model.tokenizer import Tokenizer
from kvbaton.server.api import create_app
from kvbaton.server.tool_calls import ToolUse, hermes_tool_calls, message_of
from tests.server.api_fakes import FakeCluster

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MESSAGES = [{"role": "user", "content": "Weather in Zürich?"}]


@pytest.fixture()
def client(cluster: FakeCluster, tokenizer: Tokenizer) -> Iterator[TestClient]:
    app = create_app(cluster, tokenizer, "tiny-random", max_model_len=1024, tool_call_parser="hermes")
    with TestClient(app) as test_client:
        yield test_client


def _events(text: str) -> list[dict]:
    return [json.loads(block[6:]) for block in text.split("\n\n") if block.startswith("data: {")]


def test_a_streamed_named_call_carries_the_logprobs_of_every_token(client: TestClient, cluster: FakeCluster,
                                                                    tokenizer: Tokenizer) -> None:
    # While a stop string may still be forming, a token's text is held back: its delta has no text, yet its logprob
    # must still be streamed (as the plain content stream does), and so must that of a final token adding no text.
    arguments = '{"city": "Oslo"}'
    cluster.reply_ids = tokenizer.encode(arguments)
    num_tokens = len(cluster.reply_ids)
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": [WEATHER], "tool_choice": NAMED,
                                                  "max_tokens": num_tokens, "stream": True, "logprobs": True,
                                                  "stop": ["<never seen>"]})
    assert r.status_code == 200, r.text
    choices = [e["choices"][0] for e in _events(r.text) if e["choices"]]
    streamed = "".join(call["function"]["arguments"] for c in choices for call in c["delta"].get("tool_calls", ()))
    assert streamed == arguments
    logprobs = [entry["token"] for c in choices if c["logprobs"] for entry in c["logprobs"]["content"]]
    assert "".join(logprobs) == arguments
    assert choices[-1]["finish_reason"] == "length"
    cluster.reply_ids = tokenizer.encode("   ")  # whitespace that ends as it began: no text after the first token
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": [WEATHER], "tool_choice": NAMED,
                                                  "max_tokens": 3, "stream": True, "logprobs": True,
                                                  "stop": ["  "]})
    choices = [e["choices"][0] for e in _events(r.text) if e["choices"]]
    assert sum(len(c["logprobs"]["content"]) for c in choices if c["logprobs"]) == 2


def test_required_calls_keep_their_arguments_characters() -> None:
    # As vLLM writes arguments (json.dumps(..., ensure_ascii=False)): "Zürich" stays "Zürich", not "Z\\u00fcrich",
    # the same characters a named call streams.
    text = '[{"name": "get_weather", "parameters": {"city": "Zürich"}}]'
    message, reason = message_of(ToolUse("required", "", ""), text, "stop")
    assert reason == "tool_calls"
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == ['{"city": "Zürich"}']


def test_hermes_calls_keep_their_arguments_characters() -> None:
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich 😀"}}</tool_call>'
    _, calls = hermes_tool_calls(text)
    assert calls is not None and calls[0]["function"]["arguments"] == '{"city": "Zürich 😀"}'
