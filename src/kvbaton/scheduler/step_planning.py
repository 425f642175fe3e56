"""The general path of a local scheduler step: running requests' chunks, preemption, admission of waiting ones.

`LocalScheduler.schedule` has its `StepPlanner` build every step: running decodes, then running
prefills continuing their chunks (`_schedule_running_requests`), then waiting requests in the queue
policy's order (`_admit_waiting`), all under the token budget. Preemption is by
recompute: when a running request cannot get a block (after evicting from the prefix cache), the most
recently admitted running request gives all its blocks back and goes to the front of the waiting queue,
keeping its output tokens to recompute them. Admission never preempts.
"""

from __future__ import annotations

from collections.abc import Callable

from kvbaton.core.config import SchedulerConfig
from kvbaton.core.request import FinishReason, Request, RequestStatus
from kvbaton.core.step import ScheduledChunk, StepPlan
from kvbaton.scheduler.block_manager import BlockManager
from kvbaton.scheduler.queue_policies import QueuePolicy
from kvbaton.scheduler.request_queues import RequestQueues
from kvbaton.scheduler.spec_decode import SpeculativeDecodes


class StepBuilder:
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


class StepPlanner:
    """The general step path of a `LocalScheduler`: plans a step over its requests (`RequestQueues`) and blocks,
    preempting and admitting; counts preemptions and prefix-cache lookups at admission."""

    def __init__(self, config: SchedulerConfig, blocks: BlockManager, policy: QueuePolicy, queues: RequestQueues,
                 speculation: SpeculativeDecodes | None) -> None:
        self.config = config
        self.blocks = blocks
        self.policy = policy
        self.queues = queues
        self.speculation = speculation  # drafts for decodes, when speculative decoding is configured
        self.num_preemptions = 0
        self.queries_tokens = 0  # tokens looked up in the prefix cache at admissions
        self.hits_tokens = 0  # of which it supplied
        # Told of each preemption, after the request's blocks are freed (a handoff's leg lets go of its blocks).
        self.on_preempted: Callable[[Request], None] | None = None

    def plan(self, step_id: int, now: float) -> StepPlan:
        step = StepBuilder(self.config.max_num_batched_tokens)
        queues = self.queues
        if queues.running:
            self._schedule_running_requests(step, now)
        if queues.waiting and not step.preempted_ids:  # memory is tight: admitting now would only preempt again
            self._admit_waiting(step, now)
        preempted_ids, finished_ids = step.preempted_ids, step.finished_ids
        return StepPlan(step_id, tuple(step.chunks.values()), step.num_tokens,
                         tuple(preempted_ids) if preempted_ids else (), tuple(finished_ids) if finished_ids else ())

    def _chunk_tokens(self, request: Request, budget_left_tokens: int) -> int:
        n = min(request.num_uncomputed_tokens, budget_left_tokens)
        if self.config.long_prefill_token_threshold > 0:
            n = min(n, self.config.long_prefill_token_threshold)
        return n

    def _make_chunk(self, request: Request, num_tokens: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        end = start + num_tokens
        return ScheduledChunk(request.request_id, start, request.token_slice(start, end), self.blocks.table(request),
                          end == request.num_tokens)

    def _schedule_running_requests(self, step: StepBuilder, now: float) -> None:
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
        block_size = self.blocks.block_size
        chunks = step.chunks
        running = RequestStatus.RUNNING
        speculation = self.speculation
        running_requests = self.queues.running
        # Decodes not met yet in the pass: a decode's drafts leave each of them a token of the budget.
        num_decodes_left = (sum(1 for r in running_requests if r.num_tokens - r.num_computed_tokens == 1)
                            if speculation is not None else 0)
        block_table = self.blocks.table
        for request in list(running_requests):
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
            num_decodes_left -= 1
            if request.status is not running:  # preempted earlier in this step
                continue
            if speculation is not None:
                drafts = speculation.drafts(request, budget_tokens - step.num_tokens - 1 - num_decodes_left)
                chunk = speculation.chunk(request, drafts) if drafts else None
                if chunk is not None:
                    chunks[request.request_id] = chunk
                    step.num_tokens += chunk.num_tokens
                    continue
            block_ids = request.block_ids
            if len(block_ids) * block_size <= start:
                self._schedule_running(request, step, now)  # needs a new block
                continue
            last_token = output[-1] if output else request.prompt_token_ids[-1]
            request_id = request.request_id
            chunks[request_id] = ScheduledChunk(request_id, start, (last_token,), block_table(request), True)
            step.num_tokens += 1
        for request in prefilling:
            if step.num_tokens == budget_tokens:
                return
            if request.status is running:
                self._schedule_running(request, step, now)

    def _schedule_running(self, request: Request, step: StepBuilder, now: float) -> None:
        num_tokens = self._chunk_tokens(request, step.budget_left_tokens)
        end_pos = request.num_computed_tokens + num_tokens
        while not self.blocks.try_grow(request, end_pos):
            victim = self._preemption_victim()
            # Alone and still short: fail only what the whole pool cannot hold. Otherwise blocks are held outside
            # the scheduler (KV handoff reservations, released within their lease): wait for them, preempted.
            if victim is request and len(self.queues.running) == 1 and not self._fits_pool(end_pos):
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

    def _admit_waiting(self, step: StepBuilder, now: float) -> None:
        queues = self.queues
        running = queues.running
        max_num_seqs = self.config.max_num_seqs
        if not queues.waiting or step.budget_left_tokens == 0 or len(running) >= max_num_seqs:
            return  # skip the policy's cache probes when nobody could be admitted anyway
        admitted: set[str] = set()
        # Every queue policy orders a single request as itself; skipping it saves a cache probe
        # (peek_cached_tokens has no effect on the cache) per admission in a lightly loaded worker.
        waiting = list(queues.waiting)
        ordered = waiting if len(waiting) == 1 else self.policy.order(waiting, self.blocks.peek_cached_tokens)
        for request in ordered:
            if step.budget_left_tokens == 0 or len(running) >= max_num_seqs:
                break
            hit_tokens = self.blocks.attach_prefix(request)
            num_tokens = self._chunk_tokens(request, step.budget_left_tokens)
            end_pos = request.num_computed_tokens + num_tokens
            if not self.blocks.try_grow(request, end_pos):
                self.blocks.free(request)
                if running or self._fits_pool(end_pos):
                    break  # admission never preempts; later requests wait behind this one (or for held blocks)
                # Nothing runs, the cache is drained and the whole pool is too small: this request (e.g. a
                # preempted one whose recompute outgrew the pool) can never fit, and would block the queue forever.
                self._fail_unfittable(request, end_pos, step, now)
                continue
            if self.blocks.cache is not None:
                self.queries_tokens += request.num_tokens
                self.hits_tokens += hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = hit_tokens
            if request.first_scheduled_at is None:
                request.first_scheduled_at = now
            if request.status is not RequestStatus.PREEMPTED:
                self.policy.on_admitted(request, hit_tokens)
            queues.admit(request)
            admitted.add(request.request_id)
            step.add(self._make_chunk(request, num_tokens))
        if admitted:
            queues.drop_admitted(admitted)

    def _preemption_victim(self) -> Request:
        """The running request to preempt: the last admitted, or under the priority policy the one of the highest
        priority value (the latest arrival among equals), as vLLM picks."""
        running = self.queues.running
        if self.config.queue_policy != "priority":
            return running[-1]
        return max(reversed(running), key=lambda r: (r.sampling.priority, r.arrival_at))

    def _fits_pool(self, end_pos: int) -> bool:
        return self.blocks.num_blocks_for(end_pos) <= self.blocks.pool.num_blocks

    def _fail_unfittable(self, request: Request, end_pos: int, step: StepBuilder, now: float) -> None:
        message = (
            f"needs {self.blocks.num_blocks_for(end_pos)} KV blocks for {end_pos} tokens; "
            f"the pool has {self.blocks.pool.num_blocks} and nothing else can be freed"
        )
        self.queues.finish(request, FinishReason.ERROR, now, message)
        step.finished_ids.append(request.request_id)

    def _preempt(self, request: Request) -> None:
        self.queues.preempt(request)
        self.num_preemptions += 1
        if self.on_preempted is not None:
            self.on_preempted(request)
