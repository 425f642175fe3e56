"""The local iteration scheduler: which tokens of which requests one engine step computes.

Each `schedule(now)` builds a `StepPlan` under the token budget and `max_num_seqs`:
  1. running decodes (one token each), in running order;
  2. running requests still prefilling, continuing their chunks;
  3. waiting requests in the queue policy's order (chunked prefill, stall-free: the last one
     admitted may get a partial chunk that fills the budget) — skipped in a step that preempted.
`update(plan, result, now)` advances `num_computed_tokens`, appends sampled tokens, caches newly
full blocks and applies stop conditions. No clock and no RNG: `now` is passed in, ties break
by running/arrival order, so the same inputs give the same plans and block ids.

Preemption is by recompute: when a running request cannot get a block (after evicting from the
prefix cache), the most recently admitted running request gives all its blocks back and goes to
the front of the waiting queue, keeping its output tokens to recompute them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvbaton.cache.block_pool import BlockPool
from kvbaton.cache.hashing import CacheKey, HashedBlocks
from kvbaton.cache.radix_cache import RadixCache
from kvbaton.core.config import SchedulerConfig
from kvbaton.core.errors import CapacityError, InvalidRequestError
from kvbaton.core.request import FinishReason, Request, RequestStatus
from kvbaton.core.step import SampledToken, ScheduledChunk, StepPlan, StepResult
from kvbaton.scheduler.block_manager import BlockManager
from kvbaton.scheduler.fast_values import make_chunk, make_plan
from kvbaton.scheduler.queue_policies import create_queue_policy


class TokenOutput(NamedTuple):
    """One sampled token of one request. A NamedTuple, not a frozen dataclass: `update` builds one per
    request per step (the simulator's hot path), and a tuple subclass can be built in C (`_new_output`)."""

    request_id: str
    token: SampledToken
    finish_reason: FinishReason | None  # set on the request's last token


# TokenOutput(a, b, c) runs the NamedTuple's Python-level __new__; tuple.__new__(TokenOutput, (a, b, c)) builds the
# same instance in C (the hot loops of `update` and `update_decodes` build one per sampled token).
_new_output = tuple.__new__


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_waiting: int
    num_running: int
    num_queued_prefill_tokens: int  # uncomputed tokens of waiting requests and of running ones still prefilling
    num_used_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    prefix_cache_queries_tokens: int  # tokens looked up at admissions (with a cache attached)
    prefix_cache_hits_tokens: int  # of which the cache supplied
    num_preemptions: int
    num_steps: int  # plans with at least one chunk


class _StepBuilder:
    """The plan under construction; chunks keyed by request id so a preemption can withdraw one.

    Insertion order is plan order: decodes, then running prefills, then admissions.
    """

    __slots__ = ("budget_tokens", "num_tokens", "chunks", "preempted_ids", "finished_ids")

    def __init__(self, budget_tokens: int) -> None:
        self.budget_tokens = budget_tokens
        self.num_tokens = 0  # always the sum of the chunks' lengths
        self.chunks: dict[str, ScheduledChunk] = {}
        self.preempted_ids: list[str] = []
        self.finished_ids: list[str] = []

    @property
    def budget_left_tokens(self) -> int:
        return self.budget_tokens - self.num_tokens

    def add(self, chunk: ScheduledChunk) -> None:
        self.chunks[chunk.request_id] = chunk
        self.num_tokens += chunk.num_tokens

    def withdraw(self, request_id: str) -> None:
        chunk = self.chunks.pop(request_id, None)
        if chunk is not None:
            self.num_tokens -= chunk.num_tokens


def _token_slice(request: Request, start: int, end: int) -> tuple[int, ...]:
    """request.all_token_ids[start:end] without copying the whole sequence (decodes are 1 token)."""
    n = request.num_prompt_tokens
    if end <= n:
        return tuple(request.prompt_token_ids[start:end])
    if start >= n:
        return tuple(request.output_token_ids[start - n : end - n])
    return tuple(request.prompt_token_ids[start:]) + tuple(request.output_token_ids[: end - n])


class LocalScheduler:
    """Iteration-level scheduler of one worker (see the module docstring for the step rules)."""

    def __init__(
        self,
        config: SchedulerConfig,
        block_size: int,
        pool: BlockPool,
        cache: RadixCache | None,
        cache_key: CacheKey,
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.blocks = BlockManager(pool, cache, cache_key, block_size)
        self.policy = create_queue_policy(config.queue_policy, lpm_fallback_waiting=config.lpm_fallback_waiting)
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._waiting: deque[Request] = deque()  # FCFS: preempted at the front, then arrival order
        self._running: list[Request] = []  # admission order; the tail is the preemption victim
        self._finished: list[Request] = []  # finished since the last take_finished()
        # Per running request: (its block_ids list, that list as a tuple). Tables only grow in place by
        # `extend` or are replaced by a new list (BlockManager, admit_prefilled), never edited in place, so
        # the tuple is current while the list is the same object of the same length; a decode then reuses
        # it instead of copying a ~100-block table every step.
        self._tables: dict[str, tuple[list[int], tuple[int, ...]]] = {}
        self._step_id = 0
        self._num_steps = 0
        self.steady_fast_path = True  # False forces the general path (tests compare the two)
        # Σ (start_pos + 1) over the last plan's chunks when it came from the steady-decode path (every
        # chunk a one-token decode past position 0, i.e. a decode by `BatchShape.of_plan`'s rule), else -1:
        # lets an executor price the batch (`CostModel.decode_s`) without reading the plan again.
        self.steady_plan_context_tokens = -1
        self._num_preemptions = 0
        self._queries_tokens = 0
        self._hits_tokens = 0

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request, prompt_blocks: HashedBlocks | None = None) -> None:
        """Queue a new request. `prompt_blocks`: its prompt already split and hashed under this worker's
        cache key (`hash_prompt`, e.g. by the simulator, which hashed it to route it); saves doing it again."""
        if request.request_id in self._requests:
            raise InvalidRequestError(f"duplicate request id {request.request_id!r}")
        if request.num_prompt_tokens == 0:
            raise InvalidRequestError("the prompt is empty")
        if request.num_prompt_tokens >= request.max_model_len:
            raise InvalidRequestError(
                f"prompt has {request.num_prompt_tokens} tokens; the context holds {request.max_model_len}"
                " including at least one output token"
            )
        num_blocks = self.blocks.num_blocks_for(request.num_prompt_tokens)
        if num_blocks > self.blocks.pool.num_blocks:
            raise CapacityError(
                f"prompt needs {num_blocks} KV blocks; this worker has {self.blocks.pool.num_blocks}"
            )
        request.status = RequestStatus.WAITING
        self._requests[request.request_id] = request
        self._waiting.append(request)
        if prompt_blocks is not None:
            self.blocks.seed(request, prompt_blocks)

    def admit_prefilled(self, request: Request, num_computed_tokens: int, now: float,
                        block_ids: Sequence[int] | None = None) -> bool:
        """Admit a request whose first `num_computed_tokens` tokens' KV was computed elsewhere (a handoff).

        The decode side of disaggregation: `request` carries its prompt and the first token the
        prefill worker sampled. Blocks for the computed positions are allocated now (the KV is
        written into them by the transfer) and the request runs at once, decoding from its last
        token. Returns False, changing nothing, when the pool or `max_num_seqs` cannot take it
        (the caller retries later: backpressure). If it is preempted later it recomputes locally.

        With `block_ids` the request adopts blocks the caller already holds (a handoff destination's
        reservation, KV written in place): one pool reference each passes to the request on success;
        on False the caller still owns them.
        """
        if request.request_id in self._requests:
            raise InvalidRequestError(f"duplicate request id {request.request_id!r}")
        if not 0 < num_computed_tokens < request.num_tokens:
            raise InvalidRequestError(
                f"a handed-off request needs 0 < computed ({num_computed_tokens}) < tokens ({request.num_tokens})"
            )
        if request.block_ids or request.num_computed_tokens:
            raise InvalidRequestError(f"{request.request_id}: a handed-off request must arrive holding no blocks")
        if len(self._running) >= self.config.max_num_seqs:
            return False
        if block_ids is not None:
            if len(block_ids) != self.blocks.num_blocks_for(num_computed_tokens):
                raise InvalidRequestError(f"{request.request_id}: {len(block_ids)} adopted blocks for "
                                          f"{num_computed_tokens} tokens")
            request.block_ids = list(block_ids)
        elif not self.blocks.try_grow(request, num_computed_tokens):
            return False
        request.num_computed_tokens = num_computed_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = 0
        if request.first_scheduled_at is None:
            request.first_scheduled_at = now
        request.status = RequestStatus.RUNNING
        self._requests[request.request_id] = request
        self._running.append(request)
        return True

    def abort_request(self, request_id: str, now: float) -> Request | None:
        """Cancel a request in any state, freeing its blocks at once; idempotent."""
        return self.finish_request(request_id, FinishReason.ABORT, now)

    def finish_request(self, request_id: str, reason: FinishReason, now: float, message: str = "") -> Request | None:
        """End a request for a reason found outside the scheduler (stop string, abort); None if not live."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
        else:
            self._waiting.remove(request)
        self._finish(request, reason, now, message)
        return request

    def take_finished(self) -> list[Request]:
        finished, self._finished = self._finished, []
        return finished

    def get_request(self, request_id: str) -> Request | None:
        """A waiting or running request; None once it has finished."""
        return self._requests.get(request_id)

    def waiting_request_ids(self) -> list[str]:
        """The waiting queue in FCFS order (preempted first), before any policy reordering."""
        return [r.request_id for r in self._waiting]

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # ---- one step ----------------------------------------------------------------------------

    def schedule(self, now: float) -> StepPlan:
        self._step_id += 1
        self.steady_plan_context_tokens = -1
        if self.steady_fast_path and not self._waiting and self._running:
            plan = self._plan_steady_decodes()
            if plan is not None:
                self._num_steps += 1
                return plan
        step = _StepBuilder(self.config.max_num_batched_tokens)
        if self._running:
            self._schedule_running_requests(step, now)
        if self._waiting and not step.preempted_ids:  # memory is tight: admitting now would only preempt again
            self._admit_waiting(step, now)
        chunks = tuple(step.chunks.values())
        if chunks:
            self._num_steps += 1
        return make_plan(self._step_id, chunks, step.num_tokens, tuple(step.preempted_ids), tuple(step.finished_ids))

    def _chunk_tokens(self, request: Request, budget_left_tokens: int) -> int:
        n = min(request.num_uncomputed_tokens, budget_left_tokens)
        if self.config.long_prefill_token_threshold > 0:
            n = min(n, self.config.long_prefill_token_threshold)
        return n

    def _make_chunk(self, request: Request, num_tokens: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        end = start + num_tokens
        return make_chunk(request.request_id, start, _token_slice(request, start, end), self._block_table(request),
                          end == request.num_tokens)

    def _block_table(self, request: Request) -> tuple[int, ...]:
        """tuple(request.block_ids), reused from the previous step while the table is unchanged."""
        block_ids = request.block_ids
        entry = self._tables.get(request.request_id)
        if entry is not None and entry[0] is block_ids and len(entry[1]) == len(block_ids):
            return entry[1]
        table = tuple(block_ids)
        self._tables[request.request_id] = (block_ids, table)
        return table

    # ---- hot-path helpers (the simulator runs these for every step of every worker) ------------

    def _plan_steady_decodes(self) -> StepPlan | None:
        """The plan of the steady state, or None (changing nothing) when the state is not steady.

        Steady: nothing waiting (the caller checks), every running request decodes (one uncomputed
        token) inside its block table, and they all fit the token budget. The general path then
        gives every running request its 1-token chunk in running order, preempts nothing and admits
        nothing: this builds that same plan without the step builder. `test_local_scheduler_fast_path`
        compares the two paths.
        """
        running = self._running
        if len(running) > self.config.max_num_batched_tokens:
            return None
        block_size = self.block_size
        chunks = []
        context_tokens = 0
        for request in running:
            output = request.output_token_ids
            start = request.num_computed_tokens
            block_ids = request.block_ids
            # start == 0 (a one-token prompt) is left to the general path: the same plan, but not a decode
            # for pricing, so `steady_plan_context_tokens` always describes an all-decode batch.
            if (len(request.prompt_token_ids) + len(output) - start != 1 or len(block_ids) * block_size <= start
                    or not start):
                return None
            context_tokens += start
            last_token = output[-1] if output else request.prompt_token_ids[-1]
            chunks.append(make_chunk(request.request_id, start, (last_token,), self._block_table(request), True))
        self.steady_plan_context_tokens = context_tokens + len(chunks)
        return make_plan(self._step_id, tuple(chunks), len(chunks))

    def schedule_decodes(self) -> list[Request] | None:
        """The step `schedule` would plan when every running request decodes, as the requests it advances; else None.

        Taken when nothing waits, every running request decodes one token (past position 0) and they
        all fit the token budget, and the free blocks cover every decode whose position opens a new
        block. The general path then gives each running request its one-token chunk in running order,
        growing a full table by one free block as it meets it (no eviction is needed, so none happens
        and nothing is preempted) and admitting nothing: this grows the same tables in the same order
        and advances step ids and `steady_plan_context_tokens` as `schedule` does, without building
        chunks or a plan; an executor that needs no `StepPlan` (the simulator) applies it with
        `update_decodes`. None changes nothing. The list is a snapshot: an abort during the step
        leaves it unchanged.
        """
        running = self._running
        if not self.steady_fast_path or self._waiting or not running:
            return None
        if len(running) > self.config.max_num_batched_tokens:
            return None
        block_size = self.block_size
        context_tokens = 0
        num_growing = 0
        for request in running:
            start = request.num_computed_tokens
            if len(request.prompt_token_ids) + len(request.output_token_ids) - start != 1 or not start:
                return None
            if len(request.block_ids) * block_size <= start:
                num_growing += 1  # a running table covers its computed tokens: one block more covers the next
            context_tokens += start
        if num_growing:
            blocks = self.blocks
            if num_growing > blocks.pool.num_free_blocks:
                return None  # the general path evicts or preempts
            for request in running:
                start = request.num_computed_tokens
                if len(request.block_ids) * block_size <= start:
                    grown = blocks.try_grow(request, start + 1)
                    assert grown, "a free block was counted for every growing decode"
        self._step_id += 1
        self._num_steps += 1
        self.steady_plan_context_tokens = context_tokens + len(running)
        return running[:]

    def update_decodes(self, requests: list[Request], tokens: Sequence[SampledToken], now: float) -> list[TokenOutput]:
        """`update` for a step from `schedule_decodes`: `tokens[i]` is what `requests[i]` sampled.

        Requests no longer running (aborted during the step) are skipped, as `update` skips their
        chunks; nothing else changes a running request's position between the two calls.
        """
        outputs: list[TokenOutput] = []
        running = RequestStatus.RUNNING
        cache_computed_blocks = self.blocks.cache_computed_blocks if self.blocks.cache is not None else None
        holds = self.blocks._holds
        block_size = self.block_size
        append_token = self._append_token
        for request, token in zip(requests, tokens):
            if request.status is not running:
                continue
            num_computed = request.num_computed_tokens = request.num_computed_tokens + 1
            if cache_computed_blocks is not None:
                hold = holds.get(request.request_id)
                if num_computed // block_size > (hold.num_blocks if hold is not None else 0):
                    cache_computed_blocks(request)
            outputs.append(_new_output(TokenOutput, (request.request_id, token, append_token(request, token, now))))
        return outputs

    def _schedule_running_requests(self, step: _StepBuilder, now: float) -> None:
        """Running decodes (exactly one uncomputed token), then running prefills, each in running order.

        A decode whose block table already covers its position gets its 1-token chunk inline (the
        chunk is 1 token: there is budget left and a positive threshold is >= 1; `try_grow` would add
        no block); everything else goes through `_schedule_running`, which may preempt from the tail.
        """
        # One pass over a snapshot of the running list: decodes are handled as met, prefills after them.
        # A preemption (in `_schedule_running`) only removes requests from the live list and marks them
        # PREEMPTED, which the status test skips; no request's token counts change during the pass.
        prefilling: list[Request] = []
        budget_tokens = step.budget_tokens
        block_size = self.block_size
        chunks = step.chunks
        running = RequestStatus.RUNNING
        for request in list(self._running):
            # num_uncomputed_tokens, without two property calls per request per step
            output = request.output_token_ids
            start = request.num_computed_tokens
            num_uncomputed = len(request.prompt_token_ids) + len(output) - start
            if num_uncomputed != 1:
                if num_uncomputed > 1:
                    prefilling.append(request)
                continue
            if step.num_tokens == budget_tokens:
                return
            if request.status is not running:  # preempted earlier in this step
                continue
            block_ids = request.block_ids
            if len(block_ids) * block_size <= start:
                self._schedule_running(request, step, now)  # needs a new block
                continue
            last_token = output[-1] if output else request.prompt_token_ids[-1]
            request_id = request.request_id
            chunks[request_id] = make_chunk(request_id, start, (last_token,), self._block_table(request), True)
            step.num_tokens += 1
        for request in prefilling:
            if step.num_tokens == budget_tokens:
                return
            if request.status is running:
                self._schedule_running(request, step, now)

    def _schedule_running(self, request: Request, step: _StepBuilder, now: float) -> None:
        num_tokens = self._chunk_tokens(request, step.budget_left_tokens)
        end_pos = request.num_computed_tokens + num_tokens
        while not self.blocks.try_grow(request, end_pos):
            victim = self._running[-1]
            # Alone and still short: fail only what the whole pool cannot hold. Otherwise blocks are held outside
            # the scheduler (KV handoff reservations, released within their lease): wait for them, preempted.
            if victim is request and len(self._running) == 1 and not self._fits_pool(end_pos):
                self._running.remove(request)
                self._fail_unfittable(request, end_pos, step, now)
                return
            # The victim may already have a chunk in this step (a decode scheduled before this
            # prefill): withdraw it, its blocks are going away.
            step.withdraw(victim.request_id)
            self._preempt(victim)
            step.preempted_ids.append(victim.request_id)
            if victim is request:
                return
        step.add(self._make_chunk(request, num_tokens))

    def _admit_waiting(self, step: _StepBuilder, now: float) -> None:
        if not self._waiting or step.budget_left_tokens == 0 or len(self._running) >= self.config.max_num_seqs:
            return  # skip the policy's cache probes when nobody could be admitted anyway
        admitted: set[str] = set()
        # Every queue policy orders a single request as itself; skipping it saves a cache probe
        # (peek_cached_tokens has no effect on the cache) per admission in a lightly loaded worker.
        waiting = list(self._waiting)
        ordered = waiting if len(waiting) == 1 else self.policy.order(waiting, self.blocks.peek_cached_tokens)
        for request in ordered:
            if step.budget_left_tokens == 0 or len(self._running) >= self.config.max_num_seqs:
                break
            hit_tokens = self.blocks.attach_prefix(request)
            num_tokens = self._chunk_tokens(request, step.budget_left_tokens)
            end_pos = request.num_computed_tokens + num_tokens
            if not self.blocks.try_grow(request, end_pos):
                self.blocks.free(request)
                if self._running or self._fits_pool(end_pos):
                    break  # admission never preempts; later requests wait behind this one (or for held blocks)
                # Nothing runs, the cache is drained and the whole pool is too small: this request (e.g. a
                # preempted one whose recompute outgrew the pool) can never fit, and would block the queue forever.
                self._waiting.remove(request)
                self._fail_unfittable(request, end_pos, step, now)
                continue
            if self.blocks.cache is not None:
                self._queries_tokens += request.num_tokens
                self._hits_tokens += hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = hit_tokens
            if request.first_scheduled_at is None:
                request.first_scheduled_at = now
            request.status = RequestStatus.RUNNING
            self._running.append(request)
            admitted.add(request.request_id)
            step.add(self._make_chunk(request, num_tokens))
        if admitted:
            self._waiting = deque(r for r in self._waiting if r.request_id not in admitted)

    def _fits_pool(self, end_pos: int) -> bool:
        return self.blocks.num_blocks_for(end_pos) <= self.blocks.pool.num_blocks

    def _fail_unfittable(self, request: Request, end_pos: int, step: _StepBuilder, now: float) -> None:
        message = (
            f"needs {self.blocks.num_blocks_for(end_pos)} KV blocks for {end_pos} tokens; "
            f"the pool has {self.blocks.pool.num_blocks} and nothing else can be freed"
        )
        self._finish(request, FinishReason.ERROR, now, message)
        step.finished_ids.append(request.request_id)

    def _preempt(self, request: Request) -> None:
        self._running.remove(request)
        self.blocks.free(request)
        self._tables.pop(request.request_id, None)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self._num_preemptions += 1
        self._waiting.appendleft(request)

    def _append_token(self, request: Request, token: SampledToken, now: float) -> FinishReason | None:
        """A running request's sampled token: appended, and the request finished if it stops there."""
        token_id = token.token_id
        request.output_token_ids.append(token_id)
        if request.first_token_at is None:
            request.first_token_at = now
        reason = self._stop_reason(request, token_id)
        if reason is not None:
            self._running.remove(request)
            self._finish(request, reason, now)
        return reason

    def _finish(self, request: Request, reason: FinishReason, now: float, message: str = "") -> None:
        """Terminal transition; the caller has already taken `request` out of waiting/running."""
        self.blocks.free(request)
        self._tables.pop(request.request_id, None)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finish_message = message
        request.finished_at = now
        del self._requests[request.request_id]
        self._finished.append(request)

    # ---- results -------------------------------------------------------------------------------

    def update(self, plan: StepPlan, result: StepResult, now: float) -> list[TokenOutput]:
        """Apply an executed plan; chunks of requests no longer running (aborted, preempted) are ignored."""
        outputs: list[TokenOutput] = []
        requests = self._requests
        sampled = result.sampled
        running = RequestStatus.RUNNING
        # With no prefix cache, cache_computed_blocks does nothing: skip the call per chunk. With one, it
        # does nothing either unless the request's full blocks outnumber those its cache hold covers
        # (its own early-return test, read here from the manager's table to save the call per decode).
        cache_computed_blocks = self.blocks.cache_computed_blocks if self.blocks.cache is not None else None
        holds = self.blocks._holds
        block_size = self.block_size
        append_token = self._append_token
        for chunk in plan.chunks:
            request_id = chunk.request_id
            request = requests.get(request_id)
            start_pos = chunk.start_pos
            if request is None or request.status is not running or request.num_computed_tokens != start_pos:
                continue
            num_computed = request.num_computed_tokens = start_pos + len(chunk.token_ids)
            if cache_computed_blocks is not None:
                hold = holds.get(request_id)
                if num_computed // block_size > (hold.num_blocks if hold is not None else 0):
                    cache_computed_blocks(request)
            if not chunk.samples:
                continue
            token = sampled.get(request_id)
            if token is None:
                self._running.remove(request)
                self._finish(request, FinishReason.ERROR, now, f"executor returned no token in step {plan.step_id}")
                continue
            outputs.append(_new_output(TokenOutput, (request_id, token, append_token(request, token, now))))
        return outputs

    def stop_reason(self, request: Request, token_id: int) -> FinishReason | None:
        """Whether appending `token_id` (already in output_token_ids) ends `request`, and why."""
        return self._stop_reason(request, token_id)

    @staticmethod
    def _stop_reason(request: Request, token_id: int) -> FinishReason | None:
        sampling = request.sampling
        if token_id == request.eos_token_id and not sampling.ignore_eos:
            return FinishReason.STOP
        if sampling.stop_token_ids and token_id in sampling.stop_token_ids:
            return FinishReason.STOP
        num_output_tokens = len(request.output_token_ids)
        if (num_output_tokens >= sampling.max_tokens
                or len(request.prompt_token_ids) + num_output_tokens >= request.max_model_len):
            return FinishReason.LENGTH
        return None

    # ---- introspection ----------------------------------------------------------------------

    def stats(self) -> SchedulerStats:
        cache = self.blocks.cache
        return SchedulerStats(
            num_waiting=len(self._waiting),
            num_running=len(self._running),
            num_queued_prefill_tokens=self.num_queued_prefill_tokens(),
            num_used_blocks=self.blocks.pool.num_used_blocks,
            num_free_blocks=self.blocks.pool.num_free_blocks,
            num_cached_blocks=cache.num_cached_blocks if cache is not None else 0,
            prefix_cache_queries_tokens=self._queries_tokens,
            prefix_cache_hits_tokens=self._hits_tokens,
            num_preemptions=self._num_preemptions,
            num_steps=self._num_steps,
        )

    def num_queued_prefill_tokens(self) -> int:
        """Uncomputed tokens of waiting requests and of running ones still prefilling (`stats()`'s figure)."""
        # num_uncomputed_tokens inlined: the simulator asks at every heartbeat of every worker
        queued = 0
        for r in self._waiting:
            queued += len(r.prompt_token_ids) + len(r.output_token_ids) - r.num_computed_tokens
        for r in self._running:
            num_uncomputed = len(r.prompt_token_ids) + len(r.output_token_ids) - r.num_computed_tokens
            if num_uncomputed > 1:
                queued += num_uncomputed
        return queued

    def queued_prefills(self) -> tuple[tuple[int, int], ...]:
        """The same queue prompt by prompt: (uncomputed tokens, tokens already computed) of each, running ones
        still prefilling first, then waiting ones in queue order (what admission prices a prefill queue by)."""
        queue = []
        for r in self._running:
            num_uncomputed = len(r.prompt_token_ids) + len(r.output_token_ids) - r.num_computed_tokens
            if num_uncomputed > 1:
                queue.append((num_uncomputed, r.num_computed_tokens))
        for r in self._waiting:
            queue.append((len(r.prompt_token_ids) + len(r.output_token_ids) - r.num_computed_tokens,
                          r.num_computed_tokens))
        return tuple(queue)

    def check_invariants(self) -> None:
        waiting_ids = [r.request_id for r in self._waiting]
        running_ids = [r.request_id for r in self._running]
        assert len(set(waiting_ids)) == len(waiting_ids) and len(set(running_ids)) == len(running_ids)
        assert set(waiting_ids) | set(running_ids) == set(self._requests), "request tables disagree"
        assert not set(waiting_ids) & set(running_ids), "a request is both waiting and running"
        assert len(self._running) <= self.config.max_num_seqs
        for r in self._waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), f"{r.request_id}: {r.status}"
            assert not r.block_ids and r.num_computed_tokens == 0, f"{r.request_id}: waiting but holds blocks"
        for r in self._running:
            assert r.status is RequestStatus.RUNNING, f"{r.request_id}: {r.status}"
            assert 0 < r.num_uncomputed_tokens <= r.num_tokens, f"{r.request_id}: nothing left to compute"
        for r in self._finished:
            assert r.status is RequestStatus.FINISHED and not r.block_ids
        self.blocks.check_invariants(self._running)
