"""Tool choice "auto" with the Hermes parser (server/tool_calls.py): `<tool_call>` blocks in a model's answer become
OpenAI tool calls, whole and streamed (content up to the first block, never a partial tag), and an answer without
complete blocks stays content; without a parser, "auto" is refused."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from kvbaton.model.registry import load_model
from kvbaton.model.tokenizer import Tokenizer
from kvbaton.server.api import create_app
from kvbaton.server.tool_calls import hermes_tool_calls
from tests.server.api_fakes import FakeCluster

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "get_time"}}]
ANSWER = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
          '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')


@pytest.mark.parametrize(("text", "content", "calls"), [
    (ANSWER, "Let me check.", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', None, [("f", {"x": 1})]),
    ("No tools needed: 42.", "No tools needed: 42.", None),
    ('Sure <tool_call>{"name": "f", "argu', 'Sure <tool_call>{"name": "f", "argu', None),  # cut by max_tokens
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", None),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', None),
])
def test_hermes_blocks_become_calls(text: str, content: str | None, calls: list | None) -> None:
    got_content, got_calls = hermes_tool_calls(text)
    assert got_content == content
    if calls is None:
        assert got_calls is None
    else:
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
        assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got_calls)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_model("tiny-random").tokenizer


@pytest.fixture()
def cluster(tokenizer: Tokenizer) -> FakeCluster:
    fake = FakeCluster(tokenizer)
    fake.reply_ids = tokenizer.encode(ANSWER)  # the fake model answers with two tool calls
    return fake


@pytest.fixture()
def client(cluster: FakeCluster, tokenizer: Tokenizer) -> Iterator[TestClient]:
    app = create_app(cluster, tokenizer, "tiny-random", max_model_len=1024, tool_call_parser="hermes")
    with TestClient(app) as test_client:
        yield test_client


BODY = {"messages": [{"role": "user", "content": "Weather in Oslo, and the time?"}], "tools": TOOLS,
        "temperature": 0, "stop": ["<|im_end|>"]}


def test_auto_answers_tool_calls(client: TestClient, cluster: FakeCluster, tokenizer: Tokenizer) -> None:
    num_tokens = len(tokenizer.encode(ANSWER))
    r = client.post("/v1/chat/completions", json={**BODY, "max_tokens": num_tokens})
    assert r.status_code == 200, r.text
    assert cluster.calls[0].sampling.grammar == ""  # the model writes freely
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "Let me check."
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather", "get_time"]
    # The fake ends at max_tokens, after complete calls: they are returned, and the reason says so (as vLLM's).
    assert choice["finish_reason"] == "tool_calls"


def test_auto_streams_content_then_the_calls(client: TestClient, tokenizer: Tokenizer) -> None:
    num_tokens = len(tokenizer.encode(ANSWER))
    r = client.post("/v1/chat/completions", json={**BODY, "max_tokens": num_tokens, "stream": True})
    events = [json.loads(block[6:]) for block in r.text.split("\n\n") if block.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == "Let me check.\n" and "<" not in content
    (calls,) = [d["tool_calls"] for d in deltas if d.get("tool_calls")]
    assert [c["index"] for c in calls] == [0, 1] and json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}


def test_an_answer_cut_inside_a_block_is_content(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={**BODY, "max_tokens": 30})
    message = r.json()["choices"][0]["message"]
    assert message.get("tool_calls") is None and message["content"] == ANSWER[:30]


def test_without_a_parser_auto_is_refused(cluster: FakeCluster, tokenizer: Tokenizer) -> None:
    app = create_app(cluster, tokenizer, "tiny-random", max_model_len=1024)
    with TestClient(app) as plain:
        r = plain.post("/v1/chat/completions", json={**BODY, "max_tokens": 4})
    assert r.status_code == 400 and "--tool-call-parser hermes" in r.json()["error"]["message"]


def test_an_unknown_parser_is_refused_at_startup(cluster: FakeCluster, tokenizer: Tokenizer) -> None:
    with pytest.raises(Exception, match="unknown tool call parser"):
        create_app(cluster, tokenizer, "tiny-random", max_model_len=1024, tool_call_parser="pythonic")
