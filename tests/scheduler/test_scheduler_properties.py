"""Random add/schedule/update/abort/finish sequences against a small pool keep every invariant.

After each operation the scheduler, pool and cache invariants hold and each plan respects the
budget; once every request has ended, every block is free or held by the prefix cache alone,
and clearing the cache frees the whole pool.
"""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvbaton.core.errors import CapacityError
from kvbaton.core.request import FinishReason, Request
from kvbaton.core.step import SampledToken, StepPlan, StepResult
from kvbaton.scheduler.local_scheduler import LocalScheduler
from tests.scheduler.helpers import BLOCK_SIZE, make_request, make_scheduler

EOS = 2
PREFIXES = ([1, 3, 5, 7, 9, 11, 13, 15], [1, 3, 5, 7, 4, 4, 4, 4], [8, 8, 8, 8, 8, 8, 8, 8])

add_op = st.tuples(
    st.just("add"),
    st.sampled_from(range(len(PREFIXES))),
    st.integers(0, 8),  # prefix tokens kept
    st.lists(st.integers(3, 6), min_size=1, max_size=10),  # suffix
    st.integers(1, 20),  # max_tokens
    st.sampled_from(["", "t2"]),
    st.integers(10, 48),  # max_model_len
)
step_op = st.tuples(st.just("step"), st.lists(st.integers(0, 15), min_size=8, max_size=8))
abort_op = st.tuples(st.just("abort"), st.integers(0, 30), st.booleans())  # in the middle of a step?
finish_op = st.tuples(st.just("finish"), st.integers(0, 30))


def _check_plan(sched: LocalScheduler, plan: StepPlan) -> None:
    config = sched.config
    assert plan.num_batched_tokens == sum(c.num_tokens for c in plan.chunks) <= config.max_num_batched_tokens
    ids = [c.request_id for c in plan.chunks]
    assert len(set(ids)) == len(ids) <= config.max_num_seqs
    for c in plan.chunks:
        request = sched.get_request(c.request_id)
        assert request is not None and request.num_computed_tokens == c.start_pos
        assert list(c.block_ids) == request.block_ids
        assert len(c.block_ids) * BLOCK_SIZE >= c.end_pos
        assert c.samples == (c.end_pos == request.num_tokens)
        assert c.token_ids == tuple(request.all_token_ids[c.start_pos : c.end_pos])
        if config.long_prefill_token_threshold:
            assert c.num_tokens <= config.long_prefill_token_threshold


def _check_all(sched: LocalScheduler) -> None:
    sched.check_invariants()
    sched.blocks.pool.check_invariants()
    if sched.blocks.cache is not None:
        sched.blocks.cache.check_invariants()


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    ops=st.lists(st.one_of(add_op, add_op, step_op, step_op, step_op, abort_op, finish_op), min_size=5, max_size=60),
    num_blocks=st.integers(3, 8),
    prefix_cache=st.booleans(),
    policy=st.sampled_from(["fcfs", "lpm", "preble"]),
    budget=st.sampled_from([4, 7, 16, 64]),
    threshold=st.sampled_from([0, 3, 8]),
    max_num_seqs=st.integers(1, 4),
)
def test_random_operations_keep_invariants(
    ops: list[tuple], num_blocks: int, prefix_cache: bool, policy: str, budget: int, threshold: int,
    max_num_seqs: int,
) -> None:
    sched = make_scheduler(num_blocks, prefix_cache=prefix_cache, max_num_batched_tokens=budget,
                           long_prefill_token_threshold=threshold, queue_policy=policy, max_num_seqs=max_num_seqs)
    added: list[str] = []
    requests: dict[str, Request] = {}
    finished: list[str] = []
    num_outputs: dict[str, int] = {}
    now = 0.0

    def run_step(tokens: list[int], abort_index: int | None = None) -> None:
        nonlocal now
        now += 1.0
        plan = sched.schedule(now)
        _check_plan(sched, plan)
        if abort_index is not None and plan.chunks:
            sched.abort_request(plan.chunks[abort_index % len(plan.chunks)].request_id, now)
        sampled = {c.request_id: SampledToken(tokens[i % len(tokens)]) for i, c in enumerate(plan.chunks) if c.samples}
        for out in sched.update(plan, StepResult(plan.step_id, sampled), now):
            num_outputs[out.request_id] = num_outputs.get(out.request_id, 0) + 1
        finished.extend(r.request_id for r in sched.take_finished())
        _check_all(sched)

    for op in ops:
        if op[0] == "add":
            _, prefix, keep, suffix, max_tokens, tenant, max_model_len = op
            prompt = PREFIXES[prefix][:keep] + suffix
            rid = f"r{len(added)}"
            request = make_request(rid, prompt, max_tokens=max_tokens, tenant=tenant, eos_token_id=EOS,
                                   max_model_len=max_model_len)
            try:
                sched.add_request(request)
                added.append(rid)
                requests[rid] = request
            except (CapacityError, ValueError):
                assert not prompt or len(prompt) >= max_model_len or -(-len(prompt) // BLOCK_SIZE) > num_blocks
        elif op[0] == "step":
            run_step(op[1])
        elif op[0] == "abort" and op[2]:
            run_step([5], abort_index=op[1])
        elif added:
            rid = added[op[1] % len(added)]
            if op[0] == "abort":
                sched.abort_request(rid, now)
            else:
                sched.finish_request(rid, FinishReason.STOP, now)
            finished.extend(r.request_id for r in sched.take_finished())
            _check_all(sched)

    for _ in range(400):
        if not sched.has_unfinished_requests():
            break
        run_step([4, 6, 3])
    assert not sched.has_unfinished_requests(), "requests never finished"

    assert sorted(finished) == sorted(added)  # each request reported exactly once
    for rid, request in requests.items():
        assert num_outputs.get(rid, 0) == request.num_output_tokens  # every token was streamed once
        if request.finish_reason is FinishReason.LENGTH:
            sampling = request.sampling
            assert request.num_output_tokens == sampling.max_tokens or request.num_tokens == request.max_model_len
        assert request.num_output_tokens <= request.sampling.max_tokens
        assert request.num_tokens <= request.max_model_len
        event(f"finish={request.finish_reason.value}")
    event(f"preemptions>0={sched.stats().num_preemptions > 0}")
    event(f"requests>=3={len(added) >= 3}")
    pool = sched.blocks.pool
    cache = sched.blocks.cache
    num_cached = cache.num_cached_blocks if cache is not None else 0
    assert pool.num_used_blocks == num_cached
    assert all(pool.ref_count(b) in (0, 1) for b in range(pool.num_blocks))
    if cache is not None:
        cache.clear()
        cache.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks
    stats = sched.stats()
    assert (stats.num_waiting, stats.num_running, stats.num_queued_prefill_tokens) == (0, 0, 0)
