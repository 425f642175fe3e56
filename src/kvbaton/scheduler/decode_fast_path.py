"""The steady-decode fast path of the local scheduler: a step in which every running request decodes one token.

Most steps of a loaded worker are steady: nothing waits, every running request decodes inside its
block table (or one free block more) and they all fit the token budget. Then the general path
(`step_planning`) would give every running request its one-token chunk in running order, preempting
and admitting nothing; these methods take that same step without the step builder:
`_plan_steady_decodes` builds its plan for `schedule`, and `schedule_decodes`/`update_decodes` take it
without a plan at all for an executor that needs none (the simulator). The simulator runs them for
every step of every worker. `test_local_scheduler_fast_path` compares them with the general path.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from kvbaton.core.config import SchedulerConfig
from kvbaton.core.request import Request, RequestStatus
from kvbaton.core.step import SampledToken, StepPlan
from kvbaton.scheduler.block_manager import BlockManager
from kvbaton.scheduler.fast_values import make_chunk, make_plan
from kvbaton.scheduler.outputs import TokenOutput, new_output


class DecodeFastPath:
    """The steady-decode steps of `LocalScheduler` (a mixin: no state of its own, no `__init__`).

    It works on the scheduler's state, declared here and set by `LocalScheduler.__init__`, and calls the
    scheduler's `_block_table` and `_append_token`.
    """

    config: SchedulerConfig
    blocks: BlockManager
    block_size: int
    steady_fast_path: bool
    steady_plan_context_tokens: int
    _waiting: deque[Request]
    _running: list[Request]
    _step_id: int
    _num_steps: int

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
            outputs.append(new_output(TokenOutput, (request.request_id, token, append_token(request, token, now))))
        return outputs
