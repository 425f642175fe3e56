"""Live load generator: sends a workload to an OpenAI-compatible server on schedule and records each request.

Open loop: request i is sent at its `arrival_s` after the start whatever the server is doing, as
`POST {url}/v1/completions` with the prompt as a token-id list, a fixed output length
(`max_tokens` = `min_tokens`, `ignore_eos`), temperature 0 and streaming with usage. The record keeps
one arrival time per output token, as the simulator's do: a chunk may carry several tokens (a step's
accepted speculative drafts, or tokens whose text the server held back), so the driver asks for vLLM's
`continuous_usage_stats` and gives each chunk's new tokens (the growth of its cumulative
`completion_tokens`) that chunk's time. A server that sends no per-chunk usage gets one token per chunk
with text, and the final usage's extra tokens spread over the chunks by their text length (an
estimate). The final usage chunk gives `completion_tokens` and `prompt_tokens_details.cached_tokens`. HTTP 429/503 become `rejected` records, other errors and
timeouts `failed`, each with the server's reason.

A server may add an optional object `"kvbaton": {"worker_ids": [...], "queue_s": s,
"transfer_bytes": n}` to any chunk; the driver copies it into the record. Times are
`time.perf_counter()` seconds since the run started: this is the live executor, so it reads the
wall clock (policy code never does).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvbaton.bench.records import RequestRecord
from kvbaton.bench.workloads.base import WorkloadRequest

REJECT_STATUS_CODES = (429, 503)


@dataclass(frozen=True, slots=True)
class DriverConfig:
    url: str  # server base URL, e.g. http://127.0.0.1:8000
    model: str  # the "model" field of every request
    timeout_s: float = 300.0  # per request, send to last byte; a timed-out request is "failed"
    ignore_eos: bool = True  # ask for exactly output_tokens tokens (vLLM/SGLang extension fields)
    api_key: str = field(default="", repr=False)  # sent as a Bearer token when given


def bearer(api_key: str) -> dict[str, str]:
    """The Authorization header of an API key ("" sends none)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


@dataclass(slots=True)
class _StreamState:
    token_times_s: list[float]
    usage: dict[str, Any] | None = None
    extension: dict[str, Any] | None = None
    error: str = ""
    exact: bool = False  # the server sends cumulative usage with every chunk: token_times_s is one per token
    text_lengths: list[int] | None = None  # without it: the text length of each chunk counted as one token

    def times_per_token(self, num_tokens: int) -> tuple[float, ...]:
        """One time per output token: the recorded ones, or with per-chunk usage missing, the `num_tokens` the
        final usage counts spread over the chunks in proportion to their text (largest remainders first)."""
        times = self.token_times_s
        if self.exact or num_tokens <= len(times) or not times or self.text_lengths is None:
            return tuple(times)
        lengths = [max(n, 1) for n in self.text_lengths]
        total = sum(lengths)
        shares = [num_tokens * n / total for n in lengths]
        counts = [max(1, int(share)) for share in shares]
        by_remainder = sorted(range(len(times)), key=lambda i: counts[i] - shares[i])
        for i in by_remainder[: max(num_tokens - sum(counts), 0)]:
            counts[i] += 1
        return tuple(t for t, count in zip(times, counts) for _ in range(count))


def request_body(request: WorkloadRequest, config: DriverConfig) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": config.model,
        "prompt": request.prompt_array.tolist(),
        "max_tokens": request.output_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if config.ignore_eos:
        body["min_tokens"] = request.output_tokens
        body["ignore_eos"] = True
    if request.tenant:
        body["user"] = request.tenant
    return body


def _error_reason(status_code: int, text: str) -> str:
    try:
        payload = json.loads(text)
        error = payload.get("error", payload)
        message = error.get("message") if isinstance(error, dict) else error
        message = message if message else payload.get("detail", text)
    except (json.JSONDecodeError, AttributeError):
        message = text
    return f"HTTP {status_code}: {str(message).strip()[:300]}"


def _on_event(data: str, now_s: float, state: _StreamState) -> None:
    chunk = json.loads(data)
    if "error" in chunk:
        error = chunk["error"]
        state.error = str(error.get("message", error) if isinstance(error, dict) else error)
        return
    choices = chunk.get("choices") or ()
    usage = chunk.get("usage")
    if choices and usage and isinstance(usage.get("completion_tokens"), int):
        state.exact = True  # cumulative usage per chunk: its growth is this chunk's tokens
        state.token_times_s.extend([now_s] * (usage["completion_tokens"] - len(state.token_times_s)))
    else:
        for choice in choices:
            if choice.get("text") or choice.get("finish_reason") is None:
                state.token_times_s.append(now_s)
                if state.text_lengths is None:
                    state.text_lengths = []
                state.text_lengths.append(len(choice.get("text") or ""))
    if usage:
        state.usage = usage
    if isinstance(chunk.get("kvbaton"), dict):
        state.extension = chunk["kvbaton"]


async def _send(client: httpx.AsyncClient, request: WorkloadRequest, config: DriverConfig,
                clock: Callable[[], float]) -> RequestRecord:
    base = dict(request_id=request.request_id, slo_class=request.slo_class, tenant=request.tenant,
                prompt_tokens=request.num_prompt_tokens)
    body = request_body(request, config)
    headers = {"X-Request-Id": request.request_id, "X-Kvbaton-Slo-Class": request.slo_class, **bearer(config.api_key)}
    state = _StreamState(token_times_s=[])
    sent_s = clock()
    try:
        async with asyncio.timeout(config.timeout_s):
            async with client.stream("POST", f"{config.url.rstrip('/')}/v1/completions", json=body,
                                     headers=headers) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    status = "rejected" if response.status_code in REJECT_STATUS_CODES else "failed"
                    return RequestRecord(arrival_s=sent_s, status=status,
                                         reason=_error_reason(response.status_code, text), finish_s=clock(), **base)
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    _on_event(data, clock(), state)
    except TimeoutError:
        return RequestRecord(arrival_s=sent_s, status="failed", reason=f"timeout after {config.timeout_s:g} s",
                             finish_s=clock(), output_tokens=len(state.token_times_s), **base)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return RequestRecord(arrival_s=sent_s, status="failed", reason=f"{type(exc).__name__}: {exc}"[:300],
                             finish_s=clock(), **base)
    finish_s = clock()
    usage = state.usage or {}
    details = usage.get("prompt_tokens_details") or {}
    ext = state.extension or {}
    times = state.times_per_token(int(usage.get("completion_tokens", 0)))
    if state.error or not times:
        reason = state.error or "stream ended without tokens"
        return RequestRecord(arrival_s=sent_s, status="failed", reason=reason, finish_s=finish_s,
                             output_tokens=len(times), **base)
    return RequestRecord(
        arrival_s=sent_s, status="completed", output_tokens=int(usage.get("completion_tokens", len(times))),
        cached_tokens=details.get("cached_tokens"), first_token_s=times[0], token_times_s=times, finish_s=finish_s,
        queue_s=ext.get("queue_s"), worker_ids=tuple(str(w) for w in ext.get("worker_ids", ())),
        transfer_bytes=int(ext.get("transfer_bytes", 0)),
        **{**base, "prompt_tokens": int(usage.get("prompt_tokens", request.num_prompt_tokens))})


async def drive(requests: Sequence[WorkloadRequest], config: DriverConfig,
                on_done: Callable[[RequestRecord], None] | None = None) -> list[RequestRecord]:
    """Sends every request at its arrival time (open loop); returns records in request order."""
    origin = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - origin

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(config.timeout_s), limits=limits) as client:

        async def one(request: WorkloadRequest) -> RequestRecord:
            delay_s = request.arrival_s - clock()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            record = await _send(client, request, config, clock)
            if on_done is not None:
                on_done(record)
            return record

        return list(await asyncio.gather(*(one(r) for r in requests)))


def run_live(requests: Sequence[WorkloadRequest], config: DriverConfig, progress: bool = False) -> list[RequestRecord]:
    """Blocking wrapper around `drive`, with a rich progress bar when `progress`."""
    if not progress:
        return asyncio.run(drive(requests, config))
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("bench"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  transient=True) as bar:
        task = bar.add_task("requests", total=len(requests))
        return asyncio.run(drive(requests, config, on_done=lambda _: bar.advance(task)))


def discover_model(url: str, timeout_s: float = 10.0, api_key: str = "") -> str:
    """The first model id the server lists at GET /v1/models."""
    response = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=timeout_s, headers=bearer(api_key))
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])
