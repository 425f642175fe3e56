"""Speculative decoding's policy side (scheduler/spec_decode.py): the prompt-lookup proposer against a brute-force
search, and the scheduler applying a verdict — accepted drafts and the model's token appended in order, KV kept for
what was verified, rejected drafts' blocks back in the pool, limits and stop tokens honoured mid-draft."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvbaton.cache.block_pool import BlockPool
from kvbaton.cache.hashing import CacheKey
from kvbaton.cache.radix_cache import RadixCache
from kvbaton.core.config import SchedulerConfig
from kvbaton.core.request import FinishReason, Request
from kvbaton.core.sampling import SamplingParams
from kvbaton.core.step import SampledToken, StepResult
from kvbaton.scheduler.local_scheduler import LocalScheduler
from kvbaton.scheduler.spec_decode import NgramProposer

BLOCK = 4


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> tuple[int, ...]:
    """The latest earlier occurrence of the longest final n-gram (max_n down to min_n) that some token follows."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        for start in range(length - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tuple(tokens[start + n:start + n + k])
    return ()


@settings(max_examples=200, deadline=None)
@given(prompt=st.lists(st.integers(0, 4), min_size=1, max_size=30),
       steps=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=3), max_size=8),
       k=st.integers(1, 5), min_n=st.integers(1, 3), extra=st.integers(0, 2))
def test_incremental_proposals_equal_a_brute_force_search(prompt: list[int], steps: list[list[int]], k: int,
                                                          min_n: int, extra: int) -> None:
    proposer = NgramProposer(k, min_n, min_n + extra)
    request = Request("r", list(prompt), SamplingParams(), 0.0)
    for appended in [[], *steps]:
        request.output_token_ids.extend(appended)
        tokens = [*request.prompt_token_ids, *request.output_token_ids]
        assert proposer.propose(request, k) == brute_force(tokens, k, min_n, min_n + extra)


def test_the_proposal_respects_the_callers_limit() -> None:
    request = Request("r", [1, 2, 3, 4, 5, 6, 1, 2], SamplingParams(), 0.0)
    proposer = NgramProposer(4)
    assert proposer.propose(request, 2) == (3, 4) and proposer.propose(request, 0) == ()


def scheduler(num_blocks: int = 64, k: int = 4, cache: bool = False) -> LocalScheduler:
    pool = BlockPool(num_blocks)
    radix = RadixCache(pool, BLOCK) if cache else None
    return LocalScheduler(SchedulerConfig(num_speculative_tokens=k), BLOCK, pool, radix, CacheKey("m", "l"))


def prefill(sched: LocalScheduler, request: Request, first: int) -> None:
    sched.add_request(request)
    plan = sched.schedule(0.0)
    sched.update(plan, StepResult(plan.step_id, {request.request_id: SampledToken(first)}), 0.0)


REPEATING = [7, 8, 9, 10, 11, 12, 7, 8, 9]  # after 7 8 9 came 10 11 12


def test_a_verdict_appends_the_accepted_drafts_then_the_models_token_and_frees_rejected_blocks() -> None:
    sched = scheduler(cache=True)
    request = Request("r", REPEATING, SamplingParams(max_tokens=20, ignore_eos=True), 0.0)
    prefill(sched, request, 10)  # ... 7 8 9 10: the drafts are 11 12 7 8
    plan = sched.schedule(1.0)
    (chunk,) = plan.chunks
    assert chunk.token_ids == (10, 11, 12, 7, 8) and chunk.start_pos == len(REPEATING)
    assert len(chunk.block_ids) * BLOCK >= chunk.end_pos
    outputs = sched.update(plan, StepResult(plan.step_id, {"r": SampledToken(99)},
                                            accepted={"r": (SampledToken(11), SampledToken(12))}), 1.0)
    assert [o.token.token_id for o in outputs] == [11, 12, 99]
    assert request.output_token_ids == [10, 11, 12, 99]
    assert request.num_computed_tokens == len(REPEATING) + 3  # 10, 11, 12 verified; 99 is next to compute
    assert len(request.block_ids) == -(-request.num_tokens // BLOCK)  # the rejected drafts' block is back
    assert sched.num_draft_tokens == 4 and sched.num_accepted_tokens == 2
    sched.check_invariants()


def test_drafts_stop_at_max_tokens_and_a_stop_token_among_them_ends_the_request() -> None:
    sched = scheduler()
    request = Request("r", REPEATING, SamplingParams(max_tokens=3, ignore_eos=True), 0.0)
    prefill(sched, request, 10)
    plan = sched.schedule(1.0)
    assert plan.chunks[0].token_ids == (10, 11)  # 3 tokens at most: one output, a draft, the model's own
    stopping = Request("s", REPEATING, SamplingParams(max_tokens=20, stop_token_ids=(12,)), 0.0)
    sched2 = scheduler()
    prefill(sched2, stopping, 10)
    plan = sched2.schedule(1.0)
    outputs = sched2.update(plan, StepResult(plan.step_id, {"s": SampledToken(7)},
                                             accepted={"s": (SampledToken(11), SampledToken(12))}), 1.0)
    assert [o.token.token_id for o in outputs] == [11, 12] and outputs[-1].finish_reason is FinishReason.STOP
    assert stopping.output_token_ids == [10, 11, 12]
    sched2.check_invariants()
    assert sched2.blocks.pool.num_free_blocks == sched2.blocks.pool.num_blocks


def test_requests_that_adjust_their_logits_or_want_prompt_logprobs_do_not_speculate() -> None:
    for params in (SamplingParams(repetition_penalty=1.2), SamplingParams(grammar='{"grammars": []}'),
                   SamplingParams(prompt_logprobs=0), SamplingParams(min_tokens=2)):
        sched = scheduler()
        request = Request("r", REPEATING, params, 0.0)
        prefill(sched, request, 10)
        assert sched.schedule(1.0).chunks[0].token_ids == (10,)


def test_without_room_in_the_pool_a_decode_goes_on_without_drafts() -> None:
    sched = scheduler(num_blocks=3)  # the 10-token sequence fills 3 blocks of 4 exactly
    request = Request("r", REPEATING, SamplingParams(max_tokens=20, ignore_eos=True), 0.0)
    prefill(sched, request, 10)
    (chunk,) = sched.schedule(1.0).chunks
    assert chunk.token_ids == (10,)
