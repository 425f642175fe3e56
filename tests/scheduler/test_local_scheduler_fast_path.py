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


def _check_steady_context(sched: LocalScheduler, plan: StepPlan) -> None:
    """A plan from the fast path is all decodes (BatchShape.of_plan's decode rule), `steady_plan_context_tokens`
    is their context sum, and it prices the plan as plan_s does."""
    context_tokens = sched.steady_plan_context_tokens
    assert plan.chunks
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
                plan = sched.schedule(now)
                plans.append(plan)
                steady = sched.steady_plan_context_tokens >= 0
                assert not (steady and sched is general), "the general path prices no plan as steady"
                if steady:
                    _check_steady_context(sched, plan)
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
    num_priced_steps = 0
    for n in range(12):
        plans = []
        for sched in (fast, general):
            plan = sched.schedule(float(n))
            plans.append(plan)
            if sched.steady_plan_context_tokens >= 0:
                num_priced_steps += 1
                assert sched.steady_plan_context_tokens == sum(c.start_pos + 1 for c in plan.chunks)
            sched.update(plan, StepResult(plan.step_id, {c.request_id: SampledToken(5) for c in plan.chunks}), n)
        assert plans[0] == plans[1]
    # Step 0 prefills both; steps 1-8 decode both (tables growing from free blocks at positions 8 of a and
    # 4, 8 of b), steady and priced as decodes; both finish (max_tokens 9) at step 8, then plans are empty.
    assert num_priced_steps == 8 and general.steady_plan_context_tokens == -1
    assert fast.stats() == general.stats()


def test_fast_path_grows_tables_from_free_blocks_and_leaves_a_short_pool_to_the_general_path() -> None:
    sched = make_scheduler(3, max_num_batched_tokens=16)  # 3 blocks of 4 tokens
    sched.add_request(make_request("a", 5, max_tokens=20))
    plan = sched.schedule(0.0)  # prefills a: 5 tokens in 2 blocks, the first token sampled
    assert sched.steady_plan_context_tokens == -1
    sched.update(plan, StepResult(plan.step_id, {"a": SampledToken(5)}), 0.0)
    for position in range(5, 12):  # inside block 2, then position 8 opens block 3: the last free one
        plan = sched.schedule(float(position))
        assert [(c.request_id, c.start_pos) for c in plan.chunks] == [("a", position)]
        assert sched.steady_plan_context_tokens == position + 1
        outputs = sched.update(plan, StepResult(plan.step_id, {"a": SampledToken(position)}), float(position))
        assert [(o.request_id, o.token.token_id, o.finish_reason) for o in outputs] == [("a", position, None)]
    assert sched.get_request("a").block_ids == [0, 1, 2] and sched.blocks.pool.num_free_blocks == 0
    # Position 12 needs a fourth block: the general path takes the step (and, alone, fails the request).
    plan = sched.schedule(12.0)
    assert sched.steady_plan_context_tokens == -1 and not plan.chunks and plan.finished_ids == ("a",)
    sched.check_invariants()
