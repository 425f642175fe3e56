"""Instant backends and a closed-loop client for `router_overhead.py`: everything except the routers under test.

- `run_fake_rpc_workers`: N kvbaton workers in one process that speak the real worker RPC
  (`kvbaton.server.rpc` over zmq DEALER sockets: register, heartbeats, token deltas) and answer
  every request at once with one fixed delta (4 tokens, finished).
- `run_fake_http_workers`: N OpenAI-style HTTP servers (raw asyncio, keep-alive) for sglang-router:
  `POST /v1/completions` gets a fixed completion at once; any GET (`/health`, `/get_model_info`,
  `/get_server_info`, `/v1/models`, ...) gets 200 with a small JSON body (`serve_http_worker`: one of them, with a
  callback per completion request).
- `serve_fastapi_floor`: the router's HTTP stack (FastAPI + uvicorn) with an endpoint that does nothing.
- `serve_relay_floor`: uvicorn (a bare ASGI app, no FastAPI) relaying each request to the fake kvbaton
  workers over kvbaton's own zmq + msgpack RPC socket, round-robin: HTTP in, one RPC out, one back,
  HTTP out, and nothing else.
- `run_load`: a closed-loop HTTP/1.1 keep-alive client (`concurrency` connections, raw asyncio, so
  the client costs as little CPU as possible) that sends a fixed list of prompts round-robin.
Each runs in its own process, started by `router_overhead.py`, which hands the routers and the fake workers one
cluster secret in the environment (`cluster_secret`), as `kvbaton serve` hands it to its workers.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable

import zmq
from fastapi import FastAPI, Request  # module level: FastAPI resolves the handler's annotations here
from fastapi.responses import JSONResponse

from kvbaton.core.cluster_secret import SECRET_ENV, ClusterSecret
from kvbaton.server import rpc
from kvbaton.server.base import TokenDelta
from kvbaton.server.rpc_auth import secure_dealer

def cluster_secret() -> ClusterSecret:
    """The secret `router_overhead.py` put in this process's environment (routers and fake workers share it)."""
    return ClusterSecret.from_hex(os.environ[SECRET_ENV])


REPLY_TOKEN_IDS = (28, 29, 30, 31)
REPLY_TEXT = " ok ok ok ok"


# -- kvbaton workers over the real RPC -----------------------------------------------------------


def run_fake_rpc_workers(router_address: str, num_workers: int, model_name: str, num_blocks: int = 100_000) -> None:
    """Register `num_workers` fake workers with the router and serve until it sends Shutdown (or dies)."""
    context = zmq.Context()
    sockets: dict[zmq.Socket, str] = {}
    secret = cluster_secret()
    for i in range(num_workers):
        socket = context.socket(zmq.DEALER)
        secure_dealer(socket, secret)
        worker_id = f"fake{i:02d}"
        socket.setsockopt(zmq.IDENTITY, worker_id.encode())
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(router_address)
        socket.send(rpc.encode(rpc.Register(worker_id, "mixed", model_name, "fake-revision", "fake-layout", 16,
                                            num_blocks, "", os.getpid())))
        sockets[socket] = worker_id
    poller = zmq.Poller()
    for socket in sockets:
        poller.register(socket, zmq.POLLIN)
    heartbeat_s = 0.05
    next_heartbeat_at = 0.0
    last_router_at = time.monotonic()
    num_steps = 0
    live = set(sockets)
    while live:
        for socket, _ in poller.poll(10):
            worker_id = sockets[socket]
            while True:
                try:
                    message = rpc.decode(socket.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                last_router_at = time.monotonic()
                if isinstance(message, rpc.AddRequest):
                    num_steps += 1
                    delta = TokenDelta(message.request_id, REPLY_TOKEN_IDS, REPLY_TEXT, True, "length",
                                       len(message.prompt_token_ids), 0, worker_id=worker_id)
                    socket.send(rpc.encode(rpc.TokenDeltas(worker_id, (delta,))))
                elif isinstance(message, rpc.RegisterAck):
                    heartbeat_s = message.heartbeat_interval_s
                elif isinstance(message, rpc.SnapshotRequest):
                    socket.send(rpc.encode(rpc.SnapshotResponse(worker_id, 0, ())))
                elif isinstance(message, (rpc.Shutdown, rpc.RegisterRefuse)):
                    socket.send(rpc.encode(rpc.Goodbye(worker_id, "shutdown")))
                    live.discard(socket)
        now = time.monotonic()
        if now >= next_heartbeat_at:
            next_heartbeat_at = now + heartbeat_s
            for socket in live:
                socket.send(rpc.encode(rpc.Stats(sockets[socket], 0, 0, 0, 0, num_blocks, 0, 0, 0, 0, num_steps, now)))
        if now - last_router_at > 30.0:
            break  # the router is gone
    for socket in sockets:
        socket.close()
    context.term()


# -- OpenAI-style HTTP workers for sglang-router ------------------------------------------------


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, bytes] | None:
    """(method, path, body) of the next HTTP/1.1 request on a keep-alive connection; None at EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    body = await reader.readexactly(length) if length else b""
    return method, path, body


def _response(status: str, payload: dict[str, object]) -> bytes:
    body = json.dumps(payload).encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
            .encode() + body)


def _completion(model: str, body: bytes) -> dict[str, object]:
    try:
        request = json.loads(body)
    except json.JSONDecodeError:
        request = {}
    prompt = request.get("prompt", "") if isinstance(request, dict) else ""
    return {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": model,
            "choices": [{"index": 0, "text": REPLY_TEXT, "logprobs": None, "finish_reason": "length"}],
            "usage": {"prompt_tokens": len(prompt) // 4, "completion_tokens": len(REPLY_TOKEN_IDS),
                      "total_tokens": len(prompt) // 4 + len(REPLY_TOKEN_IDS)}}


async def serve_http_worker(port: int, model: str,
                            on_completion: Callable[[bytes], None] | None = None) -> asyncio.Server:
    """One fake OpenAI-style worker on `port`; `on_completion(body)` is called with each completion request's body
    before it is answered (router_replicas.py keeps a prefix cache tally there)."""
    info = {"model_path": model, "tokenizer_path": model, "is_generation": True, "served_model_name": model,
            "status": "ok", "data": [{"id": model, "object": "model"}], "max_total_num_tokens": 1_000_000}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request = await _read_request(reader)
                if request is None:
                    break
                method, path, body = request
                if method == "POST" and path.startswith("/v1/completions"):
                    if on_completion is not None:
                        on_completion(body)
                    writer.write(_response("200 OK", _completion(model, body)))
                elif method == "POST":
                    writer.write(_response("200 OK", {"status": "ok"}))
                else:
                    writer.write(_response("200 OK", info))
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)


def run_fake_http_workers(ports: list[int], model: str) -> None:
    async def main() -> None:
        servers = [await serve_http_worker(port, model) for port in ports]
        await asyncio.gather(*(s.serve_forever() for s in servers))

    asyncio.run(main())


# -- the HTTP stack alone -------------------------------------------------------------------------


def serve_fastapi_floor(port: int) -> None:
    """FastAPI + uvicorn exactly as kvbaton's router runs them (uvloop, httptools, telemetry), answering
    `POST /v1/completions` with a fixed completion after parsing the JSON body: no tokenizing, no
    routing, no worker. The CPU per request of any router built on this stack is at least this."""
    import uvicorn

    from kvbaton.server.api import fastapi_telemetry
    from kvbaton.server.launcher import run_router_loop

    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, telemetry=fastapi_telemetry())

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        body = json.loads(await request.body())
        return JSONResponse({"id": "cmpl-floor", "object": "text_completion", "created": int(time.time()),
                             "model": body.get("model"), "choices": [{"index": 0, "text": REPLY_TEXT,
                                                                      "logprobs": None, "finish_reason": "length"}],
                             "usage": {"prompt_tokens": 0, "completion_tokens": len(REPLY_TOKEN_IDS),
                                       "total_tokens": len(REPLY_TOKEN_IDS)}})

    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, backlog=1024)
    run_router_loop(uvicorn.Server(config).serve())


# -- the HTTP server and the worker RPC alone ------------------------------------------------------


def serve_relay_floor(http_port: int, rpc_address: str, model: str) -> None:
    """A router reduced to its transports: uvicorn + uvloop + httptools under a bare ASGI app, and kvbaton's
    `RouterSocket` (zmq ROUTER, msgpack frames) to the fake workers. Each POST's body is parsed (orjson), its
    token ids go to the next registered worker in turn as an `AddRequest`, and the worker's finished delta
    is answered as a fixed completion. No validation, tokenizing, hashing, routing policy, metrics or
    accounting: the CPU per request of any Python router on these transports is at least this."""
    import orjson
    import uvicorn

    from kvbaton.core.sampling import SamplingParams
    from kvbaton.server.launcher import run_router_loop
    from kvbaton.server.router_socket import RouterSocket

    sampling = SamplingParams(max_tokens=len(REPLY_TOKEN_IDS), temperature=0.0)
    workers: list[str] = []
    waiting: dict[str, asyncio.Future[int]] = {}
    counter = iter(range(1 << 62))
    socket = RouterSocket(rpc_address, cluster_secret())

    def on_message(identity: str, message: rpc.Message) -> None:
        if isinstance(message, rpc.Register):
            workers.append(identity)
            socket.send(identity, rpc.RegisterAck(identity, "fcfs", 0.5))
        elif isinstance(message, rpc.TokenDeltas):
            for delta in message.deltas:
                future = waiting.pop(delta.request_id, None)
                if future is not None and not future.done():
                    future.set_result(delta.num_prompt_tokens)

    async def app(scope: dict, receive, send) -> None:  # type: ignore[no-untyped-def]
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    socket.start(on_message)
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = orjson.loads(b"".join(chunks))
        request_id = str(next(counter))
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        waiting[request_id] = future
        socket.send(workers[int(request_id) % len(workers)],
                    rpc.AddRequest(request_id, tuple(body["prompt"]), sampling))
        num_prompt_tokens = await future
        out = orjson.dumps({"id": "cmpl-relay", "object": "text_completion", "created": int(time.time()),
                            "model": model, "choices": [{"index": 0, "text": REPLY_TEXT, "logprobs": None,
                                                         "finish_reason": "length"}],
                            "usage": {"prompt_tokens": num_prompt_tokens, "completion_tokens": len(REPLY_TOKEN_IDS),
                                      "total_tokens": num_prompt_tokens + len(REPLY_TOKEN_IDS)}})
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(out)).encode())]})
        await send({"type": "http.response.body", "body": out})

    config = uvicorn.Config(app, host="127.0.0.1", port=http_port, log_level="warning", access_log=False,
                            backlog=1024)
    try:
        run_router_loop(uvicorn.Server(config).serve())
    finally:
        socket.close()


# -- closed-loop client --------------------------------------------------------------------------


async def _read_response(reader: asyncio.StreamReader) -> int:
    """Read one whole HTTP/1.1 response (content-length or chunked); returns the status code."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    length, chunked = 0, False
    for line in lines[1:]:
        name, _, value = line.partition(":")
        name = name.strip().lower()
        if name == "content-length":
            length = int(value)
        elif name == "transfer-encoding" and "chunked" in value.lower():
            chunked = True
    if chunked:
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    elif length:
        await reader.readexactly(length)
    return status


async def _load(host: str, port: int, path: str, bodies: list[bytes], num_requests: int, concurrency: int,
                timeout_s: float, first_body: int, api_key: str, rate_per_s: float = 0.0) -> dict[str, object]:
    counter = iter(range(first_body, first_body + num_requests))
    authorization = f"authorization: Bearer {api_key}\r\n" if api_key else ""
    statuses: dict[int, int] = {}
    errors: list[str] = []

    async def connection() -> None:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            for i in counter:
                if rate_per_s > 0:  # paced: the k-th request starts no sooner than k / rate after the first
                    delay_s = started_s + (i - first_body) / rate_per_s - time.perf_counter()
                    if delay_s > 0:
                        await asyncio.sleep(delay_s)
                body = bodies[i % len(bodies)]
                writer.write((f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
                              f"{authorization}content-length: {len(body)}\r\n\r\n").encode() + body)
                status = await _read_response(reader)
                statuses[status] = statuses.get(status, 0) + 1
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            writer.close()

    started_s = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(connection() for _ in range(concurrency))), timeout_s)
    elapsed_s = time.perf_counter() - started_s
    return {"elapsed_s": elapsed_s, "statuses": {str(k): v for k, v in sorted(statuses.items())},
            "num_ok": statuses.get(200, 0), "errors": errors[:5]}


def run_load(url: str, bodies: list[bytes], num_requests: int, concurrency: int, timeout_s: float,
             first_body: int = 0, api_key: str = "", rate_per_s: float = 0.0) -> dict[str, object]:
    """Send `num_requests` POSTs to `url` (http://host:port/path) over `concurrency` keep-alive connections,
    bodies `first_body`, `first_body + 1`, ... (wrapping around the list); with `rate_per_s`, no faster than that
    (the k-th request starts k / rate_per_s after the first at the soonest)."""
    rest = url.removeprefix("http://")
    hostport, _, path = rest.partition("/")
    host, _, port = hostport.partition(":")
    return asyncio.run(_load(host, int(port), "/" + path, bodies, num_requests, concurrency, timeout_s, first_body,
                             api_key, rate_per_s))
