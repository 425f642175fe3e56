"""vLLM's request fields beyond OpenAI's: truncate_prompt_tokens, cache_salt and documents are honoured; the ones
kvbaton does not implement are refused by name, since dropping them would change the answer without a word."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from kvbaton.model.tokenizer import Tokenizer
from kvbaton.server.api import create_app
from tests.server.api_fakes import FakeCluster

MODEL = "tiny-random"
MAX_MODEL_LEN = 128
CHAT = [{"role": "user", "content": "Tell me about the weather in a long sentence please"}]


@pytest.fixture()
def client(cluster: FakeCluster, tokenizer: Tokenizer) -> Iterator[TestClient]:
    with TestClient(create_app(cluster, tokenizer, MODEL, max_model_len=MAX_MODEL_LEN)) as test_client:
        yield test_client


@pytest.mark.parametrize(("path", "field", "value"), [
    ("/v1/completions", "use_beam_search", True),
    ("/v1/chat/completions", "use_beam_search", True),
    ("/v1/completions", "allowed_token_ids", [5, 6]),
    ("/v1/chat/completions", "bad_words", ["rain"]),
    ("/v1/completions", "return_tokens_as_token_ids", True),
    ("/v1/completions", "logits_processors", ["my.module:Processor"]),
    ("/v1/chat/completions", "length_penalty", 0.5),
    ("/v1/chat/completions", "chat_template", "{{ messages[0]['content'] }}"),
])
def test_fields_kvbaton_does_not_implement_are_refused_by_name(client: TestClient, cluster: FakeCluster, path: str,
                                                                field: str, value: object) -> None:
    body = {"messages": CHAT} if "chat" in path else {"prompt": "Hi"}
    r = client.post(path, json={**body, "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["code"] == "unsupported_parameter", error
    assert cluster.calls == []


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_their_default_values_pass(client: TestClient, path: str) -> None:
    body = {"messages": CHAT} if "chat" in path else {"prompt": "Hi"}
    defaults = {"use_beam_search": False, "allowed_token_ids": None, "bad_words": [], "length_penalty": 1.0,
                "return_tokens_as_token_ids": False, "logits_processors": None, "chat_template": None}
    assert client.post(path, json={**body, "max_tokens": 2, **defaults}).status_code == 200


def test_truncate_prompt_tokens_keeps_the_last_k(client: TestClient, cluster: FakeCluster,
                                                 tokenizer: Tokenizer) -> None:
    ids = list(range(10, 60))
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 2, "truncate_prompt_tokens": 12})
    assert r.status_code == 200, r.text
    assert cluster.calls[-1].prompt_token_ids == tuple(ids[-12:]) and r.json()["usage"]["prompt_tokens"] == 12
    # A text prompt, echoed as truncated.
    text = "one two three four five six seven eight nine ten"
    r = client.post("/v1/completions", json={"prompt": text, "max_tokens": 2, "echo": True,
                                             "truncate_prompt_tokens": 5})
    kept = tokenizer.encode(text)[-5:]
    assert cluster.calls[-1].prompt_token_ids == tuple(kept)
    assert r.json()["choices"][0]["text"].startswith(tokenizer.decode(kept))
    # -1: as many as the context holds; a prompt that fits is whole.
    client.post("/v1/completions", json={"prompt": ids, "max_tokens": 2, "truncate_prompt_tokens": -1})
    assert cluster.calls[-1].prompt_token_ids == tuple(ids)
    # A chat is truncated after its template.
    full = tokenizer.encode(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True))
    client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "truncate_prompt_tokens": 7})
    assert cluster.calls[-1].prompt_token_ids == tuple(full[-7:])


@pytest.mark.parametrize("value", [0, -2, MAX_MODEL_LEN + 1, 2.5, "8"])
def test_bad_truncate_prompt_tokens(client: TestClient, cluster: FakeCluster, value: object) -> None:
    for path, body in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": CHAT})):
        r = client.post(path, json={**body, "max_tokens": 2, "truncate_prompt_tokens": value})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
    assert cluster.calls == []


def test_cache_salt_divides_the_prefix_cache(client: TestClient, cluster: FakeCluster) -> None:
    prompt = "a shared system prompt, " * 3

    def cached(**fields: object) -> int:
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, **fields})
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert cached(cache_salt="alice") == 0
    assert cached(cache_salt="bob") == 0  # another salt finds nothing of alice's
    assert cached() == 0  # nor does an unsalted request
    assert cached(cache_salt="alice") > 0 and cached() > 0
    tenants = [call.tenant for call in cluster.calls]  # tenants with salts: tests/server/test_auth_tenants.py
    assert len(set(tenants)) == 3 and "" in tenants
    for bad in ("", 7, ["alice"]):
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "cache_salt": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text


def test_documents_reach_the_chat_template(cluster: FakeCluster, tokenizer: Tokenizer) -> None:
    rag = copy.copy(tokenizer)
    rag.chat_template = ("{% for d in documents %}[doc {{ d.title }}: {{ d.text }}]{% endfor %}"
                         "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
    with TestClient(create_app(cluster, rag, MODEL, max_model_len=MAX_MODEL_LEN)) as client:
        documents = [{"title": "a", "text": "sunny"}, {"title": "b", "text": "windy"}]
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Weather?"}],
                                                      "max_tokens": 2, "documents": documents})
        assert r.status_code == 200, r.text
        assert rag.decode(list(cluster.calls[0].prompt_token_ids)) == (
            "[doc a: sunny][doc b: windy]<user>Weather?<assistant>")
        r = client.post("/tokenize", json={"messages": [{"role": "user", "content": "Weather?"}],
                                           "documents": documents})
        assert r.json()["tokens"] == list(cluster.calls[0].prompt_token_ids)  # counted as the chat sends it
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Weather?"}],
                                                      "documents": "sunny"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "documents"
