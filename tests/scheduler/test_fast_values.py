"""The hot-path constructors build exactly what the dataclass constructors build."""

from __future__ import annotations

from dataclasses import fields

from kvbaton.core.step import SampledToken, ScheduledChunk, StepPlan, StepResult
from kvbaton.scheduler import fast_values
from kvbaton.scheduler.fast_values import make_chunk, make_plan, make_result


def test_constructors_equal_the_dataclass_constructors() -> None:
    chunk = make_chunk("r1", 7, (42,), (3, 1, 2), True)
    assert chunk == ScheduledChunk("r1", 7, (42,), (3, 1, 2), True) and type(chunk) is ScheduledChunk
    assert hash(chunk) == hash(ScheduledChunk("r1", 7, (42,), (3, 1, 2), True))
    assert chunk.end_pos == 8 and repr(chunk) == repr(ScheduledChunk("r1", 7, (42,), (3, 1, 2), True))
    other = make_chunk("r2", 0, (1, 2, 3), (), False)
    plan = make_plan(5, (chunk, other), 4)
    assert plan == StepPlan(5, (chunk, other), 4) and plan.preempted_ids == () and plan.finished_ids == ()
    full = make_plan(6, (other,), 3, ("r3",), ("r4", "r5"))
    assert full == StepPlan(6, (other,), 3, ("r3",), ("r4", "r5")) and repr(full) == repr(
        StepPlan(6, (other,), 3, ("r3",), ("r4", "r5")))
    sampled = {"r1": SampledToken(9)}
    result = make_result(5, sampled, 0.25)
    assert result == StepResult(5, sampled, 0.25) and result.sampled is sampled


def test_field_lists_are_current() -> None:
    """A field added to a step value must be added to its fast constructor too (import fails otherwise)."""
    assert tuple(f.name for f in fields(ScheduledChunk)) == fast_values.CHUNK_FIELDS
    assert tuple(f.name for f in fields(StepPlan)) == fast_values.PLAN_FIELDS
    assert tuple(f.name for f in fields(StepResult)) == fast_values.RESULT_FIELDS
