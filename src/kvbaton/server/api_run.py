"""The `n` samples of one API request running on the cluster, merged into one delta stream, and aborted when
nobody is left to read them.

Each sample's deltas are recorded (the sample's state and metrics) as they arrive and appended to the
run's merged stream — so the final abort delta of a request whose client left is still counted, even
though no handler reads it any more. A cluster that takes callbacks (`SubmittingClusterClient`, the
live `ClusterManager`) delivers them straight from its socket reader: no task or queue per call.
Otherwise each sample has a pump task draining its `cluster.generate()` stream, held in the app's
`background` set until the stream ends, which the `ClusterClient` contract bounds (every call ends
with one finished delta).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import anyio
from fastapi import Request

from kvbaton.core.step import SampledToken
from kvbaton.core.errors import InvalidRequestError
from kvbaton.server.base import ClusterClient, DeltaSink, GenerateCall, RejectedError, TokenDelta
from kvbaton.server.metrics import ApiMetrics
from kvbaton.server.protocol import ApiError
from kvbaton.server.protocol_responses import usage_json

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.05  # how often a waiting handler checks whether its client is still there
Submit = Callable[[GenerateCall, DeltaSink], None]  # SubmittingClusterClient.submit


@dataclass(slots=True)
class SampleState:
    call: GenerateCall
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # the output's, as generated (a stored response keeps them)
    num_output_tokens: int = 0
    logprobs: list[SampledToken] = field(default_factory=list)
    prompt_logprobs: tuple[SampledToken, ...] = ()  # with prompt_logprobs (or echo and logprobs): from its first delta
    num_cached_tokens: int = 0
    finish_reason: str | None = None  # set by the finished delta; None while running
    error: str = ""
    last_token_at: float | None = None  # clock() when the latest tokens arrived; None before the first
    queue_observed: bool = False  # its worker's queue time went to the metrics

    @property
    def text(self) -> str:
        return "".join(self.texts)


def _refusal(exc: BaseException) -> ApiError:
    if isinstance(exc, RejectedError):
        retry_after = str(max(1, math.ceil(exc.retry_after_s)))
        kind = "rate_limit_exceeded" if exc.status_code == 429 else "service_unavailable"
        return ApiError(exc.status_code, str(exc), type=kind, code=kind, headers={"Retry-After": retry_after})
    if isinstance(exc, InvalidRequestError):
        return ApiError(400, str(exc))
    logger.error("cluster failed to start a call", exc_info=exc)
    return ApiError(500, "internal server error: the cluster failed to start the request", type="server_error")


class SampleRun:
    def __init__(self, cluster: ClusterClient, calls: list[GenerateCall], metrics: ApiMetrics,
                 clock: Callable[[], float], background: set[asyncio.Task[None]], submit: Submit | None = None) -> None:
        """`submit`: the cluster's `SubmittingClusterClient.submit`, if it has one (else pump tasks)."""
        self._cluster = cluster
        self._submit = submit
        self._metrics = metrics
        self._clock = clock
        self._background = background
        self.samples = [SampleState(call) for call in calls]
        # The merged stream: (sample index, delta or the exception that ended its stream), in arrival order.
        self._items: deque[tuple[int, TokenDelta | BaseException]] = deque()
        self._waiter: asyncio.Future[None] | None = None  # the reader waiting for the next item, if any
        self._aborted: set[int] = set()
        self._num_unyielded_finishes = len(calls)

    # -- producers (record state and metrics whether or not anyone reads) --------------------------------

    def _push(self, index: int, item: TokenDelta | BaseException) -> None:
        self._items.append((index, item))
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def _wait(self, num_seen: int = 0) -> None:
        """Until the merged stream holds more than `num_seen` items (returns at once if it does). A reader that
        looks at items without taking them (`start`) passes how many it has looked at: waiting only for a
        non-empty stream would return at once without yielding, and its loop would spin, holding the event
        loop, while another sample's first delta is still to come."""
        if len(self._items) <= num_seen:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter

    def _on_delta(self, index: int, delta: TokenDelta) -> None:
        """The cluster's sink for sample `index` (callback mode)."""
        self._take(index, delta)

    def _take(self, index: int, delta: TokenDelta) -> None:
        if delta.finish_reason == "rejected":  # refused after the cluster took it, before its first token
            self._push(index, RejectedError(delta.error, 429, delta.extra.get("retry_after_s", 1.0)))
            return
        self._record(index, delta)
        self._push(index, delta)

    async def _pump(self, index: int) -> None:
        call = self.samples[index].call
        try:
            async for delta in self._cluster.generate(call):
                self._take(index, delta)
                if delta.finished:
                    return
            raise RuntimeError(f"the cluster ended call {call.request_id} without a finished delta")
        except Exception as exc:  # handed to the reader, which turns it into an error or a refusal
            self._push(index, exc)

    def _record(self, index: int, delta: TokenDelta) -> None:
        sample = self.samples[index]
        now = self._clock()
        worker_id = delta.worker_id
        if delta.new_token_ids:
            if sample.last_token_at is None:
                self._metrics.observe_first_token(len(delta.new_token_ids), now - sample.call.arrival_at, worker_id)
            else:
                self._metrics.observe_tokens(len(delta.new_token_ids), now - sample.last_token_at, worker_id)
            sample.last_token_at = now
        queue_s = delta.extra.get("queue_s") if delta.extra else None
        if queue_s is not None and not sample.queue_observed and worker_id:
            sample.queue_observed = True  # the first worker's wait (a decode worker adopting it reports its own)
            self._metrics.observe_queue(queue_s, worker_id)
        sample.texts.append(delta.new_text)
        sample.num_output_tokens += len(delta.new_token_ids)
        sample.token_ids.extend(delta.new_token_ids)
        sample.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs:
            sample.prompt_logprobs = delta.prompt_logprobs
        sample.num_cached_tokens = max(sample.num_cached_tokens, delta.num_cached_tokens)
        if delta.finished:
            sample.finish_reason = delta.finish_reason or "stop"
            sample.error = delta.error
            self._metrics.observe_finished(sample.finish_reason, now - sample.call.arrival_at,
                                           len(sample.call.prompt_token_ids), sample.num_cached_tokens, worker_id)

    def _fail(self, index: int, exc: BaseException) -> TokenDelta:
        """A stream that broke after it started: the sample ends as an error (logged, not shown verbatim)."""
        logger.error("stream of %s failed", self.samples[index].call.request_id, exc_info=exc)
        delta = TokenDelta(self.samples[index].call.request_id, (), "", True, "error",
                           error="internal server error: the cluster stream failed")
        self._record(index, delta)
        return delta

    # -- the reader's side ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Launches every sample and waits for each one's first delta; a refusal aborts the rest and raises."""
        if self._submit is not None:
            for index, sample in enumerate(self.samples):
                try:
                    self._submit(sample.call, partial(self._on_delta, index))
                except Exception as exc:  # a refusal: read below like a pump's
                    self._push(index, exc)
        else:
            for index in range(len(self.samples)):
                task = asyncio.create_task(self._pump(index))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
        started: set[int] = set()
        num_read = 0  # items looked at; they stay in the stream for deltas()
        while len(started) < len(self.samples):
            while num_read >= len(self._items):
                await self._wait(num_read)
            index, item = self._items[num_read]
            num_read += 1
            if isinstance(item, BaseException) and index not in started:
                self._aborted.add(index)  # the cluster never took it
                await self.close()
                if not isinstance(item, InvalidRequestError):  # a 400 is counted by the app's error handler
                    self._metrics.observe_failure("rejected" if isinstance(item, RejectedError) else "error")
                raise _refusal(item)
            started.add(index)

    async def _next(self) -> tuple[int, TokenDelta]:
        while not self._items:
            await self._wait()
        index, item = self._items.popleft()
        delta = self._fail(index, item) if isinstance(item, BaseException) else item
        if delta.finished:
            self._num_unyielded_finishes -= 1
        return index, delta

    async def deltas(self) -> AsyncIterator[tuple[int, TokenDelta]]:
        """(sample index, delta) in arrival order until every sample has finished."""
        while self._num_unyielded_finishes:
            yield await self._next()

    async def wait_finished(self) -> None:
        """Reads the stream to its end, as iterating `deltas()` would (for a caller that only wants the samples)."""
        while self._num_unyielded_finishes:
            await self._next()

    async def abort_unfinished(self) -> None:
        """Idempotent: asks the cluster to abort every sample that has not finished yet."""
        for index, sample in enumerate(self.samples):
            if sample.finish_reason is None and index not in self._aborted:
                self._aborted.add(index)
                await self._cluster.abort(sample.call.request_id)

    async def close(self) -> None:
        """Aborts what is still running; shielded so a cancelled handler (client gone) still gets it out."""
        if all(s.finish_reason is not None or i in self._aborted for i, s in enumerate(self.samples)):
            return  # nothing to abort (the usual end): no cancel scope to enter
        with anyio.CancelScope(shield=True):
            await self.abort_unfinished()

    def first_error(self) -> str:
        return next((s.error or "generation failed" for s in self.samples if s.finish_reason == "error"), "")

    def usage(self, num_prompt_tokens: Sequence[int], with_output: bool = True) -> dict[str, object]:
        """`num_prompt_tokens` of each prompt, whose samples follow one another (n each): a prompt counts once
        for all its n samples (as OpenAI does), its cached tokens as the best hit of any of them; a batch sums.
        `with_output` False: the answer leaves the samples' output out (echo with max_tokens 0), and so does this."""
        n = len(self.samples) // len(num_prompt_tokens)
        cached = sum(max((s.num_cached_tokens for s in self.samples[p * n:(p + 1) * n]), default=0)
                     for p in range(len(num_prompt_tokens)))
        num_output_tokens = sum(s.num_output_tokens for s in self.samples) if with_output else 0
        return usage_json(sum(num_prompt_tokens), num_output_tokens, cached)


class DisconnectWatch:
    """Beside a handler that is not streaming yet: aborts the run once the client has gone; `cancel` when done.

    The first look is one poll period after the start, from a timer: a call answered sooner costs one timer
    and no task; a longer one gets a polling task then."""

    def __init__(self, request: Request, run: SampleRun) -> None:
        self._request = request
        self._run = run
        self._task: asyncio.Task[None] | None = None
        self._timer = asyncio.get_running_loop().call_later(DISCONNECT_POLL_S, self._start_polling)

    def _start_polling(self) -> None:
        self._task = asyncio.create_task(self._poll())

    async def _poll(self) -> None:
        while not await self._request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)
        await self._run.abort_unfinished()

    def cancel(self) -> None:
        self._timer.cancel()
        if self._task is not None:
            self._task.cancel()
