"""The steady-decode fast path of `LocalScheduler.schedule` plans exactly what the general path plans.

Two schedulers over identical pools and caches run the same random sequence of additions, steps
(with random sampled tokens, so some requests stop early on EOS) and aborts; one has the fast path
on, the other off. Every plan, every output and every request's state must be identical, and the
fast path must actually have been taken.
"""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvbaton.core.request import Request
from kvbaton.core.step import SampledToken, StepPlan, StepResult
from kvbaton.scheduler.local_scheduler import LocalScheduler
from kvbaton.sim.catalog import get_gpu, get_model
from kvbaton.sim.costs import BatchShape, RooflineCostModel
from tests.scheduler.helpers import make_request, make_scheduler, scheduler_state

EOS = 2

add_op = st.tuples(st.just("add"), st.integers(1, 10), st.integers(4, 16), st.sampled_from([0, 1]))
step_op = st.tuples(st.just("step"), st.integers(0, 9))
abort_op = st.tuples(st.just("abort"), st.integers(0, 20))
_COSTS = RooflineCostModel(get_model("llama-3-8b"), get_gpu("h100"))


def _check_steady_context(sched: LocalScheduler, plan: StepPlan, steady: bool) -> None:
    """`steady_plan_context_tokens` is the decodes' context sum exactly when the plan is all decodes from the
    fast path (BatchShape.of_plan's decode rule), and prices the plan as plan_s does."""
    context_tokens = sched.steady_plan_context_tokens
    if context_tokens < 0:
        return
    assert steady and plan.chunks
    shape = BatchShape.of_plan(plan)
    assert shape.prefill_new_tokens == () and shape.num_decodes == len(plan.chunks)
    assert context_tokens == shape.decode_context_tokens == sum(c.start_pos + 1 for c in plan.chunks)
    assert _COSTS.decode_s(len(plan.chunks), context_tokens) == _COSTS.plan_s(plan)


def fast_and_general(num_blocks: int, prefix_cache: bool, budget: int,
                     max_num_seqs: int) -> tuple[LocalScheduler, LocalScheduler]:
    """Two identical schedulers, the second with the steady-decode fast path off."""
    fast, general = (make_scheduler(num_blocks, prefix_cache=prefix_cache, max_num_batched_tokens=budget,
                                    max_num_seqs=max_num_seqs) for _ in range(2))
    general.steady_fast_path = False
    return fast, general


@settings(max_examples=120, deadline=None, derandomize=True)
@given(
    ops=st.lists(st.one_of(add_op, step_op, step_op, step_op, step_op, step_op, step_op, abort_op),
                 min_size=20, max_size=80),
    num_blocks=st.integers(4, 24),
    prefix_cache=st.booleans(),
    budget=st.sampled_from([2, 16, 64]),
    max_num_seqs=st.integers(1, 4),
)
def test_fast_path_plans_as_the_general_path(ops: list[tuple], num_blocks: int, prefix_cache: bool, budget: int,
                                             max_num_seqs: int) -> None:
    fast, general = fast_and_general(num_blocks, prefix_cache, budget, max_num_seqs)
    ids: list[str] = []
    num_fast_steps = 0
    now = 0.0
    for op in ops:
        plans: list[StepPlan] = []
        for sched in (fast, general):
            if op[0] == "add":
                prompt = [10 + (i % 3) for i in range(op[1])] if op[3] else [20 + i for i in range(op[1])]
                request: Request = make_request(f"r{len(ids)}", prompt, max_tokens=op[2], eos_token_id=EOS)
                try:
                    sched.add_request(request)
                except ValueError:
                    pass
            elif op[0] == "abort" and ids:
                sched.abort_request(ids[op[1] % len(ids)], now)
            elif op[0] == "step":
                steady = (sched is fast and not sched.num_waiting and sched.num_running > 0
                          and sched._plan_steady_decodes() is not None)
                plan = sched.schedule(now)
                plans.append(plan)
                if sched is fast:
                    _check_steady_context(sched, plan, steady)
                # token 2 (EOS) for some requests at some steps: requests end at varying points
                sampled = {c.request_id: SampledToken(EOS if (op[1] + c.end_pos) % 11 == 0 else 5)
                           for c in plan.chunks if c.samples}
                outputs = sched.update(plan, StepResult(plan.step_id, sampled), now)
                plans.append(outputs)  # type: ignore[arg-type]
                num_fast_steps += steady
            sched.take_finished()
            sched.check_invariants()
        if op[0] == "add":
            ids.append(f"r{len(ids)}")
        now += 1.0
        if plans:
            assert plans[0] == plans[2] and plans[1] == plans[3]
        assert scheduler_state(fast, ids) == scheduler_state(general, ids)
    event(f"fast steps>0={num_fast_steps > 0}")


def test_fast_path_is_taken_for_steady_decodes() -> None:
    fast, general = make_scheduler(16, max_num_batched_tokens=16), make_scheduler(16, max_num_batched_tokens=16)
    general.steady_fast_path = False
    for sched in (fast, general):
        sched.add_request(make_request("a", 5, max_tokens=9))
        sched.add_request(make_request("b", 3, max_tokens=9))
    num_fast_steps = num_priced_steps = 0
    for n in range(12):
        num_fast_steps += fast._plan_steady_decodes() is not None
        plans = []
        for sched in (fast, general):
            plan = sched.schedule(float(n))
            plans.append(plan)
            if sched.steady_plan_context_tokens >= 0:
                num_priced_steps += 1
                assert sched.steady_plan_context_tokens == sum(c.start_pos + 1 for c in plan.chunks)
            sched.update(plan, StepResult(plan.step_id, {c.request_id: SampledToken(5) for c in plan.chunks}), n)
        assert plans[0] == plans[1]
    # Step 0 prefills both; from then on both decode, and a step is steady unless a request's next
    # position opens a new block: positions 8 (a) and 4, 8 (b) do, so 11 - 3 steady steps.
    assert num_fast_steps == 8
    # Priced as steady decodes: steps 1, 3, 5, 7. Step 0 prefills, even steps open a block for a or b, and
    # both finish (max_tokens 9) at step 8, after which plans are empty.
    assert num_priced_steps == 4 and general.steady_plan_context_tokens == -1
    assert fast.stats() == general.stats()


def _tokens_for(requests: list[Request], op_arg: int) -> list[SampledToken]:
    """What an executor samples for each decode: EOS at some positions, as the general-path test's tokens."""
    return [SampledToken(EOS if (op_arg + r.num_computed_tokens + 1) % 11 == 0 else 5) for r in requests]


@settings(max_examples=120, deadline=None, derandomize=True)
@given(
    ops=st.lists(st.one_of(add_op, step_op, step_op, step_op, step_op, step_op, step_op, abort_op,
                           st.tuples(st.just("abort_mid_step"), st.integers(0, 20))),
                 min_size=20, max_size=80),
    num_blocks=st.integers(4, 24),
    prefix_cache=st.booleans(),
    budget=st.sampled_from([2, 16, 64]),
    max_num_seqs=st.integers(1, 4),
)
def test_schedule_decodes_steps_as_schedule_and_update(ops: list[tuple], num_blocks: int, prefix_cache: bool,
                                                       budget: int, max_num_seqs: int) -> None:
    """A step through `schedule_decodes` + `update_decodes` whenever it offers one (the simulator's steady decode)
    leaves every request, output, block, step id and statistic as `schedule` + `update` of the same step does,
    also when a request is aborted while the step is in flight."""
    fast, general = fast_and_general(num_blocks, prefix_cache, budget, max_num_seqs)
    ids: list[str] = []
    num_decode_steps = 0
    now = 0.0
    for op in ops:
        outputs = []
        for sched in (fast, general):
            if op[0] == "add":
                prompt = [10 + (i % 3) for i in range(op[1])] if op[3] else [20 + i for i in range(op[1])]
                try:
                    sched.add_request(make_request(f"r{len(ids)}", prompt, max_tokens=op[2], eos_token_id=EOS))
                except ValueError:
                    pass
            elif op[0] == "abort" and ids:
                sched.abort_request(ids[op[1] % len(ids)], now)
            elif op[0] in ("step", "abort_mid_step"):
                arg = op[1]
                decodes = sched.schedule_decodes()
                if decodes is not None:
                    assert sched is fast and [r.request_id for r in decodes] == [r.request_id for r in sched._running]
                    num_decode_steps += 1
                    context_tokens = sched.steady_plan_context_tokens
                    assert context_tokens == sum(r.num_computed_tokens + 1 for r in decodes)
                    if op[0] == "abort_mid_step" and ids:
                        sched.abort_request(ids[arg % len(ids)], now)
                    step_outputs = sched.update_decodes(decodes, _tokens_for(decodes, arg), now)
                else:
                    plan = sched.schedule(now)
                    if op[0] == "abort_mid_step" and ids:
                        sched.abort_request(ids[arg % len(ids)], now)
                    live = {c.request_id: sched.get_request(c.request_id) for c in plan.chunks}
                    sampled = {c.request_id: SampledToken(EOS if (arg + c.end_pos) % 11 == 0 else 5)
                               for c in plan.chunks if c.samples and live[c.request_id] is not None}
                    step_outputs = sched.update(plan, StepResult(plan.step_id, sampled), now)
                outputs.append(step_outputs)
            outputs.append([r.request_id for r in sched.take_finished()])
            sched.check_invariants()
        if op[0] == "add":
            ids.append(f"r{len(ids)}")
        now += 1.0
        assert outputs[: len(outputs) // 2] == outputs[len(outputs) // 2 :]
        assert scheduler_state(fast, ids) == scheduler_state(general, ids)
        assert fast.stats() == general.stats() and fast._step_id == general._step_id
    event(f"decode steps>0={num_decode_steps > 0}")


def test_schedule_decodes_grows_tables_from_free_blocks_and_declines_otherwise() -> None:
    sched = make_scheduler(3, max_num_batched_tokens=16)  # 3 blocks of 4 tokens
    sched.add_request(make_request("a", 5, max_tokens=20))
    assert sched.schedule_decodes() is None  # waiting
    step_id = sched._step_id
    plan = sched.schedule(0.0)  # prefills a: 5 tokens in 2 blocks, the first token sampled
    sched.update(plan, StepResult(plan.step_id, {"a": SampledToken(5)}), 0.0)
    for position, token_id in ((5, 6), (6, 7), (7, 8)):  # inside block 2
        decodes = sched.schedule_decodes()
        assert [r.request_id for r in decodes] == ["a"] and sched.steady_plan_context_tokens == position + 1
        outputs = sched.update_decodes(decodes, [SampledToken(token_id)], float(position))
        assert [(o.request_id, o.token.token_id, o.finish_reason) for o in outputs] == [("a", token_id, None)]
    assert sched._step_id == step_id + 4
    decodes = sched.schedule_decodes()  # position 8 opens block 3: the last free one
    assert decodes is not None and sched.get_request("a").block_ids == [0, 1, 2]
    assert sched.blocks.pool.num_free_blocks == 0
    sched.update_decodes(decodes, [SampledToken(9)], 8.0)
    for position in (9, 10, 11):
        sched.update_decodes(sched.schedule_decodes(), [SampledToken(9)], float(position))
    before = sched._step_id
    assert sched.schedule_decodes() is None and sched._step_id == before  # position 12: no free block
    assert sched.get_request("a").block_ids == [0, 1, 2]
    sched.check_invariants()
    sched.steady_fast_path = False
    assert sched.schedule_decodes() is None
