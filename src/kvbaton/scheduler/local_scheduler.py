"""The local iteration scheduler: which tokens of which requests one engine step computes.

Each `schedule(now)` builds a `StepPlan` under the token budget and `max_num_seqs`:
  1. running decodes (one token each), in running order;
  2. running requests still prefilling, continuing their chunks;
  3. waiting requests in the queue policy's order (chunked prefill, stall-free: the last one
     admitted may get a partial chunk that fills the budget) — skipped in a step that preempted.
`update(plan, result, now)` advances `num_computed_tokens`, appends sampled tokens, caches newly
full blocks and applies stop conditions. No clock and no RNG: `now` is passed in, ties break
by running/arrival order, so the same inputs give the same plans and block ids.

Preemption is by recompute: the most recently admitted running request gives all its blocks back
and goes to the front of the waiting queue (`step_planning`).

`LocalScheduler` is composed of parts that own their state: `BlockManager` (block tables, prefix-cache
locks), `RequestQueues` (waiting, running and finished requests and the moves between them),
`StepPlanner` (the general step: running chunks, preemption, admission) and, when configured,
`SpeculativeDecodes` (drafts and their verdicts). This module holds requests in and out,
`schedule`/`update` and introspection. There is one step path, which the simulator drives as the engine does,
and one fast path beside it, for the simulator: a run of steps in which the same requests only decode
(`quiet_decode_steps`, `advance_quiet_decodes`), applied at once (`test_quiet_decode_runs`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from kvbaton.cache.block_pool import BlockPool
from kvbaton.cache.hashing import CacheKey, HashedBlocks
from kvbaton.cache.radix_cache import RadixCache
from kvbaton.core.config import SchedulerConfig
from kvbaton.core.errors import CapacityError, InvalidRequestError
from kvbaton.core.request import FinishReason, Request, RequestStatus
from kvbaton.core.step import StepPlan, StepResult
from kvbaton.scheduler.block_manager import BlockManager
from kvbaton.scheduler.outputs import SchedulerStats, TokenOutput, new_output
from kvbaton.scheduler.queue_policies import create_queue_policy
from kvbaton.scheduler.request_queues import RequestQueues, stop_reason
from kvbaton.scheduler.spec_decode import NgramProposer, SpeculativeDecodes
from kvbaton.scheduler.step_planning import StepPlanner


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
        # Speculative decoding (scheduler/spec_decode.py) when configured: drafts go through the general path.
        self.proposer = (NgramProposer(config.num_speculative_tokens, config.spec_ngram_min, config.spec_ngram_max)
                         if config.num_speculative_tokens > 0 else None)
        self.queues = RequestQueues(self.blocks, self.proposer.forget if self.proposer is not None else None)
        self.speculation = (SpeculativeDecodes(config, self.blocks, self.queues, self.proposer)
                            if self.proposer is not None else None)
        self.planner = StepPlanner(config, self.blocks, self.policy, self.queues, self.speculation)
        self._step_id = 0
        self._num_steps = 0
        # Σ (start_pos + 1) over the last plan's chunks when every one is a decode (one sampled token past
        # position 0, `BatchShape.of_plan`'s rule), else -1: lets an executor price the batch
        # (`CostModel.decode_s`) without reading the plan again.
        self.decode_context_tokens = -1

    @property
    def on_preempted(self) -> Callable[[Request], None] | None:
        """Called with each request the scheduler preempts, after its blocks are freed: a prefill worker's handoff
        leg then lets go of the blocks it streamed from, which its recompute may need (engine/handoff_prefill.py)."""
        return self.planner.on_preempted

    @on_preempted.setter
    def on_preempted(self, hook: Callable[[Request], None] | None) -> None:
        self.planner.on_preempted = hook

    @property
    def num_draft_tokens(self) -> int:
        return self.speculation.num_draft_tokens if self.speculation is not None else 0

    @property
    def num_accepted_tokens(self) -> int:
        return self.speculation.num_accepted_tokens if self.speculation is not None else 0

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request, prompt_blocks: HashedBlocks | None = None) -> None:
        """Queue a new request. `prompt_blocks`: its prompt already split and hashed under this worker's
        cache key (`hash_prompt`, e.g. by the simulator, which hashed it to route it); saves doing it again."""
        if request.request_id in self.queues:
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
        self.queues.add_waiting(request)
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
        if request.request_id in self.queues:
            raise InvalidRequestError(f"duplicate request id {request.request_id!r}")
        if not 0 < num_computed_tokens < request.num_tokens:
            raise InvalidRequestError(
                f"a handed-off request needs 0 < computed ({num_computed_tokens}) < tokens ({request.num_tokens})"
            )
        if request.block_ids or request.num_computed_tokens:
            raise InvalidRequestError(f"{request.request_id}: a handed-off request must arrive holding no blocks")
        if len(self.queues.running) >= self.config.max_num_seqs:
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
        self.queues.add_running(request)
        return True

    def abort_request(self, request_id: str, now: float) -> Request | None:
        """Cancel a request in any state, freeing its blocks at once; idempotent."""
        return self.finish_request(request_id, FinishReason.ABORT, now)

    def finish_request(self, request_id: str, reason: FinishReason, now: float, message: str = "") -> Request | None:
        """End a request for a reason found outside the scheduler (stop string, abort); None if not live."""
        request = self.queues.get(request_id)
        if request is None:
            return None
        self.queues.finish(request, reason, now, message)
        return request

    def take_finished(self) -> list[Request]:
        return self.queues.take_finished()

    def get_request(self, request_id: str) -> Request | None:
        """A waiting or running request; None once it has finished."""
        return self.queues.get(request_id)

    @property
    def requests(self) -> Mapping[str, Request]:
        """Read-only: every waiting or running request by id."""
        return self.queues.requests

    def waiting_request_ids(self) -> list[str]:
        """The waiting queue in FCFS order (preempted first), before any policy reordering."""
        return [r.request_id for r in self.queues.waiting]

    @property
    def num_waiting(self) -> int:
        return len(self.queues.waiting)

    @property
    def num_running(self) -> int:
        return len(self.queues.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.queues)

    # ---- one step ----------------------------------------------------------------------------

    def schedule(self, now: float) -> StepPlan:
        self._step_id += 1
        plan = self.planner.plan(self._step_id, now)
        chunks = plan.chunks
        context_tokens = -1
        if chunks:
            self._num_steps += 1
            # Σ (start_pos + 1) when every chunk is a decode by `BatchShape.of_plan`'s rule (one sampled token past
            # position 0): most steps of a loaded worker, which the simulator then prices without a BatchShape.
            context_tokens = 0
            for chunk in chunks:
                start_pos = chunk.start_pos
                if len(chunk.token_ids) != 1 or not start_pos or not chunk.samples:
                    context_tokens = -1
                    break
                context_tokens += start_pos + 1
        self.decode_context_tokens = context_tokens
        return plan

    # ---- results -------------------------------------------------------------------------------

    def update(self, plan: StepPlan, result: StepResult, now: float) -> list[TokenOutput]:
        """Apply an executed plan; chunks of requests no longer running (aborted, preempted) are ignored."""
        outputs: list[TokenOutput] = []
        get_request = self.queues.requests.get
        sampled = result.sampled
        running = RequestStatus.RUNNING
        # With no prefix cache, cache_computed_blocks does nothing: skip the call per chunk. With one, it
        # does nothing either unless the request's full blocks outnumber those its cache hold covers
        # (its own early-return test, read here from the manager's table to save the call per decode).
        cache_computed_blocks = self.blocks.cache_computed_blocks if self.blocks.cache is not None else None
        holds = self.blocks.holds
        block_size = self.block_size
        append_token = self.queues.append_token
        speculation = self.speculation
        for chunk in plan.chunks:
            request_id = chunk.request_id
            request = get_request(request_id)
            start_pos = chunk.start_pos
            if request is None or request.status is not running or request.num_computed_tokens != start_pos:
                continue
            if speculation is not None and start_pos + len(chunk.token_ids) > request.num_tokens:  # it carries drafts
                speculation.apply(request, chunk, result, now, outputs)
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
                self.queues.finish(request, FinishReason.ERROR, now, f"executor returned no token in step {plan.step_id}")
                continue
            outputs.append(new_output(TokenOutput, (request_id, token, append_token(request, token, now))))
        return outputs

    # ---- the one fast path: a run of quiet decode steps -----------------------------------------------

    def quiet_decode_steps(self, plan: StepPlan, limit: int) -> int:
        """How many steps, `plan` (just scheduled) the first, run the same decodes with nothing else happening: the
        largest m <= `limit` such that updating each of the first m - 1 only appends one token to every request of
        `plan` (no block the prefix cache would take is filled, no request stops, none gets its first token) and
        scheduling each of steps 2..m only plans those requests' next decodes in blocks they already hold. 1 when
        `plan` is not such a step: it is not every running request's decode, a request waits, or drafts are on.

        `advance_quiet_decodes` then applies the first m - 1 at once (the simulator's one fast path)."""
        queues = self.queues
        chunks = plan.chunks
        if (limit < 2 or self.decode_context_tokens < 0 or self.speculation is not None or queues.waiting
                or len(chunks) != len(queues.running)):
            return 1
        block_size = self.block_size
        holds = self.blocks.holds if self.blocks.cache is not None else None
        get_request = queues.requests.get
        steps = limit
        for chunk in chunks:
            request = get_request(chunk.request_id)
            if request is None or request.num_computed_tokens != chunk.start_pos:
                return 1
            output = request.output_token_ids
            sampling = request.sampling
            if (not output or request.first_token_at is None or sampling.stop_token_ids
                    or (request.eos_token_id is not None and not sampling.ignore_eos)):
                return 1
            position = chunk.start_pos  # computed by step 1; step i computes position + i - 1
            # Step i schedules without a new block while position + i - 1 < the table's slots; it stops the request
            # once len(output) + i reaches max_tokens or prompt + output + i reaches max_model_len.
            steps = min(steps, len(request.block_ids) * block_size - position,
                        sampling.max_tokens - len(output),
                        request.max_model_len - len(request.prompt_token_ids) - len(output))
            if holds is not None:  # update i hands blocks to the cache once (position + i) // block_size > held
                hold = holds.get(chunk.request_id)
                held = hold.num_blocks if hold is not None else 0
                steps = min(steps, (held + 1) * block_size - position)
            if steps < 2:
                return 1
        return steps

    def advance_quiet_decodes(self, plan: StepPlan, tokens: Mapping[str, Sequence[int]]) -> None:
        """Apply `n` = len(tokens[id]) quiet decode steps from `plan` on (`quiet_decode_steps` > n): each request of
        `plan` gets its n tokens, and steps 2..n are counted as scheduled, exactly as n rounds of `update` and
        `schedule` would leave it; step n + 1 is then scheduled as usual."""
        get_request = self.queues.requests.get
        n = 0
        for chunk in plan.chunks:
            request = get_request(chunk.request_id)
            assert request is not None and request.num_computed_tokens == chunk.start_pos, "not a quiet run"
            new_tokens = tokens[chunk.request_id]
            n = len(new_tokens)
            request.output_token_ids.extend(new_tokens)
            request.num_computed_tokens = chunk.start_pos + n
        self._step_id += n - 1
        self._num_steps += n - 1

    def stop_reason(self, request: Request, token_id: int) -> FinishReason | None:
        """Whether appending `token_id` (already in output_token_ids) ends `request`, and why."""
        return stop_reason(request, token_id)

    # ---- introspection ----------------------------------------------------------------------

    def stats(self) -> SchedulerStats:
        cache = self.blocks.cache
        tier = cache.tier if cache is not None else None
        return SchedulerStats(
            num_waiting=len(self.queues.waiting),
            num_running=len(self.queues.running),
            num_queued_prefill_tokens=self.num_queued_prefill_tokens(),
            num_used_blocks=self.blocks.pool.num_used_blocks,
            num_free_blocks=self.blocks.pool.num_free_blocks,
            num_cached_blocks=cache.num_cached_blocks if cache is not None else 0,
            prefix_cache_queries_tokens=self.planner.queries_tokens,
            prefix_cache_hits_tokens=self.planner.hits_tokens,
            num_preemptions=self.planner.num_preemptions,
            num_steps=self._num_steps,
            num_store_cached_blocks=tier.num_cached_blocks if tier is not None else 0,
            num_store_loaded_blocks=tier.num_loaded_blocks if tier is not None else 0,
            num_store_saved_blocks=tier.num_saved_blocks if tier is not None else 0,
            num_evictable_blocks=cache.num_evictable_blocks if cache is not None else 0,
        )

    def num_queued_prefill_tokens(self) -> int:
        """Uncomputed tokens of waiting requests and of running ones still prefilling (`stats()`'s figure)."""
        # num_uncomputed_tokens inlined: the simulator asks at every heartbeat of every worker
        queued = 0
        for r in self.queues.waiting:
            queued += len(r.prompt_token_ids) + len(r.output_token_ids) - r.num_computed_tokens
        for r in self.queues.running:
            num_uncomputed = len(r.prompt_token_ids) + len(r.output_token_ids) - r.num_computed_tokens
            if num_uncomputed > 1:
                queued += num_uncomputed
        return queued

    def queued_prefills(self) -> tuple[tuple[int, int], ...]:
        """The same queue prompt by prompt: (uncomputed tokens, tokens already computed) of each, running ones
        still prefilling first, then waiting ones in queue order (what admission prices a prefill queue by)."""
        queue = []
        for r in self.queues.running:
            num_uncomputed = len(r.prompt_token_ids) + len(r.output_token_ids) - r.num_computed_tokens
            if num_uncomputed > 1:
                queue.append((num_uncomputed, r.num_computed_tokens))
        for r in self.queues.waiting:
            queue.append((len(r.prompt_token_ids) + len(r.output_token_ids) - r.num_computed_tokens,
                          r.num_computed_tokens))
        return tuple(queue)

    def check_invariants(self, num_outside_blocks: int = 0) -> None:
        """`num_outside_blocks`: pool blocks held outside the scheduler by their owners (KV store loads in flight)."""
        self.queues.check_invariants(self.config.max_num_seqs)
        # Between schedule and update a speculating decode's table also covers its drafts (update trims it).
        self.blocks.check_invariants(list(self.queues.running), self.config.num_speculative_tokens, num_outside_blocks)
