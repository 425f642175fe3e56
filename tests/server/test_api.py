"""The HTTP layer through fastapi's TestClient over a fake cluster: shapes, parameters, usage, metrics."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from kvbaton.engine.structured import grammar_for
from kvbaton.model.tokenizer import Tokenizer
from kvbaton.server.api import create_app
from tests.server.api_fakes import REPLY, FakeCluster

MODEL = "tiny-random"
MAX_MODEL_LEN = 256


@pytest.fixture()
def client(cluster: FakeCluster, tokenizer: Tokenizer) -> Iterator[TestClient]:
    app = create_app(cluster, tokenizer, MODEL, max_model_len=MAX_MODEL_LEN)
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


def sse_events(text: str) -> list[object]:
    """The JSON payloads of an SSE body, with "[DONE]" kept as a string; asserts the framing."""
    assert text.endswith("data: [DONE]\n\n")
    events: list[object] = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block.removeprefix("data: ")
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_completion_non_stream_shape_usage_and_call(client: TestClient, cluster: FakeCluster, tokenizer: Tokenizer) -> None:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Say hi", "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == MODEL
    assert isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": REPLY[:5], "logprobs": None, "finish_reason": "length"}]
    num_prompt = len(tokenizer.encode("Say hi"))
    assert body["usage"] == {"prompt_tokens": num_prompt, "completion_tokens": 5, "total_tokens": num_prompt + 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    (call,) = cluster.calls
    assert call.prompt_token_ids == tuple(tokenizer.encode("Say hi"))
    assert call.request_id == f"{body['id']}-0"
    assert call.sampling.max_tokens == 5 and call.sampling.temperature == 0.0 and call.sampling.n == 1


@pytest.mark.parametrize("prompt", [[75, 108], [[75, 108]], ["Hi"]])
def test_completion_prompt_forms(client: TestClient, cluster: FakeCluster, prompt: object) -> None:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert cluster.calls[0].prompt_token_ids == (75, 108)  # byte-level: byte b is token 3 + b


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_penalties_and_logit_bias_reach_the_call(client: TestClient, cluster: FakeCluster, path: str) -> None:
    body = {"prompt": "Hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    r = client.post(path, json={**body, "max_tokens": 2, "presence_penalty": 0.5, "frequency_penalty": -0.25,
                                "repetition_penalty": 1.1, "logit_bias": {"7": -100, "42": 3.5}, "min_p": 0.1,
                                "min_tokens": 2})
    assert r.status_code == 200, r.text
    sampling = cluster.calls[0].sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty) == (0.5, -0.25, 1.1)
    assert sampling.logit_bias == ((7, -100.0), (42, 3.5)) and sampling.min_p == 0.1 and sampling.min_tokens == 2


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_priority_needs_priority_scheduling_and_then_reaches_the_call(cluster: FakeCluster, tokenizer: Tokenizer,
                                                                     path: str) -> None:
    body = {"prompt": "Hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    with TestClient(create_app(cluster, tokenizer, MODEL, max_model_len=MAX_MODEL_LEN)) as plain:
        r = plain.post(path, json={**body, "max_tokens": 2, "priority": 3})
        assert r.status_code == 400 and "--scheduling-policy priority" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "priority"
        assert plain.post(path, json={**body, "max_tokens": 2, "priority": 0}).status_code == 200
    with TestClient(create_app(cluster, tokenizer, MODEL, max_model_len=MAX_MODEL_LEN,
                               priority_scheduling=True)) as prioritized:
        assert prioritized.post(path, json={**body, "max_tokens": 2, "priority": -7}).status_code == 200
        for bad in ("high", 1.5, True, 1 << 40):
            r = prioritized.post(path, json={**body, "max_tokens": 2, "priority": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "priority", (bad, r.text)
    assert [c.sampling.priority for c in cluster.calls] == [0, -7]


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(("fields", "kind", "spec"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     "json_schema", SCHEMA),
    ({"response_format": {"type": "json_object"}}, "json_object", None),
    ({"structured_outputs": {"json": SCHEMA}}, "json_schema", SCHEMA),
    ({"structured_outputs": {"regex": "[ab]{2}"}}, "regex", "[ab]{2}"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", ["yes", "no"]),
    ({"structured_outputs": {"grammar": 'start: "a" | "b"'}}, "grammar", 'start: "a" | "b"'),
    ({"structured_outputs": {"json_object": True}}, "json_object", None),
    ({"response_format": {"type": "text"}}, None, None),
    # vLLM's fields before v0.12, which clients still send: the structured_outputs key each names.
    ({"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"}, "json_schema", SCHEMA),
    ({"guided_regex": "[ab]{2}"}, "regex", "[ab]{2}"),
    ({"guided_choice": ["yes", "no"]}, "choice", ["yes", "no"]),
    ({"guided_grammar": 'start: "a" | "b"'}, "grammar", 'start: "a" | "b"'),
    ({"guided_json": None, "response_format": {"type": "json_object"}}, "json_object", None),
])
def test_structured_outputs_reach_the_call_as_one_grammar(client: TestClient, cluster: FakeCluster, path: str,
                                                          fields: dict, kind: str | None, spec: object) -> None:
    body = {"prompt": "Hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    r = client.post(path, json={**body, "max_tokens": 2, "n": 2, **fields})
    assert r.status_code == 200, r.text
    expected = grammar_for(kind, spec) if kind is not None else ""
    assert [call.sampling.grammar for call in cluster.calls] == [expected, expected]


def test_a_forced_tool_call_reaches_the_call_as_its_grammar_and_the_template_sees_the_tools(
        client: TestClient, cluster: FakeCluster, tokenizer: Tokenizer) -> None:
    params = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
    tools = [{"type": "function", "function": {"name": "search", "parameters": params}},
             {"type": "function", "function": {"name": "noop"}}]
    messages = [{"role": "user", "content": "Find cats"}]
    named = {"type": "function", "function": {"name": "search"}}
    r = client.post("/v1/chat/completions", json={"messages": messages, "tools": tools, "tool_choice": named,
                                                  "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert cluster.calls[0].sampling.grammar == grammar_for("json_schema", params)
    # The fake's reply is not JSON and was cut at max_tokens: no call is made of it; the text comes back as content.
    assert r.json()["choices"][0]["message"]["content"] == REPLY[:4]
    assert r.json()["choices"][0]["finish_reason"] == "length"
    r = client.post("/v1/chat/completions", json={"messages": messages, "tools": tools, "tool_choice": "required",
                                                  "parallel_tool_calls": False, "max_tokens": 4})
    required = json.loads(cluster.calls[1].sampling.grammar)["grammars"][0]["json_schema"]
    assert required["maxItems"] == 1 and [item["properties"]["name"] for item in required["items"]["anyOf"]] == [
        {"const": "search"}, {"const": "noop"}]
    r = client.post("/v1/chat/completions", json={"messages": messages, "tools": tools, "tool_choice": "none",
                                                  "max_tokens": 4})
    assert cluster.calls[2].sampling.grammar == ""
    # The chat template is given the tools (tiny-random's ignores them; the prompt is the plain chat's).
    assert cluster.calls[0].prompt_token_ids == tuple(tokenizer.encode(tokenizer.apply_chat_template(messages)))


def test_completion_batch_numbers_choices_prompt_by_prompt(client: TestClient, cluster: FakeCluster,
                                                           tokenizer: Tokenizer) -> None:
    prompts = ["Say hi", "And bye"]
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompts, "max_tokens": 3, "n": 2,
                                             "echo": True})
    assert r.status_code == 200, r.text
    body = r.json()
    # As vLLM numbers them: prompt p's sample j is choice p * n + j, and each choice echoes its own prompt.
    assert [(c["index"], c["text"]) for c in body["choices"]] == [
        (0, "Say hi" + REPLY[:3]), (1, "Say hi" + REPLY[:3]), (2, "And bye" + REPLY[:3]), (3, "And bye" + REPLY[:3])]
    assert [c.request_id for c in cluster.calls] == [f"{body['id']}-{i}" for i in range(4)]
    assert [c.prompt_token_ids for c in cluster.calls] == [tuple(tokenizer.encode(p)) for p in prompts for _ in "ab"]
    num_prompt = sum(len(tokenizer.encode(p)) for p in prompts)  # each prompt once, for all its samples
    assert body["usage"] == {"prompt_tokens": num_prompt, "completion_tokens": 12, "total_tokens": num_prompt + 12,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_completion_batch_of_token_ids_streams_every_choice_and_sums_cached_tokens(client: TestClient,
                                                                                     cluster: FakeCluster) -> None:
    long_ids = list(range(3, 3 + 40))
    assert client.post("/v1/completions", json={"prompt": long_ids, "max_tokens": 1}).status_code == 200
    r = client.post("/v1/completions", json={"prompt": [long_ids, long_ids, [75, 108]], "max_tokens": 2,
                                             "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    texts: dict[int, str] = {}
    for event in events[:-2]:
        (choice,) = event["choices"]  # type: ignore[index]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: REPLY[:2], 1: REPLY[:2], 2: REPLY[:2]}
    usage = events[-2]["usage"]  # type: ignore[index]
    # Both copies of the long prompt hit the first request's 32 cached tokens (block-aligned): summed per prompt.
    assert usage["prompt_tokens"] == 82 and usage["completion_tokens"] == 6  # type: ignore[index]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 64}  # type: ignore[index]


def test_completion_batch_with_one_over_long_prompt_is_refused_whole(client: TestClient, cluster: FakeCluster) -> None:
    r = client.post("/v1/completions", json={"prompt": ["Hi", "x" * (MAX_MODEL_LEN + 1)], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert cluster.calls == []


def test_sampling_parameters_reach_the_cluster(client: TestClient, cluster: FakeCluster) -> None:
    r = client.post("/v1/completions", json={
        "model": MODEL, "prompt": "x", "max_tokens": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 5,
        "seed": 11, "stop": ["zz"], "ignore_eos": True, "user": "tenant-a"})
    assert r.status_code == 200
    params = cluster.calls[0].sampling
    assert (params.temperature, params.top_p, params.top_k, params.seed, params.stop, params.ignore_eos) == \
        (0.7, 0.9, 5, 11, ("zz",), True)
    # `user` and x-tenant name a tenant only behind --trust-tenant-header (tests/server/test_auth_tenants.py).
    assert cluster.calls[0].tenant == ""
    client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "top_k": -1}, headers={"x-tenant": "t2"})
    assert cluster.calls[1].sampling.top_k == 0 and cluster.calls[1].tenant == ""


def test_completion_stream_matches_non_stream_and_reports_usage(client: TestClient, tokenizer: Tokenizer) -> None:
    request = {"model": MODEL, "prompt": "Say hi", "max_tokens": 7, "stream": True,
               "stream_options": {"include_usage": True}}
    r = client.post("/v1/completions", json=request)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    chunks, usage_chunk, done = events[:-2], events[-2], events[-1]
    assert done == "[DONE]"
    assert "".join(c["choices"][0]["text"] for c in chunks) == REPLY[:7]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 6 + ["length"]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 7
    assert usage_chunk["usage"]["prompt_tokens"] == len(tokenizer.encode("Say hi"))


def test_chat_non_stream_applies_template_once(client: TestClient, cluster: FakeCluster, tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 4})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["message"]["content"] == REPLY[:4]
    assert body["choices"][0]["finish_reason"] == "length"
    expected = tuple(tokenizer.encode(tokenizer.apply_chat_template(messages)))
    assert cluster.calls[0].prompt_token_ids == expected
    assert body["usage"]["prompt_tokens"] == len(expected)


def test_chat_max_completion_tokens_and_default_to_context(client: TestClient, cluster: FakeCluster) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    client.post("/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 3, "max_tokens": 9})
    assert cluster.calls[0].sampling.max_tokens == 3
    client.post("/v1/chat/completions", json={"messages": messages})
    num_prompt = len(cluster.calls[1].prompt_token_ids)
    assert cluster.calls[1].sampling.max_tokens == MAX_MODEL_LEN - num_prompt


def test_chat_stream_chunks(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-2]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == REPLY[:3]
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert events[-2]["usage"]["completion_tokens"] == 3 and events[-2]["choices"] == []


def test_n_samples_are_separate_calls(client: TestClient, cluster: FakeCluster) -> None:
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "n": 3, "seed": 1})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c.request_id for c in cluster.calls] == [f"{body['id']}-{i}" for i in range(3)]
    assert all(c.sampling.n == 1 for c in cluster.calls)
    assert body["usage"]["completion_tokens"] == 12 and body["usage"]["prompt_tokens"] == 2
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                  "max_tokens": 2, "n": 2, "stream": True})
    finishes = [c["choices"][0]["index"] for c in sse_events(r.text)[:-1] if c["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [0, 1]


def test_completion_logprobs(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "logprobs": 2})
    logprobs = r.json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == list(REPLY[:3])
    assert logprobs["token_logprobs"] == [-0.25, -0.5, -0.75]
    assert logprobs["text_offset"] == [0, 1, 2]
    assert [len(top) for top in logprobs["top_logprobs"]] == [2, 2, 2]
    assert logprobs["top_logprobs"][0]["H"] == -0.25


def test_chat_logprobs(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                  "max_tokens": 2, "logprobs": True, "top_logprobs": 3})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == ["H", "e"]
    assert content[0]["bytes"] == [72] and content[0]["logprob"] == -0.25
    assert len(content[0]["top_logprobs"]) == 3 and content[0]["top_logprobs"][0]["token"] == "H"
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                  "max_tokens": 2, "logprobs": True, "stream": True})
    chunks = [c for c in sse_events(r.text)[:-1] if c["choices"][0]["logprobs"]]
    assert [c["choices"][0]["logprobs"]["content"][0]["token"] for c in chunks] == ["H", "e"]


def test_cached_tokens_on_shared_prefix(client: TestClient) -> None:
    system = "You are a careful assistant. " * 4
    first = client.post("/v1/completions", json={"prompt": system + "Question one?", "max_tokens": 1}).json()
    second = client.post("/v1/completions", json={"prompt": system + "Question two?", "max_tokens": 1}).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    num_shared_tokens = len(system + "Question ")  # byte-level: one token per character
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == num_shared_tokens // 16 * 16


def test_stop_string(client: TestClient, cluster: FakeCluster) -> None:
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 40, "stop": "kvb"})
    choice = r.json()["choices"][0]
    assert choice["text"] == "Hello from " and choice["finish_reason"] == "stop"
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 40, "stop": ["zzz", "from"],
                                             "stream": True})
    chunks = sse_events(r.text)[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_lists_the_prompts_tokens_first(client: TestClient, cluster: FakeCluster,
                                                           tokenizer: Tokenizer, stream: bool) -> None:
    # lm-eval's loglikelihood request: the prompt's tokens with their logprobs (the first has none), then the
    # completion's, in one set of parallel lists whose text offsets run through the echoed prompt.
    r = client.post("/v1/completions", json={"prompt": "Cats", "max_tokens": 2, "echo": True, "logprobs": 1,
                                             "stream": stream})
    assert r.status_code == 200, r.text
    assert cluster.calls[0].sampling.prompt_logprobs == 1
    if stream:
        chunks = [e for e in sse_events(r.text) if isinstance(e, dict)]
        first = chunks[0]["choices"][0]["logprobs"]
        logprobs = {key: [v for c in chunks for v in c["choices"][0]["logprobs"][key]] for key in first}
    else:
        logprobs = r.json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["C", "a", "t", "s", *REPLY[:2]]
    assert logprobs["token_logprobs"][:4] == [None, -0.1, -0.2, -0.3] and len(logprobs["token_logprobs"]) == 6
    assert logprobs["top_logprobs"][0] is None and logprobs["top_logprobs"][1] == {"a": -0.1}
    assert logprobs["text_offset"] == [0, 1, 2, 3, 4, 5]
    plain = client.post("/v1/completions", json={"prompt": "Cats", "max_tokens": 2, "logprobs": 1}).json()
    assert cluster.calls[1].sampling.prompt_logprobs is None and plain["choices"][0]["logprobs"]["tokens"] == list(
        REPLY[:2])


def test_prompt_logprobs_as_vllm_answers_them(client: TestClient, cluster: FakeCluster, tokenizer: Tokenizer) -> None:
    # vLLM's prompt_logprobs: null for the first prompt token, then {token id: {logprob, rank, decoded_token}} for each;
    # on each completions choice, and once at the top of a chat response. Not with streaming (a 400, as vLLM).
    r = client.post("/v1/completions", json={"prompt": "Cats", "max_tokens": 2, "prompt_logprobs": 1, "n": 2})
    assert r.status_code == 200, r.text
    assert [c.sampling.prompt_logprobs for c in cluster.calls] == [1, 1]
    ids = tokenizer.encode("Cats")
    expected = [None, *({str(t): {"logprob": -p / 10, "rank": 1, "decoded_token": ch}}
                        for p, (t, ch) in enumerate(zip(ids[1:], "ats"), start=1))]
    choices = r.json()["choices"]
    assert [c["prompt_logprobs"] for c in choices] == [expected, expected] and choices[0]["text"] == REPLY[:2]
    assert "prompt_logprobs" not in client.post("/v1/completions", json={"prompt": "Cats"}).json()["choices"][0]
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Cats"}],
                                                     "max_tokens": 2, "prompt_logprobs": 0}).json()
    scored, call = chat["prompt_logprobs"], cluster.calls[-1]
    assert call.sampling.prompt_logprobs == 0 and scored[0] is None and len(scored) == len(call.prompt_token_ids)
    assert [list(entry) for entry in scored[1:]] == [[str(t)] for t in call.prompt_token_ids[1:]]
    for body, param in [({"prompt": "Cats", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
                        ({"prompt": "Cats", "prompt_logprobs": 21}, "prompt_logprobs"),
                        ({"prompt": "Cats", "prompt_logprobs": -1}, "prompt_logprobs")]:
        refused = client.post("/v1/completions", json=body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, body


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_vllm_output_options_reach_the_call_and_usage_can_stream_continuously(client: TestClient, cluster: FakeCluster,
                                                                             path: str) -> None:
    body = {"prompt": "Hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    r = client.post(path, json={**body, "max_tokens": 3, "include_stop_str_in_output": True,
                                "skip_special_tokens": False, "stream": True,
                                "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert r.status_code == 200, r.text
    sampling = cluster.calls[0].sampling
    assert sampling.include_stop_str_in_output and not sampling.skip_special_tokens
    chunks = [e for e in sse_events(r.text) if isinstance(e, dict)]
    with_choices = [c for c in chunks if c["choices"]]
    assert all("usage" in c for c in with_choices)
    completion_tokens = [c["usage"]["completion_tokens"] for c in with_choices]
    assert completion_tokens == sorted(completion_tokens) and completion_tokens[-1] == 3  # cumulative
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


def test_chat_template_options(client: TestClient, cluster: FakeCluster, tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}]
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2,
                                                  "add_generation_prompt": False, "continue_final_message": True})
    assert r.status_code == 200, r.text
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert expected.endswith("Hello, I am") and cluster.calls[0].prompt_token_ids == tuple(tokenizer.encode(expected))
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "add_generation_prompt": False})
    assert cluster.calls[1].prompt_token_ids == tuple(tokenizer.encode(
        tokenizer.apply_chat_template(messages, add_generation_prompt=False)))
    r = client.post("/v1/chat/completions", json={"messages": messages, "continue_final_message": True})
    assert r.status_code == 400 and "cannot both" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={"messages": messages, "chat_template_kwargs": ["x"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_echo_and_request_id_header(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "echo": True},
                    headers={"x-request-id": "client-42"})
    assert r.json()["choices"][0]["text"] == "Hi" + REPLY[:2]
    assert r.headers["x-request-id"] == "client-42"
    assert "client-42" not in r.json()["id"]


def test_small_endpoints(client: TestClient, cluster: FakeCluster) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").status_code == 200
    cluster.ready = (False, "no live worker (lost: w1: exited with code -9)")
    r = client.get("/ready")
    assert r.status_code == 503 and r.json()["reason"] == "no live worker (lost: w1: exited with code -9)"
    assert client.get("/cluster").json() == cluster.cluster_info()
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]


def test_metrics(client: TestClient) -> None:
    system = "Shared system prompt for the metrics test. "
    client.post("/v1/completions", json={"prompt": system + "a", "max_tokens": 3})
    client.post("/v1/completions", json={"prompt": system + "b", "max_tokens": 3})
    text = client.get("/metrics").text
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(lines["kvbaton:time_to_first_token_seconds_count"]) == 2
    assert float(lines["kvbaton:inter_token_latency_seconds_count"]) == 4
    assert float(lines["kvbaton:e2e_request_latency_seconds_count"]) == 2
    assert float(lines['kvbaton:request_success_total{finished_reason="length"}']) == 2
    assert float(lines["kvbaton:generation_tokens_total"]) == 6
    assert float(lines["kvbaton:prefix_cache_queries_total"]) == 2 * (len(system) + 1)
    assert float(lines["kvbaton:prefix_cache_hits_total"]) == len(system) // 16 * 16
    assert float(lines["kvbaton:num_requests_waiting"]) == 1
    assert float(lines["kvbaton:kv_cache_usage_perc"]) == 0.25
    assert float(lines['kvbaton:router_decisions_total{reason="exploit"}']) == 2
    assert "kvbaton:num_requests_running" in lines
    cache = client.app.state.server.tokenizer.cache  # shared by this module's apps: compare with its own count
    assert float(lines["kvbaton:tokenizer_cache_queries_total"]) == cache.stats().num_queries >= 2


def test_each_app_has_its_own_registry(client: TestClient, tokenizer: Tokenizer) -> None:
    client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    other = create_app(FakeCluster(tokenizer), tokenizer, MODEL, max_model_len=MAX_MODEL_LEN)
    with TestClient(other) as other_client:
        assert "kvbaton:generation_tokens_total 0.0" in other_client.get("/metrics").text
    assert "kvbaton:generation_tokens_total 2.0" in client.get("/metrics").text


def test_tokenize_and_detokenize(client: TestClient, cluster: FakeCluster, tokenizer: Tokenizer) -> None:
    r = client.post("/tokenize", json={"model": MODEL, "prompt": "Say hi"})
    ids = tokenizer.encode("Say hi")
    assert r.status_code == 200 and r.json() == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids,
                                                 "token_strs": None}
    strs = client.post("/tokenize", json={"prompt": "Say hi", "return_token_strs": True}).json()["token_strs"]
    assert strs == [tokenizer.id_to_token(t) for t in ids] and "".join(strs).replace("Ġ", " ") == "Say hi"
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.post("/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == tokenizer.encode(tokenizer.apply_chat_template(messages))  # what the chat route sends
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "Say hi"}
    assert cluster.calls == []  # nothing reaches the workers


def test_reset_prefix_cache_asks_the_cluster(client: TestClient, cluster: FakeCluster) -> None:
    r = client.post("/reset_prefix_cache")
    assert r.status_code == 200 and r.json() == {"workers": ["fake-0"]} and cluster.num_resets == 1
    assert client.get("/reset_prefix_cache").status_code == 405  # POST only, as vLLM's


def test_tokenize_takes_the_chat_endpoints_template_options(client: TestClient, tokenizer: Tokenizer) -> None:
    # vLLM's /tokenize takes add_generation_prompt, continue_final_message, tools and chat_template_kwargs for a chat,
    # so its count is what the chat endpoint would send; it once ignored them and always added the generation prompt.
    # (tiny-random's template leaves tools out, so only their validation shows here.)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    for options, rendered in [
        ({}, tokenizer.apply_chat_template(messages)),
        ({"add_generation_prompt": False}, tokenizer.apply_chat_template(messages, False)),
        ({"add_generation_prompt": False, "continue_final_message": True},
         tokenizer.apply_chat_template(messages, False, continue_final_message=True)),
    ]:
        got = client.post("/tokenize", json={"messages": messages, **options}).json()
        assert got["tokens"] == tokenizer.encode(rendered, add_bos=False), options
    assert tokenizer.apply_chat_template(messages, False) != tokenizer.apply_chat_template(messages)
    refused = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": True,
                                             "continue_final_message": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages"
    bad_tools = client.post("/tokenize", json={"messages": messages, "tools": [{"type": "x"}]})
    assert bad_tools.status_code == 400 and bad_tools.json()["error"]["param"] == "tools"


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "user"}]}, "messages"), ("/tokenize", {"model": "gpt-9", "prompt": "x"}, "model"),
    ("/detokenize", {"tokens": "abc"}, "tokens"), ("/detokenize", {"tokens": [1, -2]}, "tokens"),
    ("/detokenize", {"tokens": [384]}, "tokens"), ("/detokenize", {"tokens": [True]}, "tokens"),
])
def test_tokenize_and_detokenize_refuse_bad_input(client: TestClient, path: str, body: dict, param: str) -> None:
    r = client.post(path, json=body)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text
