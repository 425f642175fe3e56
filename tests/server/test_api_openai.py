"""The official `openai` client against a real uvicorn server on 127.0.0.1 (fake cluster), and client
disconnects — streaming, non-streaming, through raw sockets and the client — reaching the cluster as aborts."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from kvbaton.model.tokenizer import Tokenizer
from kvbaton.server.api import create_app
from kvbaton.server.base import RejectedError
from tests.server.api_fakes import REPLY, FakeCluster, ThreadedServer

MODEL = "tiny-random"


@pytest.fixture()
def server(cluster: FakeCluster, tokenizer: Tokenizer) -> Iterator[ThreadedServer]:
    running = ThreadedServer(create_app(cluster, tokenizer, MODEL, max_model_len=1024)).start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture()
def client(server: ThreadedServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=20.0) as oa:
        yield oa


def wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def test_completions(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt="Say hi", max_tokens=6, temperature=0)
    assert resp.choices[0].text == REPLY[:6] and resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 6 and resp.usage.prompt_tokens_details.cached_tokens == 0
    stream = client.completions.create(model=MODEL, prompt="Say hi", max_tokens=6, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == REPLY[:6]
    assert chunks[-1].usage.total_tokens == resp.usage.total_tokens


def test_chat(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, n=2, seed=3)
    assert [c.message.content for c in resp.choices] == [REPLY[3:8], REPLY[4:9]]  # sample j is seeded seed + j
    assert resp.usage.completion_tokens == 10
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=5, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == REPLY[:5]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 5


def test_logprobs_stop_and_cached_tokens(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                          logprobs=True, top_logprobs=2)
    content = resp.choices[0].logprobs.content
    assert [e.token for e in content] == ["H", "e"] and len(content[1].top_logprobs) == 2
    resp = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, logprobs=1)
    assert resp.choices[0].logprobs.token_logprobs == [-0.25, -0.5, -0.75]
    resp = client.completions.create(model=MODEL, prompt="Hi", max_tokens=30, stop=["kvbaton"])
    assert resp.choices[0].text == "Hello from " and resp.choices[0].finish_reason == "stop"
    system = "A long shared system prompt that many requests start with. " * 2
    client.completions.create(model=MODEL, prompt=system + "first", max_tokens=1)
    second = client.completions.create(model=MODEL, prompt=system + "second", max_tokens=1)
    assert second.usage.prompt_tokens_details.cached_tokens == len(system) // 16 * 16


def test_errors_map_to_client_exceptions(client: openai.OpenAI, cluster: FakeCluster) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="Hi", temperature=-1)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "Hi"}])
    cluster.reject = RejectedError("too many waiting requests", status_code=429, retry_after_s=1)
    with pytest.raises(openai.RateLimitError) as limited:
        client.completions.create(model=MODEL, prompt="Hi")
    assert limited.value.response.headers["retry-after"] == "1"


def test_worker_failure_mid_stream_raises_in_the_client(client: openai.OpenAI, cluster: FakeCluster) -> None:
    cluster.fail_after_tokens = 2
    with pytest.raises(openai.APIError, match="worker fake-0 died"):
        list(client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, stream=True))


# -- client disconnect -> abort ------------------------------------------------------------------------


@pytest.fixture()
def slow_cluster(cluster: FakeCluster) -> FakeCluster:
    cluster.token_delay_s = 0.02  # 500 tokens would take 10 s: only an abort ends a call within the test
    return cluster


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_disconnect_mid_stream_aborts(server: ThreadedServer, slow_cluster: FakeCluster, path: str) -> None:
    body = {"prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 500, "n": 2,
            "stream": True}
    with httpx.Client(timeout=10.0) as http, http.stream("POST", server.url + path, json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        received = [next(lines) for _ in range(6)]  # a few chunks, then hang up
        assert any(line.startswith("data: {") for line in received)
    ids = {c.request_id for c in slow_cluster.calls}
    assert len(ids) == 2
    assert wait_for(lambda: set(slow_cluster.aborted) == ids)
    assert wait_for(lambda: all(slow_cluster.finished.get(i) == "abort" for i in ids))
    assert slow_cluster.active == set()


def test_disconnect_non_stream_aborts(server: ThreadedServer, slow_cluster: FakeCluster) -> None:
    payload = b'{"prompt": "Hi", "max_tokens": 500}'
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload
    with socket.create_connection(("127.0.0.1", server.port), timeout=5.0) as sock:
        sock.sendall(request)
        assert wait_for(lambda: len(slow_cluster.calls) == 1)
        time.sleep(0.1)  # a few tokens in
    (call,) = slow_cluster.calls
    assert wait_for(lambda: slow_cluster.aborted == [call.request_id])
    assert wait_for(lambda: slow_cluster.finished.get(call.request_id) == "abort")


def test_openai_client_closing_a_stream_aborts(client: openai.OpenAI, slow_cluster: FakeCluster) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=500, stream=True)
    first = [next(stream) for _ in range(3)]
    assert first[0].choices[0].delta.role == "assistant"
    stream.close()
    (call,) = slow_cluster.calls
    assert wait_for(lambda: slow_cluster.aborted == [call.request_id])
    assert wait_for(lambda: slow_cluster.finished.get(call.request_id) == "abort")


def test_finished_requests_are_not_aborted(client: openai.OpenAI, cluster: FakeCluster) -> None:
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=3)
    list(client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, stream=True))
    time.sleep(0.1)
    assert cluster.aborted == []
