"""The tool-call parsers beyond Hermes (server/tool_parsers.py), on the text their models write: Mistral's
`[TOOL_CALLS]` (the JSON list of the v3 tokenizer and the `name[ARGS]{...}` of v11+), Llama 3.x's JSON calls
(with and without `<|python_tag|>`, several joined by `;`), and Qwen3-Coder's XML calls with typed parameters.
Streamed a character at a time, the content never shows a piece of a marker or of a call; through the chat
endpoint (the fake model writing the text), whole and streamed."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from kvbaton.model.tokenizer import Tokenizer
from kvbaton.server.api import create_app
from kvbaton.server.tool_calls import ToolCallStream, ToolUse
from kvbaton.server.tool_parsers import PARSERS
from tests.server.api_fakes import FakeCluster

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "ratio": {"type": "number"},
                                     "tags": {"type": "array"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]

CASES = [
    # Mistral 7B v0.3 (v3 tokenizer): one JSON list.
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                '{"name": "get_time", "arguments": {}}]',
     None, [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    # Mistral Small 3.2 / Devstral (v11+ tokenizers): name[ARGS]{json} per call, content before.
    ("mistral", 'Checking both.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}',
     "Checking both.", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Bergen"}', None, [("get_weather", {"city": "Bergen"})]),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "argu', None, None),  # cut by max_tokens
    ("mistral", "Just text.", "Just text.", None),
    # Llama 3.1 / 3.2 / 3.3 JSON tool calling.
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}', None,
     [("get_weather", {"city": "Oslo"})]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                    '{"name": "get_time", "parameters": {}}',
     None, [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ("llama3_json", 'It is sunny.', "It is sunny.", None),
    ("llama3_json", '{"name": "get_weather", "parameters": {"ci', None, None),
    ("llama3_json", '{"not": "a call"}', None, None),
    # Qwen3-Coder's XML calls: parameters typed by the schema.
    ("qwen3_xml", "I'll look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
                  "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
                  "<parameter=ratio>\n0.5\n</parameter>\n<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n"
                  "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
     "I'll look.", [("get_weather", {"city": "New York", "days": 3, "metric": True, "ratio": 0.5, "tags": ["a", "b"]}),
                    ("get_time", {})]),
    ("qwen3_xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n", None, None),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', None, [("get_time", {})]),
]


def _unparsed(text: str, content: str | None) -> str | None:
    return text if content is None else content


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_the_formats_models_write_become_calls(parser: str, text: str, content: str | None,
                                               calls: list | None) -> None:
    got_content, got_calls = PARSERS[parser].calls(text, TOOLS)
    if calls is None:
        assert got_calls is None and got_content == text
        return
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
    assert all(c["type"] == "function" for c in got_calls)
    if parser == "mistral":  # Mistral's template takes 9-char alphanumeric ids only
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in got_calls)
    else:
        assert all(c["id"].startswith("call_") for c in got_calls)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_streamed_a_char_at_a_time_the_content_holds_no_call(parser: str, text: str, content: str | None,
                                                             calls: list | None) -> None:
    stream = ToolCallStream(ToolUse("auto", "", "", parser, tuple(TOOLS)))
    pieces = []
    for end in range(1, len(text) + 1):
        pieces += stream.pieces(0, text[end - 1], end == len(text), "stop" if end == len(text) else None, text[:end])
    streamed = "".join(p.get("content", "") for p, _ in pieces)
    streamed_calls = [call for p, _ in pieces for call in p.get("tool_calls", ())]
    if calls is None:
        assert streamed == text and not streamed_calls and pieces[-1][1] == "stop"
        return
    assert streamed.strip() == (content or "")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in streamed_calls] == calls
    assert [c["index"] for c in streamed_calls] == list(range(len(calls))) and pieces[-1][1] == "tool_calls"


MISTRAL_ANSWER = 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'
BODY = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": TOOLS, "temperature": 0}


@pytest.fixture()
def mistral_client(cluster: FakeCluster, tokenizer: Tokenizer) -> Iterator[TestClient]:
    cluster.reply_ids = tokenizer.encode(MISTRAL_ANSWER)
    app = create_app(cluster, tokenizer, "tiny-random", max_model_len=1024, tool_call_parser="mistral")
    with TestClient(app) as client:
        yield client


def test_the_chat_endpoint_reads_mistral_calls_whole_and_streamed(mistral_client: TestClient, cluster: FakeCluster,
                                                                  tokenizer: Tokenizer) -> None:
    body = {**BODY, "max_tokens": len(tokenizer.encode(MISTRAL_ANSWER))}
    choice = mistral_client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    # [TOOL_CALLS] is one of Mistral's special tokens: the parser's requests decode with them kept, as vLLM's.
    assert cluster.calls[0].sampling.skip_special_tokens is False
    r = mistral_client.post("/v1/chat/completions", json={**body, "stream": True})
    events = [json.loads(block[6:]) for block in r.text.split("\n\n") if block.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == "Checking."
    (calls,) = [d["tool_calls"] for d in deltas if d.get("tool_calls")]
    assert calls[0]["function"]["name"] == "get_weather"
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
