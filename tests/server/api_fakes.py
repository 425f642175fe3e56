"""Test doubles for the HTTP layer: a `ClusterClient` that "generates" deterministic tokens, and a uvicorn
server on 127.0.0.1 in a thread.

The fake cluster replies with the bytes of REPLY (the tiny-random tokenizer is byte-level: one token per
byte), starting at an offset taken from the seed; it reports a prefix-cache hit equal to the longest
block-aligned prefix shared with any earlier prompt of the same tenant, applies stop strings like the
engine (the matched string is not returned), and ends every call with exactly one finished delta.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI

from kvbaton.core.step import SampledToken
from kvbaton.server.base import GenerateCall, TokenDelta

REPLY = "Hello from kvbaton, the friendly fake cluster. "


class FakeCluster:
    def __init__(self, tokenizer: object, *, block_size: int = 16, token_delay_s: float = 0.0) -> None:
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.token_delay_s = token_delay_s
        self.num_resets = 0
        self.reply_ids: list[int] = tokenizer.encode(REPLY)  # type: ignore[attr-defined]
        self.calls: list[GenerateCall] = []
        self.aborted: list[str] = []
        self.finished: dict[str, str] = {}  # request id -> finish reason, as the cluster ended it
        self.reject: BaseException | None = None  # raised by generate() before the first delta
        self.reject_from_call = 0  # `reject` applies once this many calls were accepted
        self.fail_after_tokens: int | None = None  # end with finish_reason "error" after this many tokens
        self.ready: tuple[bool, str] = (True, "1 fake worker live")
        self._abort_events: dict[str, asyncio.Event] = {}
        self._seen_prompts: list[tuple[str, tuple[int, ...]]] = []

    @property
    def active(self) -> set[str]:
        return {c.request_id for c in self.calls} - set(self.finished)

    def _num_cached_tokens(self, call: GenerateCall) -> int:
        best = 0
        for tenant, prompt in self._seen_prompts:
            if tenant != call.tenant:
                continue
            shared = 0
            for a, b in zip(prompt, call.prompt_token_ids):
                if a != b:
                    break
                shared += 1
            best = max(best, shared)
        # Block-aligned, and the last prompt token is always recomputed (as the engine does).
        return min(best, len(call.prompt_token_ids) - 1) // self.block_size * self.block_size

    def generate(self, call: GenerateCall) -> AsyncIterator[TokenDelta]:
        return self._generate(call)

    async def _generate(self, call: GenerateCall) -> AsyncIterator[TokenDelta]:
        if self.reject is not None and len(self.calls) >= self.reject_from_call:
            raise self.reject
        self.calls.append(call)
        aborted = self._abort_events.setdefault(call.request_id, asyncio.Event())
        num_cached = self._num_cached_tokens(call)
        self._seen_prompts.append((call.tenant, call.prompt_token_ids))
        params = call.sampling
        offset = params.seed or 0
        text = ""
        num_emitted_chars = 0
        for i in range(params.max_tokens):
            if self.token_delay_s:
                try:
                    await asyncio.wait_for(aborted.wait(), self.token_delay_s)
                except TimeoutError:
                    pass
            else:
                await asyncio.sleep(0)
            if aborted.is_set():
                yield self._end(call, "abort", num_cached)
                return
            if self.fail_after_tokens is not None and i >= self.fail_after_tokens:
                yield self._end(call, "error", num_cached, error="worker fake-0 died (exit code -9)")
                return
            token_id = self.reply_ids[(offset + i) % len(self.reply_ids)]
            text += self.tokenizer.decode([token_id])  # type: ignore[attr-defined]
            stopped = next((s for s in params.stop if s in text), None)
            finished = stopped is not None or i == params.max_tokens - 1
            if stopped is not None:
                text = text[: text.index(stopped)]
            # Like the engine: text that could still grow into a stop string is held back until it cannot.
            hold_chars = 0 if finished else max((len(s) - 1 for s in params.stop), default=0)
            visible_chars = max(len(text) - hold_chars, num_emitted_chars)
            new_text, num_emitted_chars = text[num_emitted_chars:visible_chars], visible_chars
            logprobs = ()
            if params.logprobs is not None:
                logprob = -0.25 * (i % 4 + 1)
                others = [(t, logprob - 1.0 - k) for k, t in enumerate(self.reply_ids[:8]) if t != token_id]
                top = ((token_id, logprob), *others)[: params.logprobs]
                logprobs = (SampledToken(token_id, logprob, top),)
            reason = ("stop" if stopped is not None else "length") if finished else None
            if finished:
                self.finished[call.request_id] = reason  # type: ignore[assignment]
            # Prompt logprobs, as a worker sends them with the first token: prompt token p gets -p / 10, rank 1.
            prompt_logprobs = tuple(SampledToken(t, -p / 10, ((t, -p / 10),) if params.prompt_logprobs else (), 1)
                                    for p, t in enumerate(call.prompt_token_ids[1:], start=1)) \
                if i == 0 and params.prompt_logprobs is not None else ()
            yield TokenDelta(call.request_id, (token_id,), new_text, finished, reason,
                             num_prompt_tokens=len(call.prompt_token_ids), num_cached_tokens=num_cached,
                             logprobs=logprobs, worker_id="fake-0", prompt_logprobs=prompt_logprobs)
            if finished:
                return

    def _end(self, call: GenerateCall, reason: str, num_cached: int, error: str = "") -> TokenDelta:
        self.finished[call.request_id] = reason
        return TokenDelta(call.request_id, (), "", True, reason, num_prompt_tokens=len(call.prompt_token_ids),
                          num_cached_tokens=num_cached, error=error, worker_id="fake-0")

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self._abort_events.setdefault(request_id, asyncio.Event()).set()

    def is_ready(self) -> tuple[bool, str]:
        return self.ready

    def cluster_info(self) -> dict[str, object]:
        return {
            "policy": "fake",
            "workers": [{"worker_id": "fake-0", "role": "mixed", "num_running": len(self.active),
                         "num_waiting": 1, "num_used_blocks": 3, "num_free_blocks": 9, "num_blocks": 12}],
            "router_decisions": {"exploit": 2, "explore": 1},
        }

    def reset_prefix_cache(self) -> list[str]:
        self.num_resets += 1
        return ["fake-0"]


class ThreadedServer:
    """uvicorn serving `app` on an ephemeral 127.0.0.1 port from a daemon thread; `stop()` joins it."""

    def __init__(self, app: FastAPI) -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        self.port: int = self._socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    def start(self) -> ThreadedServer:
        self._thread.start()
        deadline = time.monotonic() + 10.0
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10.0)
        self._socket.close()
        if self._thread.is_alive():
            raise RuntimeError("uvicorn did not stop")

