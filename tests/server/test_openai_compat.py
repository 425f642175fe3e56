"""Regressions found by the OpenAI-compatibility bug hunt of the HTTP layer: each test names the bug it guards,
which it showed on the code it was written against."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from kvbaton.model.tokenizer import Tokenizer
from kvbaton.server import rpc
from kvbaton.server.api import create_app
from tests.server.api_fakes import REPLY, FakeCluster
from tests.server.test_api import sse_events

MODEL = "tiny-random"
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture()
def client(cluster: FakeCluster, tokenizer: Tokenizer) -> Iterator[TestClient]:
    with TestClient(create_app(cluster, tokenizer, MODEL, max_model_len=256), raise_server_exceptions=False) as c:
        yield c


# Was a bug: OpenAIServer._calls (server/api.py) gave each of a request's n samples the request's own `seed`, so a
# seeded request with n > 1 (pass@k evals pin the seed) got n identical choices. vLLM gives sample j the seed
# seed + j (v1/engine/parallel_sampling.py), as OpenAI's n distinct choices. Fixed the same way.
def test_samples_of_a_seeded_request_get_distinct_seeds(client: TestClient, cluster: FakeCluster) -> None:
    r = client.post("/v1/completions", json={"prompt": ["Hi", "Yo"], "max_tokens": 3, "n": 2, "seed": 5})
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] == [REPLY[5:8], REPLY[6:9], REPLY[5:8], REPLY[6:9]]
    seeds = {call.request_id.rsplit("-", 1)[1]: call.sampling.seed for call in cluster.calls}
    assert seeds == {"0": 5, "1": 6, "2": 5, "3": 6}
    r = client.post("/v1/chat/completions", json={**CHAT, "n": 3, "seed": 3})
    assert [c["message"]["content"] for c in r.json()["choices"]] == [REPLY[3:5], REPLY[4:6], REPLY[5:7]]
    r = client.post("/v1/chat/completions", json={**CHAT, "n": 2})  # unseeded samples stay unseeded
    assert [call.sampling.seed for call in cluster.calls[-2:]] == [None, None]


# Was a bug: the chat endpoint (server/api_chat.py) and /tokenize with messages tokenized the rendered chat template
# with Tokenizer.encode, which prepends BOS when the tokenizer says add_bos_token (Llama 3, Mistral, Gemma). Their
# templates write `{{ bos_token }}` themselves, so every chat prompt began with two BOS tokens. vLLM and
# transformers tokenize a rendered template without adding special tokens. Fixed: `encode(text, add_bos=False)`
# for template output; a plain prompt still gets its BOS.
def test_chat_prompts_get_the_templates_bos_only(tokenizer: Tokenizer) -> None:
    bos_adding = copy.copy(tokenizer)
    bos_adding.add_bos_token = True
    bos_adding.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    cluster = FakeCluster(bos_adding)
    expected = [bos_adding.bos_token_id, *tokenizer.encode("user: Hi\n")]
    with TestClient(create_app(cluster, bos_adding, MODEL, max_model_len=256)) as client:
        r = client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200, r.text
        assert list(cluster.calls[0].prompt_token_ids) == expected
        assert r.json()["usage"]["prompt_tokens"] == len(expected)
        r = client.post("/tokenize", json={"messages": CHAT["messages"]})
        assert r.json()["tokens"] == expected and r.json()["count"] == len(expected)
        r = client.post("/tokenize", json={"prompt": "user: Hi\n"})  # a raw prompt still gets the model's BOS
        assert r.json()["tokens"] == expected


# Was a bug: `echo` with `max_tokens: 0` (OpenAI's legacy way to score a prompt, which lm-evaluation-harness's
# OpenAI completions model sent for loglikelihood requests) was a 400 "max_tokens must be a positive integer".
# vLLM (`echo_without_generation`) and OpenAI answer with the prompt alone: its text, and with logprobs its
# tokens' logprobs. Fixed likewise: one token is generated and left out of the answer.
def test_echo_with_max_tokens_0_returns_the_prompt_alone(client: TestClient, cluster: FakeCluster) -> None:
    body = {"prompt": "Hi there", "max_tokens": 0, "echo": True, "logprobs": 1}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert (choice["text"], choice["finish_reason"]) == ("Hi there", "length")
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == list("Hi there")
    assert logprobs["token_logprobs"] == [None, -0.1, -0.2, -0.3, -0.4, -0.5, -0.6, -0.7]
    assert logprobs["text_offset"] == list(range(8))
    assert r.json()["usage"] == {"prompt_tokens": 8, "completion_tokens": 0, "total_tokens": 8,
                                 "prompt_tokens_details": {"cached_tokens": 0}}
    assert cluster.calls[0].sampling.max_tokens == 1
    r = client.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    events = sse_events(r.text)
    chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]
    assert "".join(c["text"] for c in chunks) == "Hi there"
    assert [t for c in chunks for t in c["logprobs"]["tokens"]] == list("Hi there")
    assert chunks[-1]["finish_reason"] == "length"
    assert events[-2]["usage"]["completion_tokens"] == 0
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 0})  # without echo it asks for nothing
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


# The same bug's edge: a sample's seed + j must still travel to a worker (msgpack and torch take 64-bit seeds, and
# orjson reads integers in [-2**63, 2**64)), so past 2**64 it wraps around.
@pytest.mark.parametrize("seed", [2**64 - 1, 2**63 - 1, -(2**63)])
def test_the_extreme_seeds_and_their_samples_travel(client: TestClient, cluster: FakeCluster, seed: int) -> None:
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "n": 16, "seed": seed})
    assert r.status_code == 200, r.text
    seeds = sorted(call.sampling.seed for call in cluster.calls)
    assert len(set(seeds)) == 16 and all(-(2**63) <= s < 2**64 for s in seeds)
    assert cluster.calls[0].sampling.seed == seed  # sample 0 keeps the request's own seed
    for call in cluster.calls:
        rpc.encode(rpc.AddRequest(call.request_id, call.prompt_token_ids, call.sampling))


def _nested(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


# Was a bug: a body nested deeper than Python's recursion limit (orjson reads up to 1024 levels) made the handlers
# raise RecursionError where they render a value with json.dumps (a wrong-typed field's error message, a
# structured-output schema's cache key), which reached the client as a 500 "internal server error" instead of a 400.
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", '{"prompt": "Hi", "max_tokens": 2, "n": %s}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, '
                             '"structured_outputs": {"json": {"type": "object", "default": %s}}}'),
])
def test_deeply_nested_bodies_are_a_400(client: TestClient, cluster: FakeCluster, path: str, body: str) -> None:
    r = client.post(path, content=body % _nested(990), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and cluster.calls == []
