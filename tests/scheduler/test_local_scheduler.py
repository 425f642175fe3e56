"""Exact plans of the local scheduler on small hand-built cases (block size 4, fake executor)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvbaton.core.errors import CapacityError, InvalidRequestError
from kvbaton.core.request import FinishReason, Request, RequestStatus
from kvbaton.core.sampling import SamplingParams
from kvbaton.core.step import SampledToken, StepResult
from tests.scheduler.helpers import chunk_spans, fake_execute, make_request, make_scheduler, step


def test_budget_split_and_chunk_boundaries() -> None:
    sched = make_scheduler(max_num_batched_tokens=16)
    sched.add_request(make_request("a", 10, max_tokens=3))
    sched.add_request(make_request("b", 10, max_tokens=3))

    plan, outputs = step(sched)
    # a's whole prompt, then b gets the 6 tokens left of the budget (stall-free partial chunk).
    assert chunk_spans(plan) == [("a", 0, 10, True), ("b", 0, 6, False)]
    assert plan.num_batched_tokens == 16
    assert [c.block_ids for c in plan.chunks] == [(0, 1, 2), (3, 4)]
    assert plan.chunks[1].token_ids == tuple(range(1000, 1006))
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", None)]

    plan, _ = step(sched)
    assert chunk_spans(plan) == [("a", 10, 11, True), ("b", 6, 10, True)]
    assert plan.chunks[0].token_ids == (7,)  # a decode is the last sampled token
    assert plan.chunks[1].block_ids == (3, 4, 5)

    plan, outputs = step(sched)
    assert chunk_spans(plan) == [("a", 11, 12, True), ("b", 10, 11, True)]
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", FinishReason.LENGTH), ("b", None)]
    assert [r.request_id for r in sched.take_finished()] == ["a"]

    plan, outputs = step(sched)
    assert chunk_spans(plan) == [("b", 11, 12, True)]
    assert outputs[0].finish_reason is FinishReason.LENGTH
    assert not sched.has_unfinished_requests()
    assert sched.blocks.pool.num_free_blocks == 64
    assert sched.stats().num_steps == 4


def test_decodes_come_first_then_prefill_chunks() -> None:
    sched = make_scheduler(max_num_batched_tokens=16, long_prefill_token_threshold=8)
    sched.add_request(make_request("a", 20, max_tokens=2))
    sched.add_request(make_request("b", 2, max_tokens=3))
    plan, _ = step(sched)
    assert chunk_spans(plan) == [("a", 0, 8, False), ("b", 0, 2, True)]
    plan, _ = step(sched)
    # b decodes before a's prefill chunk although a was admitted first.
    assert chunk_spans(plan) == [("b", 2, 3, True), ("a", 8, 16, False)]
    plan, _ = step(sched)
    assert chunk_spans(plan) == [("b", 3, 4, True), ("a", 16, 20, True)]


def test_max_num_seqs_caps_admission_and_queued_tokens_are_counted() -> None:
    sched = make_scheduler(max_num_batched_tokens=64, max_num_seqs=2)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 5, max_tokens=2))
    assert sched.stats().num_queued_prefill_tokens == 15
    plan, _ = step(sched)
    assert [c.request_id for c in plan.chunks] == ["r0", "r1"]
    assert (sched.num_running, sched.num_waiting) == (2, 1)
    assert sched.stats().num_queued_prefill_tokens == 5  # r2; the running ones are decoding
    plan, _ = step(sched)
    assert chunk_spans(plan) == [("r0", 5, 6, True), ("r1", 5, 6, True)]
    plan, _ = step(sched)
    assert chunk_spans(plan) == [("r2", 0, 5, True)]


def test_prefix_hit_sets_computed_and_cached_tokens() -> None:
    sched = make_scheduler(prefix_cache=True)
    prompt = list(range(100, 110))
    sched.add_request(make_request("a", prompt, max_tokens=2))
    step(sched)
    step(sched)
    assert sched.take_finished()[0].finish_reason is FinishReason.LENGTH
    assert sched.stats().num_cached_blocks == 2  # tokens 0..7 were full computed blocks
    assert sched.blocks.pool.num_used_blocks == 2

    b = make_request("b", prompt[:8] + [5, 6, 7], max_tokens=1)
    sched.add_request(b)
    plan, _ = step(sched)
    # Block 2 (a's partial block) went to the free-queue tail, so the new block is 3.
    assert chunk_spans(plan) == [("b", 8, 11, True)]
    assert plan.chunks[0].block_ids == (0, 1, 3)
    assert b.num_cached_tokens == 8
    stats = sched.stats()
    assert (stats.prefix_cache_queries_tokens, stats.prefix_cache_hits_tokens) == (10 + 11, 8)


def test_prefix_hit_leaves_one_token_to_compute_and_respects_tenant() -> None:
    sched = make_scheduler(prefix_cache=True)
    prompt = list(range(100, 108))
    sched.add_request(make_request("a", prompt, max_tokens=1))
    step(sched)
    assert sched.stats().num_cached_blocks == 2
    sched.add_request(make_request("same", prompt, max_tokens=1))
    sched.add_request(make_request("other", prompt, max_tokens=1, tenant="t2"))
    plan, _ = step(sched)
    # 8 tokens fully cached, but at most (8 - 1) // 4 = 1 block may be reused: one token must sample.
    assert chunk_spans(plan) == [("same", 4, 8, True), ("other", 0, 8, True)]
    finished = {r.request_id: r for r in sched.take_finished()}
    assert (finished["same"].num_cached_tokens, finished["other"].num_cached_tokens) == (4, 0)


def test_concurrent_requests_share_cached_blocks() -> None:
    """Two requests computing the same prefix at once end up sharing one copy of it (as in SGLang)."""
    sched = make_scheduler(prefix_cache=True, max_num_batched_tokens=32)
    prompt = list(range(200, 212))
    sched.add_request(make_request("a", prompt, max_tokens=3))
    sched.add_request(make_request("b", prompt, max_tokens=3))
    plan, _ = step(sched)
    assert [c.block_ids for c in plan.chunks] == [(0, 1, 2), (3, 4, 5)]
    # a's blocks are cached; b computed the same prefix in the same step, takes the cache's blocks and frees its own.
    assert sched.stats().num_cached_blocks == 3
    assert sched.blocks.pool.num_used_blocks == 3
    sched.add_request(make_request("c", prompt + [9], max_tokens=1))
    plan, _ = step(sched)
    assert chunk_spans(plan) == [("a", 12, 13, True), ("b", 12, 13, True), ("c", 12, 13, True)]
    assert [c.block_ids for c in plan.chunks] == [(0, 1, 2, 6), (0, 1, 2, 7), (0, 1, 2, 8)]
    while sched.has_unfinished_requests():
        step(sched)
    assert sched.blocks.pool.num_used_blocks == sched.stats().num_cached_blocks == 3
    assert sched.blocks.cache.clear() == 3
    assert sched.blocks.pool.num_free_blocks == 64


def test_full_pool_evicts_cache_before_preempting() -> None:
    sched = make_scheduler(num_blocks=4, prefix_cache=True)
    sched.add_request(make_request("a", 9, max_tokens=1))
    step(sched)
    assert sched.stats().num_cached_blocks == 2
    sched.add_request(make_request("b", list(range(500, 515)), max_tokens=1))
    plan, _ = step(sched)
    assert chunk_spans(plan) == [("b", 0, 15, True)] and plan.preempted_ids == ()
    assert sched.stats().num_cached_blocks == 3  # a's blocks were evicted to make room


def test_preemption_picks_most_recent_and_recomputes() -> None:
    sched = make_scheduler(num_blocks=4)
    a, b = make_request("a", 7, max_tokens=10), make_request("b", 7, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    plan, _ = step(sched)
    assert [c.block_ids for c in plan.chunks] == [(0, 1), (2, 3)]
    step(sched)
    sched.add_request(make_request("c", 1, max_tokens=1))
    plan, _ = step(sched)
    # a needs a third block; the pool is full and there is no cache: b (admitted last) goes,
    # and c is not admitted in a step that had to preempt.
    assert chunk_spans(plan) == [("a", 8, 9, True)]
    assert plan.preempted_ids == ("b",)
    assert plan.chunks[0].block_ids == (0, 1, 2)
    assert (b.status, b.num_computed_tokens, b.block_ids, b.num_preemptions) == (RequestStatus.PREEMPTED, 0, [], 1)
    assert b.output_token_ids == [7, 7]  # kept, recomputed later
    assert sched.waiting_request_ids() == ["b", "c"]
    recomputes = []
    while sched.has_unfinished_requests():
        plan, _ = step(sched)
        recomputes += [c for c in plan.chunks if c.request_id == "b" and c.start_pos == 0]
    # b's recompute covers prompt and both kept outputs and samples its third token.
    assert [(c.end_pos, c.samples, c.token_ids) for c in recomputes] == [(9, True, tuple(range(1000, 1007)) + (7, 7))]
    finished = {r.request_id: r for r in sched.take_finished()}
    assert finished["b"].num_output_tokens == 3 and finished["a"].num_output_tokens == 10
    assert sched.stats().num_preemptions == 1


def test_request_being_scheduled_preempts_itself_when_it_is_the_most_recent() -> None:
    sched = make_scheduler(num_blocks=4)
    sched.add_request(make_request("a", 6, max_tokens=5))
    sched.add_request(make_request("b", 8, max_tokens=5))
    step(sched)
    plan, _ = step(sched)
    assert chunk_spans(plan) == [("a", 6, 7, True)]
    assert plan.preempted_ids == ("b",)


def test_preempting_a_victim_withdraws_its_chunk_from_the_plan() -> None:
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=8, long_prefill_token_threshold=4)
    sched.add_request(make_request("a", 12, max_tokens=1))
    sched.add_request(make_request("b", 3, max_tokens=5))
    assert chunk_spans(step(sched)[0]) == [("a", 0, 4, False), ("b", 0, 3, True)]
    assert chunk_spans(step(sched)[0]) == [("b", 3, 4, True), ("a", 4, 8, False)]
    plan, _ = step(sched)
    # b's decode was planned first (taking the last free block) but a, older, needs a block.
    assert chunk_spans(plan) == [("a", 8, 12, True)]
    assert plan.preempted_ids == ("b",)
    assert plan.chunks[0].block_ids == (0, 2, 1)
    assert plan.num_batched_tokens == 4


def test_lone_request_that_cannot_grow_ends_with_error() -> None:
    sched = make_scheduler(num_blocks=2)
    sched.add_request(make_request("a", 7, max_tokens=5))
    step(sched)
    step(sched)
    plan, outputs = step(sched)
    assert plan.chunks == () and plan.finished_ids == ("a",) and outputs == []
    (a,) = sched.take_finished()
    assert a.finish_reason is FinishReason.ERROR and "KV blocks" in a.finish_message
    assert a.output_token_ids == [7, 7]
    assert sched.blocks.pool.num_free_blocks == 2


@pytest.mark.parametrize(
    ("kwargs", "tokens", "reason", "num_outputs"),
    [
        ({"eos_token_id": 3}, [5, 3, 5], FinishReason.STOP, 2),
        ({"eos_token_id": 3, "ignore_eos": True}, [5, 3, 5, 5], FinishReason.LENGTH, 4),
        ({"stop_token_ids": (9,)}, [9], FinishReason.STOP, 1),
        ({}, [5, 5, 5, 5], FinishReason.LENGTH, 4),
        ({"max_model_len": 7, "max_tokens": 100}, [5, 5], FinishReason.LENGTH, 2),
    ],
)
def test_stop_conditions(kwargs: dict, tokens: list[int], reason: FinishReason, num_outputs: int) -> None:
    sched = make_scheduler()
    params = {"max_tokens": 4, **kwargs}
    sched.add_request(make_request("a", 5, **params))
    outputs = []
    while sched.has_unfinished_requests():
        outputs += step(sched, token_for=lambda rid, pos: tokens[pos - 5])[1]
    assert [o.token.token_id for o in outputs] == tokens[:num_outputs]
    assert [o.finish_reason for o in outputs] == [None] * (num_outputs - 1) + [reason]
    (a,) = sched.take_finished()
    assert (a.finish_reason, a.num_output_tokens, a.finished_at) == (reason, num_outputs, 0.0)


def test_first_token_and_finish_times_come_from_now() -> None:
    sched = make_scheduler(max_num_batched_tokens=4)
    sched.add_request(make_request("a", 6, max_tokens=2))
    step(sched, now=1.0)
    step(sched, now=2.0)
    step(sched, now=3.0)
    (a,) = sched.take_finished()
    assert (a.first_scheduled_at, a.first_token_at, a.finished_at) == (1.0, 2.0, 3.0)


def test_abort_between_schedule_and_update_is_ignored_by_update() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 5))
    sched.add_request(make_request("b", 5))
    sched.add_request(make_request("c", 50))  # waits: the 16-token budget is spent
    plan = sched.schedule(0.0)
    assert sched.abort_request("a", now=0.5) is not None
    assert sched.abort_request("a", now=0.6) is None  # idempotent
    aborted_waiting = sched.abort_request("c", now=0.7)
    assert aborted_waiting is not None and aborted_waiting.finish_reason is FinishReason.ABORT
    outputs = sched.update(plan, fake_execute(plan), now=1.0)
    sched.check_invariants()
    assert [o.request_id for o in outputs] == ["b"]
    finished = sched.take_finished()
    assert [(r.request_id, r.finish_reason, r.finished_at) for r in finished] == [
        ("a", FinishReason.ABORT, 0.5), ("c", FinishReason.ABORT, 0.7)]
    assert finished[0].block_ids == [] and sched.get_request("a") is None
    assert sched.blocks.pool.num_used_blocks == 2  # b's
    assert sched.finish_request("b", FinishReason.STOP, now=2.0) is not None
    assert sched.blocks.pool.num_used_blocks == 0 and sched.take_finished()[0].finish_reason is FinishReason.STOP


def test_missing_sampled_token_fails_the_request() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 5))
    plan = sched.schedule(0.0)
    assert sched.update(plan, StepResult(plan.step_id, {"x": SampledToken(1)}), 0.0) == []
    (a,) = sched.take_finished()
    assert a.finish_reason is FinishReason.ERROR and sched.blocks.pool.num_used_blocks == 0


def test_add_request_validation() -> None:
    sched = make_scheduler(num_blocks=4)
    with pytest.raises(InvalidRequestError):
        sched.add_request(make_request("empty", []))
    with pytest.raises(InvalidRequestError):
        sched.add_request(make_request("long", 8, max_model_len=8))
    with pytest.raises(CapacityError):
        sched.add_request(make_request("huge", 17))
    sched.add_request(make_request("ok", 16))
    with pytest.raises(InvalidRequestError):
        sched.add_request(make_request("ok", 3))
    assert sched.num_waiting == 1 and sched.abort_request("unknown", 0.0) is None


def test_same_inputs_give_same_plans() -> None:
    def run() -> list[object]:
        sched = make_scheduler(num_blocks=6, prefix_cache=True, max_num_batched_tokens=8, queue_policy="lpm")
        plans = []
        for i in range(6):
            sched.add_request(make_request(f"r{i}", [1, 2, 3, 4] * (1 + i % 3) + [i], max_tokens=3 + i))
            plans.append(step(sched, now=float(i), token_for=lambda rid, pos: pos % 5)[0])
        while sched.has_unfinished_requests():
            plans.append(step(sched)[0])
        return plans

    assert run() == run()


def test_waiting_request_that_can_never_fit_ends_with_error() -> None:
    # A request that already carries output (as after a preemption) whose recompute needs more
    # blocks than the pool has: with nothing running it would block the queue forever.
    sched = make_scheduler(num_blocks=3)
    stuck = make_request("stuck", 8, max_tokens=10)
    stuck.output_token_ids = [7] * 5
    sched.add_request(stuck)
    sched.add_request(make_request("next", 3, max_tokens=1))
    plan, _ = step(sched)
    assert plan.finished_ids == ("stuck",) and chunk_spans(plan) == [("next", 0, 3, True)]
    assert [(r.request_id, r.finish_reason) for r in sched.take_finished()] == [
        ("stuck", FinishReason.ERROR), ("next", FinishReason.LENGTH)]


def test_scheduler_imports_no_torch_fastapi_or_zmq() -> None:
    code = (
        "import sys, kvbaton.scheduler.local_scheduler, kvbaton.scheduler.queue_policies\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'fastapi', 'zmq'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_request_recomputing_a_cached_prefix_fits_a_pool_of_exactly_its_size() -> None:
    """A request that computes a block the cache already holds (here: one asking for prompt logprobs, which reads
    nothing from the cache) swaps its copy for the cache's, so it never holds a position twice: alone in a pool of
    exactly its size it finishes, where holding both copies made it preempt itself forever."""
    sched = make_scheduler(6, prefix_cache=True, max_num_batched_tokens=16)
    sched.add_request(make_request("a", [100, 101, 102, 103], max_tokens=1))
    step(sched)
    sched.take_finished()  # the block [100..103] is cached
    prompt = [100, 101, 102, 103] + list(range(12))  # 16 tokens; with 6 outputs, 6 blocks: the whole pool
    sched.add_request(Request("b", prompt, SamplingParams(max_tokens=6, prompt_logprobs=1, ignore_eos=True), 0.0))
    for _ in range(20):
        if not sched.has_unfinished_requests():
            break
        step(sched)
    assert not sched.has_unfinished_requests() and sched.stats().num_preemptions == 0
    assert [r.finish_reason for r in sched.take_finished()] == [FinishReason.LENGTH]
    assert sched.blocks.pool.num_used_blocks == sched.stats().num_cached_blocks
