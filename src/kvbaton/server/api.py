"""The router's HTTP layer: OpenAI-compatible completions, chat and Responses over a `ClusterClient`, plus
/v1/models, vLLM's /tokenize, /detokenize and /reset_prefix_cache, /health, /ready, /cluster, Prometheus /metrics,
the live /dashboard and the OpenAPI document of them all (/openapi.json). Every request passes `ApiAuth` first
(`server/auth.py`: API keys, roles, tenants), the generation routes answered straight from `RouterApp.__call__`
included.

It validates, applies the chat template and tokenizes once at ingress, expands each prompt of a completions
batch and `n` into one `GenerateCall` per sample (prompt p's sample j is choice p * n + j, as in vLLM),
merges the samples' delta streams and renders them as OpenAI JSON or SSE.
Every way a request can end without the client reading it (disconnect while waiting, while streaming,
or while a non-streaming response is computed) aborts its unfinished samples on the cluster. Bad input
gets OpenAI's error shape; no traceback ever reaches a client.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from kvbaton.core.step import SampledToken
from kvbaton.core.errors import InvalidRequestError
from kvbaton.core.sampling import SamplingParams
from kvbaton.model.tokenizer import Tokenizer
from kvbaton.model.token_cache import DEFAULT_MAX_CACHED_CHARS
from kvbaton.server.api_run import DisconnectWatch, SampleRun
from kvbaton.server.auth import ApiAuth
from kvbaton.server.base import ClusterClient, GenerateCall, SubmittingClusterClient
from kvbaton.server.metrics import ApiMetrics
from kvbaton.server.api_chat import ChatEndpoint
from kvbaton.server.api_responses import ResponsesEndpoint
from kvbaton.server.dashboard import DASHBOARD_HTML, dashboard_data
from kvbaton.server.responses_store import ResponseStore
from kvbaton.server.openapi import openapi_document
from kvbaton.server.tool_calls import TOOL_CALL_PARSERS
from kvbaton.server.protocol import (
    ApiError,
    CompletionRequest,
    bad_request,
    parse_completion_request,
    parse_detokenize_request,
    parse_json_body,
    parse_tokenize_request,
)
from kvbaton.server.protocol_responses import (
    FastJSONResponse,
    TokenText,
    completion_logprobs_json,
    echo_logprobs_json,
    prompt_logprobs_json,
    sse,
)

logger = logging.getLogger(__name__)


# OpenTelemetry's placeholders until something installs a real provider (FastAPI's own test, in
# fastapi.telemetry; the API offers no public "is configured" query).
_OTEL_PLACEHOLDERS = frozenset({("opentelemetry.trace", "ProxyTracerProvider"),
                                ("opentelemetry.metrics._internal", "_ProxyMeterProvider"),
                                ("opentelemetry._logs._internal", "ProxyLoggerProvider")})


def fastapi_telemetry() -> dict[str, bool]:
    """FastAPI's OpenTelemetry settings for a new app: on when the process has an OpenTelemetry provider
    (e.g. under `opentelemetry-instrument`), else off. Left at its default, FastAPI looks the three
    providers up through the environment on every request to find out, which costs the router about
    a third of the HTTP stack's own CPU per request (benchmarks/router_overhead.py); here that is
    decided once."""
    from opentelemetry import _logs, metrics, trace

    providers = (trace.get_tracer_provider(), metrics.get_meter_provider(), _logs.get_logger_provider())
    if any((type(p).__module__, type(p).__name__) not in _OTEL_PLACEHOLDERS for p in providers):
        return {}
    return {"tracing": False, "metrics": False, "logs": False}


def _error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.to_json(), status_code=error.status_code, headers=error.headers)


def _header(request: Request, name: bytes) -> str:
    """The value of header `name` (lower case), or "". Starlette's `request.headers.get` answers a missing
    header by raising and catching KeyError, several µs under load on every request without it."""
    for key, value in request.scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return ""


async def _read_body(receive: Receive) -> bytes:
    """A request's whole body, as `Request.body` reads it, in a loop instead of an async generator."""
    message = await receive()
    body: bytes = message.get("body", b"")
    if message["type"] == "http.request" and not message.get("more_body", False):
        return body  # the usual case: one message
    chunks = [body]
    while message["type"] == "http.request" and message.get("more_body", False):
        message = await receive()
        chunks.append(message.get("body", b""))
    if message["type"] == "http.disconnect":
        raise ClientDisconnect()
    return b"".join(chunks)


RequestHandler = Callable[[Request], Awaitable[Response]]


class RouterApp(FastAPI):
    """The FastAPI app, with the generation routes served straight from `__call__`.

    Those routes take a `Request` and return a `Response` (they parse and answer bodies themselves), so
    Starlette's middleware stack, route matching and per-call exit stacks do nothing for them but cost
    about 90 µs of the router's CPU per request, a quarter of it (benchmarks/router_overhead.py). Here a
    POST to one of them is answered directly: the same handler, the same `Request` and `Response`
    objects, and an exception goes to the handler `exception_handler` registered for its type, as
    Starlette's stack would send it. Every other request takes the whole stack, and so does every request
    once middleware is added (`add_middleware`) or a root path set, which the direct answer would skip."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._direct_routes: dict[str, RequestHandler] = {}
        self.auth = ApiAuth()  # no keys: every request passes (create_app sets the server's)

    def add_direct_route(self, path: str, handler: RequestHandler) -> None:
        """`handler` answers POST `path` (other methods get the stack's 405)."""
        self._direct_routes[path] = handler
        self.router.add_route(path, handler, methods=["POST"])  # listed with the others, and its 405

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.auth.enabled and scope["type"] == "http":  # before any route, direct or not, reads the request
            refusal = self.auth.authorize(scope)
            if refusal is not None:
                await _error_response(refusal)(scope, receive, send)
                return
        handler = self._direct_routes.get(scope["path"]) if scope["type"] == "http" else None
        if handler is None or scope["method"] != "POST" or self.root_path or self.user_middleware:
            await super().__call__(scope, receive, send)
            return
        scope["app"] = self
        request = Request(scope, receive, send)
        try:
            request._body = await _read_body(receive)  # what request.body() returns (Starlette's own cache)
        except ClientDisconnect:
            return  # nobody to answer; nothing was started
        try:
            response = await handler(request)
        except Exception as exc:  # as ExceptionMiddleware / ServerErrorMiddleware would answer it
            response = await self._handle_exception(request, exc)
        await response(scope, receive, send)

    async def _handle_exception(self, request: Request, exc: Exception) -> Response:
        for kind in type(exc).__mro__:
            handler = self.exception_handlers.get(kind)
            if handler is not None:
                return await handler(request, exc)  # type: ignore[no-any-return]
        raise exc


class OpenAIServer(ChatEndpoint, ResponsesEndpoint):
    """Request handling shared by the routes; one per app, holding no global state."""

    def __init__(self, cluster: ClusterClient, tokenizer: Tokenizer, model_name: str, max_model_len: int,
                 metrics: ApiMetrics, clock: Callable[[], float], tool_call_parser: str = "",
                 priority_scheduling: bool = False, auth: ApiAuth | None = None,
                 responses: ResponseStore | None = None) -> None:
        self.cluster = cluster
        self.responses = responses if responses is not None else ResponseStore()
        self.auth = auth if auth is not None else ApiAuth()
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.clock = clock
        self.created_at = int(time.time())
        self.token_text = TokenText(tokenizer)
        self.vocab_size = tokenizer.vocab_size
        self.background: set[asyncio.Task[None]] = set()  # pump tasks outliving an aborted request
        # Callback calls when the cluster takes them (no task, queue or stream per call), else generate() pumps.
        self.submit = cluster.submit if isinstance(cluster, SubmittingClusterClient) else None
        self.tool_call_parser = tool_call_parser
        self.priority_scheduling = priority_scheduling  # workers order and preempt by the requests' `priority`

    # -- ingress: prompt -> token ids, sampling -> one call per sample ----------------------------------

    def _prompt_token_ids(self, prompt: str | tuple[int, ...]) -> tuple[int, ...]:
        if isinstance(prompt, str):
            return tuple(self.tokenizer.encode(prompt))
        # The protocol layer checked the types (ints, no bools). Packing them as C unsigned ints refuses a
        # negative id (or one past 2**32 - 1) in C, and numpy's max over the packed ids is several times faster
        # than max() over Python ints. An empty prompt passes here and is refused by _check_context.
        if prompt:
            try:
                packed = array("I", prompt)
                out_of_range = bool(np.frombuffer(packed, f"u{packed.itemsize}").max() >= self.vocab_size)
            except OverflowError:
                out_of_range = True
            if out_of_range:
                raise bad_request(f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
        return prompt

    def _check_sampling(self, sampling: SamplingParams) -> None:
        """The logit_bias keys are the model's token ids; and a `priority` needs priority scheduling (as vLLM)."""
        if any(token_id >= self.vocab_size for token_id, _ in sampling.logit_bias):
            raise bad_request(f"logit_bias keys must be token ids in [0, {self.vocab_size})", param="logit_bias")
        if sampling.priority and not self.priority_scheduling:
            raise bad_request(f"priority {sampling.priority} needs priority scheduling: start the server with "
                              "--scheduling-policy priority", param="priority")

    def _check_context(self, num_prompt_tokens: int, sampling: SamplingParams, param: str) -> None:
        if num_prompt_tokens == 0:
            raise bad_request("prompt is empty after tokenization", param=param)
        if num_prompt_tokens + sampling.max_tokens > self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens + sampling.max_tokens} tokens ({num_prompt_tokens} in the prompt, "
                f"{sampling.max_tokens} for the completion). Please reduce the prompt or max_tokens.",
                param=param, code="context_length_exceeded")

    def _truncated(self, prompt_ids: tuple[int, ...], truncate_prompt_tokens: int | None) -> tuple[int, ...]:
        """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: as many as the context holds)."""
        if truncate_prompt_tokens is None:
            return prompt_ids
        if truncate_prompt_tokens > self.max_model_len:
            raise bad_request(f"truncate_prompt_tokens {truncate_prompt_tokens} is more than the model's context "
                              f"length {self.max_model_len}", param="truncate_prompt_tokens")
        keep = self.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        return prompt_ids[-keep:]

    def _calls(self, api_id: str, prompts: list[tuple[int, ...]], sampling: SamplingParams, user: str,
               request: Request, arrival_at: float, cache_salt: str = "") -> list[GenerateCall]:
        """One call per sample: prompt p's sample j is choice p * n + j, as vLLM numbers a batch's choices. A
        seeded request's sample j is seeded with seed + j (as vLLM seeds them), so its n samples differ.
        The tenant (its API key's, with the client's `user` or x-tenant when trusted: `ApiAuth.tenant_of`) salts
        the prompt's block hashes, so tenants never share cached blocks; a cache salt (vLLM's `cache_salt`)
        divides a tenant's further."""
        auth = self.auth
        client_tenant = (user or _header(request, b"x-tenant")) if auth.trust_tenant_header else ""
        tenant = auth.tenant_of(request.scope, client_tenant, cache_salt)
        n = sampling.n
        per_sample = [sampling.for_sample(j) for j in range(n)]
        return [GenerateCall(f"{api_id}-{p * n + j}", prompt_token_ids, per_sample[j], arrival_at, tenant=tenant)
                for p, prompt_token_ids in enumerate(prompts) for j in range(n)]

    def _headers(self, request: Request) -> dict[str, str]:
        client_id = _header(request, b"x-request-id")
        return {"x-request-id": client_id} if client_id else {}

    async def _start(self, request: Request, calls: list[GenerateCall]) -> SampleRun:
        """Starts the samples; returns once each has produced a first delta (or raises the refusal)."""
        run = SampleRun(self.cluster, calls, self.metrics, self.clock, self.background, self.submit)
        watch = DisconnectWatch(request, run)
        try:
            await run.start()
        except BaseException:
            await run.close()
            raise
        finally:
            watch.cancel()
        return run

    def _stream_response(self, run: SampleRun, stream: AsyncIterator[str], request: Request) -> StreamingResponse:
        # The background close covers a client that left before the generator's first step (whose
        # `finally` then never runs); it runs after the response however it ended, and is idempotent.
        return StreamingResponse(stream, media_type="text/event-stream", headers=self._headers(request),
                                 background=BackgroundTask(run.close))

    async def _run_to_end(self, request: Request, calls: list[GenerateCall]) -> SampleRun:
        run = SampleRun(self.cluster, calls, self.metrics, self.clock, self.background, self.submit)
        watch = DisconnectWatch(request, run)
        try:
            await run.start()
            await run.wait_finished()
        finally:
            watch.cancel()
            await run.close()
        failed = run.first_error()
        if failed:
            raise ApiError(500, failed, type="server_error", code="generation_failed")
        return run

    # -- /v1/completions --------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        arrival_at = self.clock()
        req = parse_completion_request(parse_json_body(await request.body()), self.model_name)
        prompts = [self._truncated(self._prompt_token_ids(prompt), req.truncate_prompt_tokens)
                   for prompt in req.prompts]
        self._check_sampling(req.sampling)
        for prompt_ids in prompts:
            self._check_context(len(prompt_ids), req.sampling, "prompt")
        api_id = f"cmpl-{os.urandom(16).hex()}"  # as random as uuid4().hex, without building a UUID
        calls = self._calls(api_id, prompts, req.sampling, req.user, request, arrival_at, req.cache_salt)
        # Echo: each choice starts with its own prompt (choice i is of prompt i // n), as truncated.
        echo_texts = ([p if isinstance(p, str) and req.truncate_prompt_tokens is None else self.tokenizer.decode(ids)
                       for p, ids in zip(req.prompts, prompts)] if req.echo else [""] * len(prompts))
        num_prompt_tokens = [len(ids) for ids in prompts]
        created = int(time.time())
        if req.stream:
            run = await self._start(request, calls)
            stream = self._completion_stream(run, req, api_id, created, prompts, echo_texts)
            return self._stream_response(run, stream, request)
        run = await self._run_to_end(request, calls)
        n = req.sampling.n
        choices = [
            {
                "index": i,
                "text": echo_texts[i // n] + ("" if req.echo_only else sample.text),
                "logprobs": self._completion_logprobs(req, () if req.echo_only else sample.logprobs,
                                                      len(echo_texts[i // n]), prompts[i // n], sample.prompt_logprobs)
                if req.sampling.logprobs is not None else None,
                "finish_reason": "length" if req.echo_only else sample.finish_reason,
                **({"prompt_logprobs": prompt_logprobs_json(self.token_text, sample.prompt_logprobs,
                                                            len(prompts[i // n]))} if req.prompt_logprobs else {}),
            }
            for i, sample in enumerate(run.samples)
        ]
        body = {"id": api_id, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": choices, "system_fingerprint": None,
                "usage": run.usage(num_prompt_tokens, with_output=not req.echo_only)}
        return FastJSONResponse(body, headers=self._headers(request))

    def _completion_logprobs(self, req: CompletionRequest, logprobs: Sequence[SampledToken], offset: int,
                             prompt_ids: Sequence[int], prompt_logprobs: Sequence[SampledToken]) -> dict[str, object]:
        """A whole choice's logprobs (its completion's start `offset` chars in); with echo, the prompt's first."""
        completion = completion_logprobs_json(self.token_text, logprobs, offset)
        if not req.echo:
            return completion
        return echo_logprobs_json(self.token_text, prompt_ids, prompt_logprobs, completion)

    async def _completion_stream(self, run: SampleRun, req: CompletionRequest, api_id: str, created: int,
                                 prompts: list[tuple[int, ...]], echo_texts: list[str]) -> AsyncIterator[str]:
        num_prompt_tokens = [len(ids) for ids in prompts]
        with_output = not req.echo_only
        head = {"id": api_id, "object": "text_completion", "created": created, "model": self.model_name}
        num_chars = [0] * len(run.samples)  # text sent so far per choice, for logprobs' text_offset
        n = req.sampling.n
        try:
            async for index, delta in run.deltas():
                if delta.finish_reason == "error":
                    yield sse(ApiError(500, delta.error, type="server_error", code="generation_failed").to_json())
                    break
                echo_text = echo_texts[index // n]
                first = num_chars[index] == 0
                new_text, new_logprobs = ("", ()) if req.echo_only else (delta.new_text, delta.logprobs)
                text = (echo_text if first and echo_text else "") + new_text
                logprobs = None
                if req.sampling.logprobs is not None:
                    offset = len(text) - len(new_text) + num_chars[index]  # after the echoed prompt, if sent now
                    logprobs = completion_logprobs_json(self.token_text, new_logprobs, offset)
                    if first and req.echo:
                        logprobs = echo_logprobs_json(self.token_text, prompts[index // n], delta.prompt_logprobs,
                                                      logprobs)
                if not text and not delta.finished and not new_logprobs:
                    continue
                num_chars[index] += len(text)
                finish_reason = ("length" if req.echo_only else delta.finish_reason) if delta.finished else None
                choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
                if req.continuous_usage:
                    yield sse({**head, "choices": [choice], "usage": run.usage(num_prompt_tokens, with_output)})
                else:
                    yield sse({**head, "choices": [choice]})
            else:
                if req.include_usage:
                    yield sse({**head, "choices": [], "usage": run.usage(num_prompt_tokens, with_output)})
            yield "data: [DONE]\n\n"
        finally:
            await run.close()

    # -- the small endpoints ----------------------------------------------------------------------------

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: the token ids the router would send for a prompt, or for a chat (template applied)."""
        req = parse_tokenize_request(parse_json_body(await request.body()), self.model_name)
        ids = (self._chat_prompt_ids(req.messages, req.add_generation_prompt, req.tools, req.continue_final_message,
                                     req.template_kwargs, add_bos=req.add_special_tokens)
               if req.messages else self.tokenizer.encode(req.prompt, add_bos=req.add_special_tokens))
        token_strs = [self.tokenizer.id_to_token(t) or "" for t in ids] if req.return_token_strs else None
        return FastJSONResponse({"count": len(ids), "max_model_len": self.max_model_len, "tokens": list(ids),
                                 "token_strs": token_strs})

    async def detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: token ids back to text."""
        ids = parse_detokenize_request(parse_json_body(await request.body()), self.model_name)
        if any(t >= self.vocab_size for t in ids):
            raise bad_request(f"tokens must be token ids in [0, {self.vocab_size})", param="tokens")
        return FastJSONResponse({"prompt": self.tokenizer.decode(list(ids))})

    def models(self) -> dict[str, object]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created_at,
                                            "owned_by": "kvbaton", "max_model_len": self.max_model_len}]}

    def ready(self, request: Request) -> JSONResponse:
        """Open to anyone; why the cluster is (not) ready names workers and lost processes, so with API keys only
        an admin key sees it."""
        ready, reason = self.cluster.is_ready()
        if not self.auth.shows_cluster_state(request.scope):
            reason = "ready" if ready else "not ready"
        return JSONResponse({"ready": ready, "reason": reason}, status_code=200 if ready else 503)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        if exc.status_code in (400, 404):  # refusals and cluster failures are counted where they happen
            request.app.state.server.metrics.observe_failure("invalid_request")
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return _error_response(bad_request(str(first.get("msg", "invalid request")), param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(ApiError(exc.status_code, str(exc.detail), type=kind))

    @app.exception_handler(RecursionError)
    async def _too_deep(request: Request, exc: RecursionError) -> JSONResponse:
        # A body nested deeper than the recursion limit (orjson reads 1024 levels) trips json.dumps, the chat
        # template or a schema check wherever they render it: the client's input, not a server fault.
        request.app.state.server.metrics.observe_failure("invalid_request")
        return _error_response(bad_request("the request body is nested too deeply"))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return _error_response(ApiError(500, "internal server error", type="server_error"))


def create_app(cluster: ClusterClient, tokenizer: Tokenizer, model_name: str, *, max_model_len: int,
               metrics: ApiMetrics | None = None, clock: Callable[[], float] = time.monotonic,
               tokenizer_cache_chars: int = DEFAULT_MAX_CACHED_CHARS, tool_call_parser: str = "",
               priority_scheduling: bool = False, auth: ApiAuth | None = None,
               responses: ResponseStore | None = None) -> FastAPI:
    """The router's FastAPI app; the tokenizer is the model's (the cluster only ever sees token ids).

    `tokenizer_cache_chars` > 0 turns on the tokenizer's ingress cache (`TokenizationCache`), bounded
    by that many characters; 0 tokenizes every prompt from scratch. `tool_call_parser` ("hermes") reads the
    model's own tool calls for tool_choice "auto" (`server/tool_calls.py`). `priority_scheduling`: the workers'
    queues follow the requests' `priority` (else a non-zero one is a 400). `auth`: API keys, roles and tenants
    (`server/auth.py`); None lets every request in, its tenant the cache salt alone. `responses`: where
    /v1/responses keeps its answers for `previous_response_id` (default: `ResponseStore()`'s bounds)."""
    if tool_call_parser and tool_call_parser not in TOOL_CALL_PARSERS:
        raise InvalidRequestError(f"unknown tool call parser {tool_call_parser!r}; one of {', '.join(TOOL_CALL_PARSERS)}")
    metrics = metrics if metrics is not None else ApiMetrics()
    metrics.attach_cluster(cluster.cluster_info, model_name)
    if tokenizer_cache_chars > 0:
        cache = tokenizer.cache or tokenizer.enable_cache(tokenizer_cache_chars)
        metrics.attach_token_cache(cache.stats)
    server = OpenAIServer(cluster, tokenizer, model_name, max_model_len, metrics, clock, tool_call_parser,
                          priority_scheduling, auth, responses)
    app = RouterApp(title="kvbaton", docs_url=None, redoc_url=None, openapi_url=None, telemetry=fastapi_telemetry())
    app.auth = server.auth
    app.state.server = server
    _install_error_handlers(app)

    # The generation routes take the request and parse it themselves (protocol.py): as plain Starlette routes
    # they skip FastAPI's per-call dependency solving and exit stacks, a sizeable part of the router's CPU per
    # request; the app's middleware and error handlers apply to them unchanged.
    app.add_direct_route("/v1/completions", server.completions)
    app.add_direct_route("/v1/chat/completions", server.chat_completions)
    app.add_direct_route("/v1/responses", server.responses_create)
    app.add_api_route("/v1/responses/{response_id}", server.responses_retrieve, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", server.responses_delete, methods=["DELETE"])
    app.add_direct_route("/tokenize", server.tokenize)
    app.add_direct_route("/detokenize", server.detokenize)
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/ready", server.ready, methods=["GET"])

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/cluster")
    async def cluster_info() -> JSONResponse:
        return JSONResponse(cluster.cluster_info())

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> JSONResponse:  # vLLM's: later prompts find nothing cached
        return JSONResponse({"workers": cluster.reset_prefix_cache()})

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/dashboard")
    async def dashboard() -> HTMLResponse:  # the page only (server/dashboard.py); its data is an admin route
        return HTMLResponse(DASHBOARD_HTML)

    @app.get("/dashboard/data")
    async def dashboard_json() -> JSONResponse:
        return JSONResponse(dashboard_data(cluster.cluster_info(), metrics.recent.summary(clock()), model_name))

    document = openapi_document(model_name, max_model_len, with_keys=server.auth.enabled,
                                metrics_open="/metrics" in server.auth.open_paths)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> JSONResponse:  # the request bodies as protocol.py reads them (server/openapi.py)
        return JSONResponse(document)

    return app
