"""The scheduler's one fast path: a run of quiet decode steps (`quiet_decode_steps`, `advance_quiet_decodes`)
leaves the scheduler exactly as the same steps taken one by one through `schedule` and `update` do, and the run
it allows contains only steps that append one token to every request and nothing more."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvbaton.core.request import RequestStatus
from kvbaton.scheduler.local_scheduler import LocalScheduler

from tests.scheduler.helpers import BLOCK_SIZE, fake_execute, make_request, make_scheduler, scheduler_state


def _token(request_id: str, end_pos: int) -> int:
    return 100 + (end_pos * 7 + len(request_id)) % 50


def _fill(sched: LocalScheduler, prompts: list[int], max_tokens: list[int], shared: int) -> list[str]:
    ids = []
    for i, (n, m) in enumerate(zip(prompts, max_tokens)):
        rid = f"r{i}"
        sched.add_request(make_request(rid, [7] * shared + [1000 + 10 * i + j for j in range(n)], max_tokens=m,
                                       ignore_eos=True))
        ids.append(rid)
    return ids


def _step(sched: LocalScheduler, now: float) -> list[str]:
    """One step through the general path; the ids of the requests it ended."""
    plan = sched.schedule(now)
    sched.update(plan, fake_execute(plan, _token), now)
    return [r.request_id for r in sched.take_finished()]


def _all_decoding(sched: LocalScheduler) -> bool:
    running = sched.queues.running
    return (bool(running) and not sched.queues.waiting
            and all(r.num_uncomputed_tokens == 1 and r.output_token_ids for r in running))


@settings(max_examples=80, deadline=None, derandomize=True)
@given(prompts=st.lists(st.integers(1, 13), min_size=1, max_size=4),
       max_tokens=st.lists(st.integers(1, 30), min_size=4, max_size=4),
       shared=st.sampled_from([0, BLOCK_SIZE, 2 * BLOCK_SIZE + 1]), prefix_cache=st.booleans(),
       limit=st.sampled_from([2, 5, 4096]), warmup=st.integers(0, 6))
def test_a_quiet_run_leaves_the_scheduler_as_its_steps_one_by_one(prompts: list[int], max_tokens: list[int],
                                                                   shared: int, prefix_cache: bool, limit: int,
                                                                   warmup: int) -> None:
    fast, slow = (make_scheduler(96, prefix_cache=prefix_cache, max_num_batched_tokens=32) for _ in range(2))
    ids = _fill(fast, prompts, max_tokens, shared)
    _fill(slow, prompts, max_tokens, shared)
    now = 0.0
    for _ in range(40):  # the same steps on both until every request decodes, then a few more
        if _all_decoding(fast):
            if warmup == 0:
                break
            warmup -= 1
        if not fast.has_unfinished_requests():
            return
        now += 1.0
        assert _step(fast, now) == _step(slow, now)
    if not _all_decoding(fast):
        return
    plan = fast.schedule(now)
    steps = fast.quiet_decode_steps(plan, limit)
    assert 1 <= steps <= limit
    if steps < 2:
        return
    # One by one: the first steps - 1 append a token each and change nothing else; every schedule up to step
    # `steps` plans the same requests' next decode in a block they hold.
    slow_plan = slow.schedule(now)
    assert [c.request_id for c in slow_plan.chunks] == [c.request_id for c in plan.chunks]
    tables = {r.request_id: tuple(r.block_ids) for r in slow.queues.running}
    holds = {rid: (h.num_blocks if h is not None else 0) for rid, h in
             ((rid, slow.blocks.holds.get(rid)) for rid in tables)}
    for i in range(1, steps):
        outputs = slow.update(slow_plan, fake_execute(slow_plan, _token), now + i)
        assert [o.request_id for o in outputs] == list(tables) and all(o.finish_reason is None for o in outputs)
        assert not slow.take_finished()
        assert {rid: (h.num_blocks if h is not None else 0) for rid, h in
                ((rid, slow.blocks.holds.get(rid)) for rid in tables)} == holds, "a block went to the cache"
        slow_plan = slow.schedule(now + i)
        assert {r.request_id: tuple(r.block_ids) for r in slow.queues.running} == tables, "a block was added"
        assert [c.request_id for c in slow_plan.chunks] == list(tables)
    # At once: the same tokens, then step `steps` scheduled as usual.
    tokens = {c.request_id: [_token(c.request_id, c.start_pos + k) for k in range(1, steps)] for c in plan.chunks}
    fast.advance_quiet_decodes(plan, tokens)
    fast_plan = fast.schedule(now + steps - 1)
    assert fast_plan.chunks == slow_plan.chunks and fast_plan.step_id == slow_plan.step_id
    assert fast.decode_context_tokens == slow.decode_context_tokens
    fast.update(fast_plan, fake_execute(fast_plan, _token), now + steps)
    slow.update(slow_plan, fake_execute(slow_plan, _token), now + steps)
    assert scheduler_state(fast, ids) == scheduler_state(slow, ids)
    assert fast.stats() == slow.stats()
    assert [r.request_id for r in fast.take_finished()] == [r.request_id for r in slow.take_finished()]
    fast.check_invariants()
    # Both go on to the end alike.
    while slow.has_unfinished_requests():
        now += steps
        assert _step(fast, now) == _step(slow, now)
    assert scheduler_state(fast, ids) == scheduler_state(slow, ids) and fast.stats() == slow.stats()


def test_no_run_while_a_request_waits_or_before_a_block_boundary() -> None:
    sched = make_scheduler(64, max_num_batched_tokens=32, max_num_seqs=1)
    sched.add_request(make_request("a", 6, max_tokens=20, ignore_eos=True))
    _step(sched, 1.0)  # a's prompt, and its first token: position 6 next, in its second block (slots 4..7)
    plan = sched.schedule(2.0)
    assert sched.quiet_decode_steps(plan, 4096) == 2  # step 2 computes position 7, the block's last slot
    sched.update(plan, fake_execute(plan, _token), 2.0)
    sched.add_request(make_request("b", 3, max_tokens=2, ignore_eos=True))  # waits: max_num_seqs is 1
    plan = sched.schedule(3.0)
    assert [c.request_id for c in plan.chunks] == ["a"] and sched.quiet_decode_steps(plan, 4096) == 1
    assert sched.get_request("b").status is RequestStatus.WAITING  # type: ignore[union-attr]


def test_no_run_past_a_stop_or_for_a_request_that_may_stop_on_eos() -> None:
    sched = make_scheduler(64, max_num_batched_tokens=32)
    sched.add_request(make_request("a", 2 * BLOCK_SIZE, max_tokens=3, ignore_eos=True))
    _step(sched, 1.0)
    plan = sched.schedule(2.0)
    assert sched.quiet_decode_steps(plan, 4096) == 2  # output 1 of 3: step 2's update appends the last
    other = make_scheduler(64, max_num_batched_tokens=32)
    other.add_request(make_request("a", 2 * BLOCK_SIZE, max_tokens=30, eos_token_id=2))
    _step(other, 1.0)
    assert other.quiet_decode_steps(other.schedule(2.0), 4096) == 1
