"""`LocalScheduler.decode_context_tokens`: a plan of decodes only comes with its context size, priced as plan_s.

A scheduler runs a random sequence of additions, steps (with random sampled tokens, so some requests stop
early on EOS) and aborts; after every `schedule` the figure must be the decodes' context sum exactly when
the plan is all decodes by `BatchShape.of_plan`'s rule (else -1), and price the step as `plan_s` does.
"""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvbaton.core.step import SampledToken, StepPlan, StepResult
from kvbaton.scheduler.local_scheduler import LocalScheduler
from kvbaton.sim.catalog import get_gpu, get_model
from kvbaton.sim.costs import BatchShape, RooflineCostModel
from tests.scheduler.helpers import make_request, make_scheduler

EOS = 2

add_op = st.tuples(st.just("add"), st.integers(1, 10), st.integers(4, 16), st.sampled_from([0, 1]))
step_op = st.tuples(st.just("step"), st.integers(0, 9))
abort_op = st.tuples(st.just("abort"), st.integers(0, 20))
_COSTS = RooflineCostModel(get_model("llama-3-8b"), get_gpu("h100"))


def _check_context(sched: LocalScheduler, plan: StepPlan) -> bool:
    """The figure agrees with BatchShape.of_plan and, when set, prices the plan as plan_s does; True when set."""
    context_tokens = sched.decode_context_tokens
    shape = BatchShape.of_plan(plan)
    if not plan.chunks or shape.prefill_new_tokens:
        assert context_tokens == -1
        return False
    assert shape.num_decodes == len(plan.chunks)
    assert context_tokens == shape.decode_context_tokens == sum(c.start_pos + 1 for c in plan.chunks)
    assert _COSTS.decode_s(len(plan.chunks), context_tokens) == _COSTS.plan_s(plan)
    return True


@settings(max_examples=120, deadline=None, derandomize=True)
@given(
    ops=st.lists(st.one_of(add_op, step_op, step_op, step_op, step_op, step_op, step_op, abort_op),
                 min_size=20, max_size=80),
    num_blocks=st.integers(4, 24),
    prefix_cache=st.booleans(),
    budget=st.sampled_from([2, 16, 64]),
    max_num_seqs=st.integers(1, 4),
)
def test_decode_context_tokens_describe_every_all_decode_plan(ops: list[tuple], num_blocks: int, prefix_cache: bool,
                                                              budget: int, max_num_seqs: int) -> None:
    sched = make_scheduler(num_blocks, prefix_cache=prefix_cache, max_num_batched_tokens=budget,
                           max_num_seqs=max_num_seqs)
    ids: list[str] = []
    num_decode_steps = 0
    now = 0.0
    for op in ops:
        if op[0] == "add":
            prompt = [10 + (i % 3) for i in range(op[1])] if op[3] else [20 + i for i in range(op[1])]
            try:
                sched.add_request(make_request(f"r{len(ids)}", prompt, max_tokens=op[2], eos_token_id=EOS))
            except ValueError:
                pass
            ids.append(f"r{len(ids)}")
        elif op[0] == "abort" and ids:
            sched.abort_request(ids[op[1] % len(ids)], now)
        elif op[0] == "step":
            plan = sched.schedule(now)
            num_decode_steps += _check_context(sched, plan)
            # token 2 (EOS) for some requests at some steps: requests end at varying points
            sampled = {c.request_id: SampledToken(EOS if (op[1] + c.end_pos) % 11 == 0 else 5)
                       for c in plan.chunks if c.samples}
            sched.update(plan, StepResult(plan.step_id, sampled), now)
        sched.take_finished()
        sched.check_invariants()
        now += 1.0
    event(f"decode steps>0={num_decode_steps > 0}")


def test_decode_steps_come_with_their_context() -> None:
    sched = make_scheduler(16, max_num_batched_tokens=16)
    sched.add_request(make_request("a", 5, max_tokens=9))
    sched.add_request(make_request("b", 3, max_tokens=9))
    num_priced_steps = 0
    for n in range(12):
        plan = sched.schedule(float(n))
        if sched.decode_context_tokens >= 0:
            num_priced_steps += 1
            assert sched.decode_context_tokens == sum(c.start_pos + 1 for c in plan.chunks)
        sched.update(plan, StepResult(plan.step_id, {c.request_id: SampledToken(5) for c in plan.chunks}), n)
    # Step 0 prefills both; steps 1-8 decode both (tables growing from free blocks at positions 8 of a and
    # 4, 8 of b), priced as decodes; both finish (max_tokens 9) at step 8, then plans are empty.
    assert num_priced_steps == 8 and sched.decode_context_tokens == -1


def test_a_lone_decode_grows_its_table_from_free_blocks_and_fails_when_the_pool_is_too_small() -> None:
    sched = make_scheduler(3, max_num_batched_tokens=16)  # 3 blocks of 4 tokens
    sched.add_request(make_request("a", 5, max_tokens=20))
    plan = sched.schedule(0.0)  # prefills a: 5 tokens in 2 blocks, the first token sampled
    assert sched.decode_context_tokens == -1
    sched.update(plan, StepResult(plan.step_id, {"a": SampledToken(5)}), 0.0)
    for position in range(5, 12):  # inside block 2, then position 8 opens block 3: the last free one
        plan = sched.schedule(float(position))
        assert [(c.request_id, c.start_pos) for c in plan.chunks] == [("a", position)]
        assert sched.decode_context_tokens == position + 1
        outputs = sched.update(plan, StepResult(plan.step_id, {"a": SampledToken(position)}), float(position))
        assert [(o.request_id, o.token.token_id, o.finish_reason) for o in outputs] == [("a", position, None)]
    assert sched.get_request("a").block_ids == [0, 1, 2] and sched.blocks.pool.num_free_blocks == 0
    # Position 12 needs a fourth block: alone, the request fails.
    plan = sched.schedule(12.0)
    assert sched.decode_context_tokens == -1 and not plan.chunks and plan.finished_ids == ("a",)
    sched.check_invariants()
