"""The quiet steady decode step (`advance_quiet_decodes`, then `schedule_decodes_after_quiet`) changes a scheduler
exactly as `update_decodes` and `schedule_decodes` do.

Two schedulers run the same random additions, handed-off admissions, aborts (between steps and while a
step is in flight) and steps. The reference steps through `schedule_decodes` + `update_decodes` (themselves
compared with `schedule` + `update` in `test_local_scheduler_fast_path`), else `schedule` + `update`. The
other drives its decode steps as the simulator does: `advance_quiet_decodes` first, `update_decodes` when it
declines, and after a quiet step `schedule_decodes_after_quiet` instead of `schedule_decodes`. Requests,
blocks, the free queue, step ids, prices and statistics must agree after every operation, a declined quiet
step must change nothing, and a quiet one must be one whose reference outputs end nothing.
"""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvbaton.core.request import Request
from kvbaton.core.step import SampledToken, StepResult
from kvbaton.scheduler.local_scheduler import LocalScheduler
from kvbaton.scheduler.steady_decodes import advance_quiet_decodes, schedule_decodes_after_quiet
from tests.scheduler.helpers import make_request, make_scheduler, scheduler_state

EOS = 2

add_op = st.tuples(st.just("add"), st.integers(1, 10), st.integers(1, 16), st.integers(0, 3))
handoff_op = st.tuples(st.just("handoff"), st.integers(2, 10), st.integers(2, 16), st.integers(0, 3))
step_op = st.tuples(st.just("step"), st.integers(0, 9))
abort_op = st.tuples(st.just("abort"), st.integers(0, 20))
abort_mid_op = st.tuples(st.just("abort_mid_step"), st.integers(0, 20))


def _new_request(request_id: str, op: tuple) -> Request:
    """Stop rules vary with op[3]: EOS honoured (0), ignored (1), a stop token (2), a short context (3)."""
    _, prompt_len, max_tokens, kind = op
    prompt = [10 + (i % 3) for i in range(prompt_len)]
    return make_request(request_id, prompt, max_tokens=max_tokens, eos_token_id=EOS, ignore_eos=kind == 1,
                        stop_token_ids=(7,) if kind == 2 else (), max_model_len=prompt_len + 6 if kind == 3 else 8192)


def _tokens_for(requests: list[Request], arg: int) -> list[SampledToken]:
    """EOS or token 7 at some positions, else 5: some decodes stop early, most do not."""
    tokens = []
    for r in requests:
        position = arg + r.num_computed_tokens + 1
        tokens.append(SampledToken(EOS if position % 11 == 0 else 7 if position % 13 == 0 else 5))
    return tokens


def _snapshot(sched: LocalScheduler, ids: list[str]) -> tuple:
    return (scheduler_state(sched, ids), sched.stats(), sched._step_id, sched.steady_plan_context_tokens,
            [r.request_id for r in sched._finished], [(r.first_token_at, r.finished_at) for r in sched._running])


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    ops=st.lists(st.one_of(add_op, handoff_op, step_op, step_op, step_op, step_op, step_op, step_op, abort_op,
                           abort_mid_op), min_size=20, max_size=90),
    num_blocks=st.integers(4, 24),
    prefix_cache=st.booleans(),
    budget=st.sampled_from([2, 16, 64]),
    max_num_seqs=st.integers(1, 4),
)
def test_quiet_decode_steps_change_the_scheduler_as_update_and_schedule_decodes(
        ops: list[tuple], num_blocks: int, prefix_cache: bool, budget: int, max_num_seqs: int) -> None:
    quiet, reference = (make_scheduler(num_blocks, prefix_cache=prefix_cache, max_num_batched_tokens=budget,
                                       max_num_seqs=max_num_seqs) for _ in range(2))
    ids: list[str] = []
    last_quiet: list[Request] | None = None  # the quiet scheduler's last step, when it was quiet
    last_num_growing = 0
    num_quiet = num_after_quiet = 0
    now = 0.0
    for op in ops:
        reference_outputs = None
        for sched in (reference, quiet):
            if op[0] == "add":
                try:
                    sched.add_request(_new_request(f"r{len(ids)}", op))
                except ValueError:
                    pass
            elif op[0] == "handoff":
                request = _new_request(f"r{len(ids)}", op)
                request.output_token_ids.append(5)  # the prefill worker's first token
                request.first_token_at = now
                sched.admit_prefilled(request, op[1], now)
            elif op[0] == "abort" and ids:
                sched.abort_request(ids[op[1] % len(ids)], now)
            elif op[0] in ("step", "abort_mid_step"):
                arg = op[1]
                if sched is quiet and last_quiet is not None:
                    decodes = schedule_decodes_after_quiet(sched, last_quiet, last_num_growing)
                    num_after_quiet += 1
                    last_quiet = None
                else:
                    decodes = sched.schedule_decodes()
                if decodes is None:
                    plan = sched.schedule(now)
                    if op[0] == "abort_mid_step" and ids:
                        sched.abort_request(ids[arg % len(ids)], now)
                    sampled = {c.request_id: SampledToken(5) for c in plan.chunks
                               if c.samples and sched.get_request(c.request_id) is not None}
                    sched.update(plan, StepResult(plan.step_id, sampled), now)
                else:
                    if op[0] == "abort_mid_step" and ids:
                        sched.abort_request(ids[arg % len(ids)], now)
                        if arg % 2:
                            sched.take_finished()  # as the simulator does when a handoff ends
                    tokens = _tokens_for(decodes, arg)
                    if sched is reference:
                        reference_outputs = sched.update_decodes(decodes, tokens, now)
                    else:
                        before = _snapshot(sched, ids)
                        num_growing = advance_quiet_decodes(sched, decodes, tokens, now)
                        if num_growing >= 0:
                            num_quiet += 1
                            last_quiet, last_num_growing = decodes, num_growing
                            assert num_growing == sum(len(r.block_ids) * sched.block_size <= r.num_computed_tokens
                                                      for r in decodes)
                            # Quiet: the reference advanced the same requests, ending none.
                            assert reference_outputs is not None
                            assert [(o.request_id, o.token, o.finish_reason) for o in reference_outputs] == [
                                (r.request_id, t, None) for r, t in zip(decodes, tokens)]
                            assert not reference._finished
                        else:
                            assert _snapshot(sched, ids) == before  # declined: nothing changed
                            sched.update_decodes(decodes, tokens, now)
            sched.take_finished()
            sched.check_invariants()
        if op[0] in ("add", "handoff"):
            ids.append(f"r{len(ids)}")
        now += 1.0
        # `last_quiet` outlives additions and aborts: the next step must notice them itself.
        assert _snapshot(quiet, ids)[:4] == _snapshot(reference, ids)[:4]
    event(f"quiet steps>0={num_quiet > 0}")
    event(f"scheduled after a quiet step>0={num_after_quiet > 0}")


def test_a_quiet_step_declines_each_stop_rule_and_a_changed_running_list() -> None:
    sched = make_scheduler(64, max_num_batched_tokens=16)
    sched.add_request(make_request("a", 5, max_tokens=4, eos_token_id=EOS))
    sched.add_request(make_request("b", 3, max_tokens=9, stop_token_ids=(9,)))
    plan = sched.schedule(0.0)
    sched.update(plan, StepResult(plan.step_id, {c.request_id: SampledToken(5) for c in plan.chunks}), 0.0)
    decodes = sched.schedule_decodes()
    assert decodes is not None and [r.request_id for r in decodes] == ["a", "b"]
    # b has a stop token id: never quiet, even for another token.
    assert advance_quiet_decodes(sched, decodes, [SampledToken(5), SampledToken(5)], 1.0) == -1
    sched.update_decodes(decodes, [SampledToken(5), SampledToken(5)], 1.0)
    sched.abort_request("b", 1.0)
    sched.take_finished()
    decodes = sched.schedule_decodes()
    assert decodes is not None
    assert advance_quiet_decodes(sched, decodes, [SampledToken(EOS)], 2.0) == -1  # EOS ends a
    # A request that ended during the step and is not yet taken: the caller's general path hands it over.
    handed_off = make_request("h", 4, max_tokens=9)
    handed_off.output_token_ids.append(5)
    assert sched.admit_prefilled(handed_off, 4, 2.0)
    sched.abort_request("h", 2.0)
    assert advance_quiet_decodes(sched, decodes, [SampledToken(5)], 2.0) == -1
    assert [r.request_id for r in sched.take_finished()] == ["h"]
    # a: 3 of 4 tokens, 7 computed; its next decode (position 7) fits its 2-block table (block size 4).
    assert advance_quiet_decodes(sched, decodes, [SampledToken(5)], 2.0) == 0
    assert len(sched.get_request("a").block_ids) == 2 and sched.get_request("a").num_computed_tokens == 7
    assert sched.get_request("a").output_token_ids == [5, 5, 5]
    step_id = sched._step_id
    again = schedule_decodes_after_quiet(sched, decodes, 0)
    assert again == decodes and again is not decodes and sched._step_id == step_id + 1
    assert len(sched.get_request("a").block_ids) == 2
    assert advance_quiet_decodes(sched, again, [SampledToken(5)], 3.0) == -1  # its 4th token is its last
    sched.update_decodes(again, [SampledToken(5)], 3.0)
    assert [r.request_id for r in sched.take_finished()] == ["a"]
    # A running list that changed since the quiet step falls back to schedule_decodes.
    sched.add_request(make_request("c", 4, max_tokens=9))
    assert schedule_decodes_after_quiet(sched, decodes, 0) is None  # c waits: the general path admits it
