"""Every bad input gets OpenAI's error JSON with the right status, and no traceback reaches the client."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbaton.core.errors import InvalidRequestError
from kvbaton.model.tokenizer import Tokenizer
from kvbaton.server.api import create_app
from kvbaton.server.base import RejectedError
from tests.server.api_fakes import FakeCluster

MODEL = "tiny-random"
MAX_MODEL_LEN = 64
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture()
def client(cluster: FakeCluster, tokenizer: Tokenizer) -> Iterator[TestClient]:
    app = create_app(cluster, tokenizer, MODEL, max_model_len=MAX_MODEL_LEN)
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


def assert_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert "Traceback" not in response.text
    if param is not None:
        assert body["error"]["param"] == param, body
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]["message"]


@pytest.mark.parametrize("raw", [b"{not json", b"", b"\xff\xfe", b"[1, 2]", b'"prompt"'])
def test_malformed_json(client: TestClient, cluster: FakeCluster, raw: bytes) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert_error(client.post(path, content=raw, headers={"content-type": "application/json"}), 400)
    assert cluster.calls == []


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", "ten"), ("max_tokens", 2.5), ("max_tokens", True), ("temperature", "hot"), ("top_p", [1]),
    ("top_k", 1.5), ("n", "2"), ("seed", 1.5), ("stream", "yes"), ("stop", 5), ("stop", ["a", 1]),
    ("logprobs", "3"), ("user", 7), ("ignore_eos", 1), ("stream_options", {"include_usage": "y"}),
])
def test_wrong_types(client: TestClient, cluster: FakeCluster, field: str, value: object) -> None:
    body = {"prompt": "Hi", "max_tokens": 2, field: value}
    if field == "stream_options":
        body["stream"] = True
    assert_error(client.post("/v1/completions", json=body), 400, param=None if field == "stream_options" else field)
    assert cluster.calls == []


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", 0), ("max_tokens", -3), ("temperature", -0.1), ("temperature", 101), ("top_p", 0),
    ("top_p", 1.5), ("top_k", -2), ("n", 0), ("n", 17), ("logprobs", 21), ("logprobs", -1), ("stop", ""),
])
def test_out_of_range(client: TestClient, cluster: FakeCluster, field: str, value: object) -> None:
    assert_error(client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, field: value}), 400,
                 param=field)
    assert cluster.calls == []


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 3},  # without logprobs
    {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 21},
    {"messages": [{"role": "user", "content": "Hi"}], "logprobs": 2},
    {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 0},
])
def test_chat_parameter_errors(client: TestClient, body: dict) -> None:
    assert_error(client.post("/v1/chat/completions", json=body), 400)


@pytest.mark.parametrize("prompt", ["", [], [[]], [""], ["a", ""], [[1, 2], []], [[1, "a"]], ["a", [1]], [1, "a"],
                                    None, 5, {"text": "x"}, [-1], [384], [[1], [-1]], ["a"] * 257])
def test_bad_prompts(client: TestClient, cluster: FakeCluster, prompt: object) -> None:
    body = {"max_tokens": 2} if prompt is None else {"prompt": prompt, "max_tokens": 2}
    assert_error(client.post("/v1/completions", json=body), 400, param="prompt")
    assert cluster.calls == []


@pytest.mark.parametrize("messages", [[], None, "hi", [{"role": "user"}], [{"content": "x"}], [5],
                                      [{"role": "user", "content": [{"type": "image_url"}]}]])
def test_bad_messages(client: TestClient, cluster: FakeCluster, messages: object) -> None:
    assert_error(client.post("/v1/chat/completions", json={"messages": messages}), 400, param="messages")
    assert cluster.calls == []


def test_batch_asking_more_than_256_completions_is_refused(client: TestClient, cluster: FakeCluster) -> None:
    r = client.post("/v1/completions", json={"prompt": ["a"] * 20, "n": 16, "max_tokens": 2})
    assert_error(r, 400, param="prompt")
    assert "asks for 320 completions; at most 256" in r.json()["error"]["message"] and cluster.calls == []


def test_unknown_model_is_404(client: TestClient) -> None:
    message = assert_error(client.post("/v1/completions", json={"model": "gpt-9", "prompt": "Hi"}), 404,
                           param="model", code="model_not_found")
    assert "gpt-9" in message
    assert_error(client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"}), 404, code="model_not_found")
    assert 'kvbaton:request_failure_total{reason="invalid_request"} 2.0' in client.get("/metrics").text


def test_context_overflow(client: TestClient, cluster: FakeCluster) -> None:
    message = assert_error(client.post("/v1/completions", json={"prompt": "x" * 60, "max_tokens": 5}), 400,
                           param="prompt", code="context_length_exceeded")
    assert "64" in message and "65" in message
    assert_error(client.post("/v1/completions", json={"prompt": "x" * 64, "max_tokens": 1}), 400,
                 code="context_length_exceeded")
    long_chat = {"messages": [{"role": "user", "content": "y" * 80}]}
    assert_error(client.post("/v1/chat/completions", json=long_chat), 400, code="context_length_exceeded")
    assert cluster.calls == []
    assert client.post("/v1/completions", json={"prompt": "x" * 59, "max_tokens": 5}).status_code == 200


@pytest.mark.parametrize(("field", "value"), [("tools", [{"type": "function"}]), ("best_of", 3), ("suffix", "x")])
def test_unsupported_parameters_are_refused(client: TestClient, field: str, value: object) -> None:
    assert_error(client.post("/v1/completions", json={"prompt": "Hi", field: value}), 400, param=field,
                 code="unsupported_parameter")


@pytest.mark.parametrize(("field", "value"), [
    ("presence_penalty", 2.5), ("presence_penalty", "1"), ("frequency_penalty", -3), ("repetition_penalty", 0),
    ("repetition_penalty", True), ("logit_bias", [5, 1]), ("logit_bias", {"x": 1}), ("logit_bias", {"-1": 1}),
    ("logit_bias", {"5": 101}), ("logit_bias", {"5": "1"}), ("logit_bias", {"384": 1}),  # tiny-random: 384 tokens
    ("min_p", -0.1), ("min_p", 2), ("min_tokens", -1), ("min_tokens", 1000), ("min_tokens", 1.5),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_penalties_and_logit_bias(client: TestClient, cluster: FakeCluster, path: str, field: str,
                                      value: object) -> None:
    body = {"prompt": "Hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    assert_error(client.post(path, json={**body, field: value}), 400, param=field)
    assert cluster.calls == []


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}, "response_format",
     "invalid json schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "must be"),
    ({"response_format": "json"}, "response_format", "must be"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs", "invalid regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "does not support structural_tag"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs", "must be true"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty list"),
    ({"structured_outputs": {"grammar": "start: missing"}}, "structured_outputs", "invalid grammar"),
    ({"structured_outputs": ["json"]}, "structured_outputs", "must be an object"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format",
     "cannot both"),
    ({"guided_regex": "(a"}, "guided_regex", "invalid regex"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex", "cannot both"),
    ({"structured_outputs": {"regex": "a"}, "guided_json": {}}, "structured_outputs", "cannot both"),
    ({"guided_whitespace_pattern": " ", "guided_json": {}}, "guided_whitespace_pattern", "not supported"),
    ({"structural_tag": "{}"}, "structural_tag", "not supported"),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_structured_outputs(client: TestClient, cluster: FakeCluster, path: str, fields: dict, param: str,
                                message: str) -> None:
    body = {"prompt": "Hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    assert message in assert_error(client.post(path, json={**body, **fields}), 400, param=param)
    assert cluster.calls == []


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"tools": [TOOL]}, "tool_choice", "auto"),  # the default with tools: no parser for the model's syntax
    ({"tools": [TOOL], "tool_choice": "auto"}, "tool_choice", "auto"),
    ({"tool_choice": "required"}, "tool_choice", "only allowed when tools"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice",
     "not among the tools"),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"tools": {"f": 1}, "tool_choice": "required"}, "tools", "must be a list"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools", "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "required"}, "tools", "name"),
    ({"tools": [TOOL, TOOL], "tool_choice": "required"}, "tools", "twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}], "tool_choice": "required"},
     "tools", "parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools", "not a usable JSON schema"),
    ({"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "forced tool call"),
    ({"functions": [{"name": "f"}]}, "functions", "legacy"),
])
def test_bad_tool_use(client: TestClient, cluster: FakeCluster, fields: dict, param: str, message: str) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], **fields}
    assert message in assert_error(client.post("/v1/chat/completions", json=body), 400, param=param)
    assert cluster.calls == []


def test_tools_are_refused_on_completions(client: TestClient) -> None:
    assert_error(client.post("/v1/completions", json={"prompt": "Hi", "tools": [TOOL], "tool_choice": "required"}),
                 400, param="tools", code="unsupported_parameter")


def test_stream_options_without_stream(client: TestClient) -> None:
    assert_error(client.post("/v1/completions", json={"prompt": "Hi", "stream_options": {"include_usage": True}}),
                 400, param="stream_options")


@pytest.mark.parametrize(("status", "stream"), [(429, False), (503, False), (429, True), (503, True)])
def test_rejection_has_retry_after(client: TestClient, cluster: FakeCluster, status: int, stream: bool) -> None:
    cluster.reject = RejectedError("queue is full (300 waiting > 256)", status_code=status, retry_after_s=2.5)
    r = client.post("/v1/completions", json={"prompt": "Hi", "stream": stream, "n": 2})
    message = assert_error(r, status)
    assert r.headers["retry-after"] == "3" and "queue is full" in message
    assert "kvbaton:request_failure_total{reason=\"rejected\"} 1.0" in client.get("/metrics").text


def test_partial_rejection_aborts_the_accepted_samples(client: TestClient, cluster: FakeCluster) -> None:
    cluster.token_delay_s = 0.02  # the accepted sample is still running when the refusal arrives
    cluster.reject = RejectedError("queue is full", status_code=429, retry_after_s=1)
    cluster.reject_from_call = 1
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 50, "n": 2})
    assert_error(r, 429)
    (accepted,) = cluster.calls
    assert cluster.aborted == [accepted.request_id]


def test_invalid_request_from_the_cluster_is_400(client: TestClient, cluster: FakeCluster) -> None:
    cluster.reject = InvalidRequestError("request needs 900 blocks but the pool has 512")
    assert "900 blocks" in assert_error(client.post("/v1/completions", json={"prompt": "Hi"}), 400)
    failures = [line for line in client.get("/metrics").text.splitlines()
                if line.startswith("kvbaton:request_failure_total")]
    assert failures == ['kvbaton:request_failure_total{reason="invalid_request"} 1.0']


def test_cluster_crash_is_a_500_without_traceback(client: TestClient, cluster: FakeCluster) -> None:
    cluster.reject = RuntimeError("secret internal detail")
    r = client.post("/v1/chat/completions", json=CHAT)
    assert "secret" not in assert_error(r, 500)


def test_worker_failure_mid_request(client: TestClient, cluster: FakeCluster) -> None:
    cluster.fail_after_tokens = 2
    message = assert_error(client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 5}), 500)
    assert "worker fake-0 died" in message
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 5, "stream": True})
    assert r.status_code == 200  # headers went out before the failure: the error is an SSE event
    assert '"error": {"message": "worker fake-0 died' in r.text and r.text.endswith("data: [DONE]\n\n")


def test_routing_errors_have_openai_shape(client: TestClient) -> None:
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get("/v1/completions"), 405)


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5000) | st.floats(-2, 200, allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=6,
)
_fields = st.sampled_from(["prompt", "messages", "model", "max_tokens", "max_completion_tokens", "temperature",
                           "top_p", "top_k", "n", "stop", "seed", "logprobs", "top_logprobs", "stream",
                           "stream_options", "echo", "ignore_eos", "user", "best_of", "response_format",
                           "structured_outputs", "tools", "tool_choice"])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       body=st.dictionaries(_fields, _json_values, max_size=5))
def test_fuzzed_bodies_never_crash(client: TestClient, path: str, body: dict) -> None:
    r = client.post(path, json=body)
    assert r.status_code in (200, 400, 404), r.text
    if r.status_code != 200:
        assert_error(r, r.status_code)
    elif body.get("stream") is True:
        assert r.text.endswith("data: [DONE]\n\n")
    else:
        assert r.json()["usage"]["total_tokens"] >= 1
