"""Regressions found by bug hunting: speculative decoding and priority scheduling in the LocalScheduler.

Each test failed on the code it was written against; the fix it guards is named in its comment.
"""

from __future__ import annotations

from kvbaton.cache.block_pool import BlockPool
from kvbaton.cache.radix_cache import RadixCache
from kvbaton.core.config import SchedulerConfig
from kvbaton.core.step import SampledToken, StepResult
from kvbaton.scheduler.local_scheduler import LocalScheduler
from tests.scheduler.helpers import BLOCK_SIZE, CACHE_KEY, chunk_spans, make_request


def _speculating(num_blocks: int, *, num_speculative_tokens: int = 3, prefix_cache: bool = False,
                 budget: int = 16) -> LocalScheduler:
    pool = BlockPool(num_blocks)
    cache = RadixCache(pool, BLOCK_SIZE) if prefix_cache else None
    config = SchedulerConfig(max_num_batched_tokens=budget, num_speculative_tokens=num_speculative_tokens)
    return LocalScheduler(config, BLOCK_SIZE, pool, cache, CACHE_KEY)


def test_drafts_do_not_take_the_block_a_later_decode_needs() -> None:
    # Was a bug (scheduler/spec_decode.py `_speculative_chunk`): drafts could take a free block that a decode
    # scheduled after them in the same step needs. `a` (2 blocks, its decode inside them) drafts "3 1 2", which
    # need the pool's one free block; `b` (2 full blocks) then needs that block for its own decode, finds none and
    # is preempted, losing its computed tokens, though without drafts both decode. Fixed: drafts only take blocks
    # left after every other running request's next tokens (decodes and prefills alike).
    sched = _speculating(5)
    a = make_request("a", [1, 2, 3, 1, 2, 3, 1], max_tokens=5)
    b = make_request("b", 8, max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    plan = sched.schedule(0.0)
    assert chunk_spans(plan) == [("a", 0, 7, True), ("b", 0, 8, True)]
    sched.update(plan, StepResult(plan.step_id, {"a": SampledToken(2), "b": SampledToken(7)}), 0.0)
    assert sched.blocks.pool.num_free_blocks == 1

    plan = sched.schedule(1.0)
    assert plan.preempted_ids == ()
    assert chunk_spans(plan) == [("a", 7, 8, True), ("b", 8, 9, True)]
    sched.check_invariants()


def test_drafts_do_not_evict_cached_blocks_for_the_decode_they_ride_on() -> None:
    # Was a bug (scheduler/spec_decode.py `_speculative_chunk`): only the drafts' own blocks were checked against
    # the free ones, not the block the decode itself opens, so a decode at a block boundary with one free block
    # left drafted into a second new block and `try_grow` evicted a cached block for it, though drafts are meant
    # never to take a block an eviction would have to free. Fixed: the request's own next block counts too.
    sched = _speculating(6, num_speculative_tokens=4, prefix_cache=True)
    warm = make_request("warm", 8, max_tokens=1)  # leaves its 2 full prompt blocks in the cache, unlocked
    sched.add_request(warm)
    plan = sched.schedule(0.0)
    sched.update(plan, StepResult(plan.step_id, {"warm": SampledToken(7)}), 0.0)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1], max_tokens=8)  # 3 full blocks
    sched.add_request(a)
    plan = sched.schedule(1.0)
    sched.update(plan, StepResult(plan.step_id, {"a": SampledToken(2)}), 1.0)  # "1 2" recurs: drafts 3 4 5 6
    assert sched.blocks.pool.num_free_blocks == 1 and sched.blocks.cache.num_cached_blocks == 5

    plan = sched.schedule(2.0)
    # The decode at position 12 opens a 4th block (the free one); drafts at 13..16 would need a 5th.
    assert chunk_spans(plan) == [("a", 12, 13, True)]
    assert sched.blocks.cache.num_cached_blocks == 5 and sched.blocks.pool.num_free_blocks == 0
    sched.check_invariants()


def _cached_blocks_after_a_stop_among_drafts(num_speculative_tokens: int) -> int:
    """`r` outputs 2 3 4 5 and stops on 5: speculating, 3 4 5 are drafts ("1 2" recurs) accepted in one step (the
    model's own token after them, 6, is never output)."""
    sched = _speculating(16, num_speculative_tokens=num_speculative_tokens, prefix_cache=True)
    request = make_request("r", [1, 2, 3, 4, 5, 6, 7, 8, 9, 1], max_tokens=10, stop_token_ids=(5,))
    sched.add_request(request)
    tokens = [2, 3, 4, 5, 6]
    while sched.has_unfinished_requests():
        plan = sched.schedule(0.0)
        (chunk,) = plan.chunks
        num_drafts = chunk.end_pos - request.num_tokens
        accepted = tuple(SampledToken(tokens.pop(0)) for _ in range(num_drafts))
        sched.update(plan, StepResult(plan.step_id, {"r": SampledToken(tokens.pop(0))}, accepted={"r": accepted}),
                     0.0)
        sched.check_invariants()
    assert request.output_token_ids == [2, 3, 4, 5]
    return sched.blocks.cache.num_cached_blocks


def test_a_stop_among_accepted_drafts_caches_the_blocks_plain_decodes_would() -> None:
    # Was a bug (scheduler/spec_decode.py `_apply_speculative`): the verified blocks were inserted into the prefix
    # cache only after every accepted token was appended, so a request that ended on an accepted draft (stop token,
    # max_tokens) left the blocks this step completed uncached: here positions 8..11, which plain decodes cache
    # before the token that ends the request (a follow-up turn then recomputes them). Fixed: each accepted token is
    # applied as a plain decode applies its token, the blocks computed before it cached first.
    assert _cached_blocks_after_a_stop_among_drafts(0) == 3
    assert _cached_blocks_after_a_stop_among_drafts(3) == 3


def test_drafts_leave_every_later_decode_its_token_of_the_budget() -> None:
    # Was a bug (scheduler/step_planning.py `_schedule_running_requests`): a decode's drafts could take all the
    # token budget after its own token, so the decodes after it in running order were not scheduled at all; as the
    # running order stays, the same tail requests were skipped step after step while the head ones speculated
    # (`kvbaton sim --spec-max-running N` with N x (1 + K) above the budget). Fixed: drafts are limited to the budget
    # left after one token for each decode not scheduled yet.
    sched = _speculating(64, num_speculative_tokens=4, budget=8)
    for rid in ("a", "b", "c"):
        request = make_request(rid, [1, 2, 3, 4, 5, 1], max_tokens=10)  # with its first token 2: drafts 3 4 5 1
        request.output_token_ids.append(2)
        assert sched.admit_prefilled(request, 6, 0.0)
    plan = sched.schedule(1.0)
    assert chunk_spans(plan) == [("a", 6, 11, True), ("b", 6, 8, True), ("c", 6, 7, True)]
    sched.check_invariants()
