"""Factories and a tiny fake executor for scheduler tests."""

from __future__ import annotations

from collections.abc import Callable

from kvbaton.cache.block_pool import BlockPool
from kvbaton.cache.hashing import CacheKey
from kvbaton.cache.radix_cache import RadixCache
from kvbaton.core.config import SchedulerConfig
from kvbaton.core.request import Request
from kvbaton.core.sampling import SamplingParams
from kvbaton.core.step import SampledToken, StepPlan, StepResult
from kvbaton.scheduler.local_scheduler import LocalScheduler
from kvbaton.scheduler.outputs import TokenOutput

CACHE_KEY = CacheKey("test-model@rev", "test-layout")
BLOCK_SIZE = 4


def make_request(
    request_id: str,
    prompt: list[int] | int,
    *,
    max_tokens: int = 4,
    arrival_at: float = 0.0,
    eos_token_id: int | None = None,
    max_model_len: int = 8192,
    tenant: str = "",
    stop_token_ids: tuple[int, ...] = (),
    ignore_eos: bool = False,
) -> Request:
    """A request whose prompt is `prompt`, or `prompt` distinct tokens 1000+i when an int."""
    token_ids = list(prompt) if isinstance(prompt, list) else [1000 + i for i in range(prompt)]
    sampling = SamplingParams(max_tokens=max_tokens, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos)
    return Request(request_id, token_ids, sampling, arrival_at, tenant=tenant, eos_token_id=eos_token_id,
                   max_model_len=max_model_len)


def make_scheduler(
    num_blocks: int = 64,
    *,
    prefix_cache: bool = False,
    max_num_batched_tokens: int = 16,
    max_num_seqs: int = 8,
    long_prefill_token_threshold: int = 0,
    queue_policy: str = "fcfs",
) -> LocalScheduler:
    pool = BlockPool(num_blocks)
    cache = RadixCache(pool, BLOCK_SIZE) if prefix_cache else None
    config = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                             long_prefill_token_threshold=long_prefill_token_threshold, queue_policy=queue_policy)
    return LocalScheduler(config, BLOCK_SIZE, pool, cache, CACHE_KEY)


def fake_execute(plan: StepPlan, token_for: Callable[[str, int], int] = lambda rid, pos: 7) -> StepResult:
    """Answer a plan like an executor would: one token per sampling chunk, chosen by `token_for(id, end_pos)`."""
    sampled = {c.request_id: SampledToken(token_for(c.request_id, c.end_pos)) for c in plan.chunks if c.samples}
    return StepResult(plan.step_id, sampled)


def step(scheduler: LocalScheduler, now: float = 0.0,
         token_for: Callable[[str, int], int] = lambda rid, pos: 7) -> tuple[StepPlan, list[TokenOutput]]:
    plan = scheduler.schedule(now)
    outputs = scheduler.update(plan, fake_execute(plan, token_for), now)
    scheduler.check_invariants()
    return plan, outputs


def chunk_spans(plan: StepPlan) -> list[tuple[str, int, int, bool]]:
    """(request id, start, end, samples) per chunk, in plan order."""
    return [(c.request_id, c.start_pos, c.end_pos, c.samples) for c in plan.chunks]


def scheduler_state(sched: LocalScheduler, request_ids: list[str]) -> list[tuple]:
    """What two schedulers fed the same operations must agree on: each live request's status, progress,
    outputs and blocks, and the pool's free queue in order."""
    rows = []
    for rid in request_ids:
        r = sched.get_request(rid)
        if r is not None:
            rows.append((rid, r.status, r.num_computed_tokens, tuple(r.output_token_ids), tuple(r.block_ids)))
    return rows + [("pool", tuple(sched.blocks.pool.free_block_ids()))]
