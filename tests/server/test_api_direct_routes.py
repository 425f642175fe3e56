"""The generation routes are answered straight from `RouterApp.__call__`, outside Starlette's middleware stack:
they must answer exactly as the stack would, and give way to it whenever the stack would do more."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvbaton.model.tokenizer import Tokenizer
from kvbaton.server.api import RouterApp, create_app
from tests.server.api_fakes import REPLY, FakeCluster

MODEL = "tiny-random"


def make_app(cluster: FakeCluster, tokenizer: Tokenizer) -> RouterApp:
    app = create_app(cluster, tokenizer, MODEL, max_model_len=256)
    assert isinstance(app, RouterApp)
    return app


def call(app: ASGIApp, path: str, chunks: list[bytes], method: str = "POST", disconnect_after: int | None = None,
         headers: list[tuple[bytes, bytes]] | None = None) -> list[Message]:
    """One HTTP request through the ASGI interface, its body in `chunks` (more_body on all but the last), or
    a disconnect after `disconnect_after` of them; returns what the app sent."""
    sent: list[Message] = []
    incoming: list[Message] = [{"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
                               for i, chunk in enumerate(chunks)]
    if disconnect_after is not None:
        incoming = incoming[:disconnect_after]
        incoming.append({"type": "http.disconnect"})

    async def receive() -> Message:
        if incoming:
            return incoming.pop(0)
        await asyncio.sleep(3600)  # the client has nothing more to send
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        sent.append(message)

    scope: Scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                    "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
                    "headers": [(b"content-type", b"application/json"), *(headers or [])],
                    "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000)}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 10.0))
    return sent


def status_and_body(sent: list[Message]) -> tuple[int, bytes]:
    assert sent[0]["type"] == "http.response.start"
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


BODY = b'{"model": "tiny-random", "prompt": "Hello there", "max_tokens": 5, "temperature": 0}'


def test_a_body_in_several_messages_is_read_whole_without_the_middleware_stack(
        cluster: FakeCluster, tokenizer: Tokenizer) -> None:
    app = make_app(cluster, tokenizer)
    sent = call(app, "/v1/completions", [BODY[:10], BODY[10:40], b"", BODY[40:]],
                headers=[(b"x-request-id", b"client-7")])
    status, body = status_and_body(sent)
    assert status == 200, body
    assert REPLY[:5].encode() in body
    assert (b"x-request-id", b"client-7") in sent[0]["headers"]  # echoed, as through the stack
    assert cluster.calls[0].prompt_token_ids == tuple(tokenizer.encode("Hello there"))
    assert app.middleware_stack is None  # answered directly: the stack was never even built


def test_a_client_gone_before_its_body_ends_gets_nothing_and_starts_nothing(
        cluster: FakeCluster, tokenizer: Tokenizer) -> None:
    app = make_app(cluster, tokenizer)
    assert call(app, "/v1/completions", [BODY[:10], BODY[10:]], disconnect_after=1) == []
    assert call(app, "/v1/chat/completions", [BODY], disconnect_after=0) == []
    assert cluster.calls == []


def test_errors_answer_as_the_stack_answers_them(cluster: FakeCluster, tokenizer: Tokenizer) -> None:
    app = make_app(cluster, tokenizer)
    status, body = status_and_body(call(app, "/v1/completions", [b"{not json"]))
    assert status == 400 and b'"invalid_request_error"' in body
    cluster.reject = RuntimeError("worker exploded")  # an unexpected exception: the app's 500 handler
    status, body = status_and_body(call(app, "/v1/completions", [BODY]))
    assert status == 500 and b'"server_error"' in body and b"exploded" not in body
    # Another method on a direct route, or another path, goes through the stack (its 405 and 404).
    assert status_and_body(call(app, "/v1/completions", [b""], method="GET"))[0] == 405
    assert status_and_body(call(app, "/v1/nothing", [BODY]))[0] == 404


def test_added_middleware_sees_the_generation_routes(cluster: FakeCluster, tokenizer: Tokenizer) -> None:
    """A direct answer would skip user middleware (CORS, auth, tracing): once one is added, the stack answers."""
    app = make_app(cluster, tokenizer)

    class Tag:
        def __init__(self, inner: ASGIApp) -> None:
            self.inner = inner

        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            async def tagged(message: Message) -> None:
                if message["type"] == "http.response.start":
                    message["headers"] = [*message.get("headers", []), (b"x-tag", b"seen")]
                await send(message)

            await self.inner(scope, receive, tagged)

    app.add_middleware(Tag)
    with TestClient(app) as client:
        for path, body in (("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                     "max_tokens": 2}),
                           ("/tokenize", {"prompt": "Hi"})):
            response = client.post(path, json={"model": MODEL, **body})
            assert response.status_code == 200, response.text
            assert response.headers["x-tag"] == "seen", path


@pytest.mark.parametrize("stream", [False, True])
def test_direct_and_stacked_answers_match(cluster: FakeCluster, tokenizer: Tokenizer, stream: bool) -> None:
    """The same requests through the direct path and through the stack (forced by a no-op middleware) answer
    byte for byte alike, but for the random ids and timestamps."""
    def answers(app: RouterApp) -> list[tuple[int, str]]:
        out = []
        with TestClient(app) as client:
            for body in ({"prompt": "Hello", "max_tokens": 4, "logprobs": 2, "stream": stream},
                         {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": stream},
                         {"prompt": "Hi", "max_tokens": 0}):
                path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                response = client.post(path, json={"model": MODEL, **body})
                text = response.text
                for key in ('"id":', '"created":'):
                    while key in text:  # blank each value out
                        start = text.index(key) + len(key)
                        end = min(i for i in (text.find(",", start), text.find("}", start)) if i >= 0)
                        text = text[:text.index(key)] + "ID" + text[end:]
                out.append((response.status_code, text))
        return out

    direct = make_app(cluster, tokenizer)
    stacked = make_app(FakeCluster(tokenizer), tokenizer)

    class Noop:
        def __init__(self, inner: ASGIApp) -> None:
            self.inner = inner

        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            await self.inner(scope, receive, send)

    stacked.add_middleware(Noop)
    assert answers(direct) == answers(stacked)
