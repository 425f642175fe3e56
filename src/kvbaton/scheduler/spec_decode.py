"""Speculative decoding by prompt lookup (vLLM's "ngram" method): draft tokens copied from the request's own text.

When the last n tokens of a running request (n from `max_n` down to `min_n`) occurred earlier in its
prompt or output, the tokens that followed that occurrence (the latest one) are proposed as the next
ones. The scheduler sends them with the request's decode as one chunk (`1 + k` positions); the
executor checks them against the model in that single forward and keeps the longest agreeing prefix
plus one token of its own (`LocalScheduler.update`, through `SpeculativeDecodes.apply`), so a greedy request outputs exactly the tokens it
would have without drafts, several per step where its output copies its context (RAG answers, code
edits, multi-turn agents re-quoting tool output). A decode step on a memory-bound CPU or GPU costs about
the same for 1 or 5 positions, so accepted drafts are nearly free tokens.

The index of each request's n-grams grows by the tokens it appended since its last proposal, so a
proposal costs O(new tokens), not O(context).
"""

from __future__ import annotations

from kvbaton.core.config import SchedulerConfig
from kvbaton.core.request import FinishReason, Request
from kvbaton.core.step import ScheduledChunk, StepResult
from kvbaton.scheduler.block_manager import BlockManager
from kvbaton.scheduler.outputs import TokenOutput, new_output
from kvbaton.scheduler.request_queues import RequestQueues


class NgramProposer:
    def __init__(self, num_tokens: int, min_n: int = 2, max_n: int = 4) -> None:
        if num_tokens < 1 or not 1 <= min_n <= max_n:
            raise ValueError(f"need num_tokens >= 1 and 1 <= min_n <= max_n, got {num_tokens}, {min_n}, {max_n}")
        self.num_tokens = num_tokens
        self.min_n = min_n
        self.max_n = max_n
        # request id -> (n-gram -> latest start among those indexed, per n: the first start not indexed yet)
        self._index: dict[str, tuple[dict[tuple[int, ...], int], list[int]]] = {}

    def propose(self, request: Request, max_tokens: int) -> tuple[int, ...]:
        """Up to min(num_tokens, max_tokens) drafts to follow `request`'s tokens; () when no n-gram recurs."""
        limit = min(self.num_tokens, max_tokens)
        if limit <= 0:
            return ()
        length = request.num_tokens
        entry = self._index.get(request.request_id)
        if entry is None:
            entry = self._index[request.request_id] = ({}, [0] * (self.max_n + 1))
        index, next_start = entry
        # Index each n-gram that some token follows (start + n < length): a lookup of the final n tokens then
        # finds an earlier occurrence and what came after it.
        for n in range(self.min_n, self.max_n + 1):
            for start in range(next_start[n], length - n):
                index[request.token_slice(start, start + n)] = start
            next_start[n] = max(next_start[n], length - n)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = index.get(request.token_slice(length - n, length))
            if start is not None:
                return request.token_slice(start + n, min(start + n + limit, length))
        return ()

    def forget(self, request_id: str) -> None:
        self._index.pop(request_id, None)


class SpeculativeDecodes:
    """The speculative part of a `LocalScheduler`: a decode's drafts in its step's chunk (for its `StepPlanner`),
    and what the executor's verdict makes of them (for its `update`); counts drafts proposed and accepted."""

    def __init__(self, config: SchedulerConfig, blocks: BlockManager, queues: RequestQueues,
                 proposer: NgramProposer) -> None:
        self.config = config
        self.blocks = blocks
        self.queues = queues
        self.proposer = proposer
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def drafts(self, request: Request, budget_left_tokens: int) -> tuple[int, ...]:
        """Drafts for `request`'s next decode, within its limits and the step's token budget (after its own
        token); () when it may not speculate: its logits are adjusted or masked (penalties, bias, min_tokens,
        a grammar), it wants its prompt's logprobs, or the batch is too large."""
        sampling = request.sampling
        if (len(self.queues.running) > self.config.spec_max_running or sampling.adjusts_logits
                or sampling.grammar or sampling.prompt_logprobs is not None):
            return ()
        num_tokens = len(request.prompt_token_ids) + len(request.output_token_ids)
        room = min(sampling.max_tokens - len(request.output_token_ids) - 1,
                   request.max_model_len - num_tokens - 1, budget_left_tokens)
        return self.proposer.propose(request, room)

    def chunk(self, request: Request, drafts: tuple[int, ...]) -> ScheduledChunk | None:
        """The decode of `request`'s last token followed by `drafts`, its table grown to hold them; None when they
        would need blocks others need (the caller schedules a plain decode). Drafts take a new block only from the
        free ones left after what every running request's next tokens need (this decode's own included): never
        one a cache eviction would have to free, nor the last ones a decode or prefill scheduled after this one
        would then preempt someone for."""
        start = request.num_computed_tokens
        blocks = self.blocks
        num_extra = blocks.num_blocks_for(start + 1 + len(drafts)) - max(len(request.block_ids),
                                                                           blocks.num_blocks_for(start + 1))
        if num_extra > 0 and num_extra > blocks.pool.num_free_blocks - self._blocks_running_need():
            return None
        if not blocks.try_grow(request, start + 1 + len(drafts)):
            return None
        output = request.output_token_ids
        last = output[-1] if output else request.prompt_token_ids[-1]
        self.num_draft_tokens += len(drafts)
        return ScheduledChunk(request.request_id, start, (last, *drafts), self.blocks.table(request), True)

    def _blocks_running_need(self) -> int:
        """Blocks the running requests still need to cover their tokens: a prefill's rest of the prompt, a decode's
        next position (none for one already scheduled this step: its table covers it). A few run: speculation
        stops above spec_max_running."""
        num_blocks_for = self.blocks.num_blocks_for
        return sum(max(0, num_blocks_for(r.num_tokens) - len(r.block_ids)) for r in self.queues.running)

    def apply(self, request: Request, chunk: ScheduledChunk, result: StepResult, now: float,
                           outputs: list[TokenOutput]) -> None:
        """The verdict on a speculative chunk: KV is kept for the last token and the accepted drafts, which are
        output in order with the model's own next token, as plain decodes would have output them (each may end
        the request); the blocks past the request's tokens, which hold rejected drafts, go back to the pool."""
        accepted = result.accepted.get(chunk.request_id, ())
        self.num_accepted_tokens += len(accepted)
        token = result.sampled.get(chunk.request_id)
        if token is None:
            self.queues.finish(request, FinishReason.ERROR, now, "executor returned no token for a speculative chunk")
            return
        cache_computed_blocks = self.blocks.cache_computed_blocks if self.blocks.cache is not None else None
        num_computed = chunk.start_pos + 1  # the last token's KV, then one more per accepted draft
        for out in (*accepted, token):
            # As the plain decode that would have output `out`: the KV before it computed (its full blocks cached)
            # before it is appended, which may end the request.
            request.num_computed_tokens = num_computed
            if cache_computed_blocks is not None:
                cache_computed_blocks(request)
            reason = self.queues.append_token(request, out, now)
            outputs.append(new_output(TokenOutput, (request.request_id, out, reason)))
            if reason is not None:
                return
            num_computed += 1
        self.blocks.trim(request)
