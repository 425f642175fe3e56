"""Hot-path constructors of the frozen step values: the very objects their dataclass `__init__` builds, faster.

A frozen slotted dataclass's generated `__init__` writes each field through `object.__setattr__`
(to get past its own frozen `__setattr__`): ~1.5 us for `ScheduledChunk`'s five fields. The
simulator builds one chunk per decode per step and a plan and a result per step, for every step
of every worker, so these write the slots through their member descriptors instead (about half
the time). The result is an ordinary instance: equal, hashing and printing as one built by
`__init__`. Only valid for classes without `__post_init__` whose every field is passed; the
field lists are checked at import (`kvbaton.cache.fast_init.slot_setters`) and by
`tests/scheduler/test_fast_values.py`, so a field added to a class fails loudly instead of being left unset.
"""

from __future__ import annotations

from kvbaton.cache.fast_init import slot_setters
from kvbaton.core.step import SampledToken, ScheduledChunk, StepPlan, StepResult

CHUNK_FIELDS = ("request_id", "start_pos", "token_ids", "block_ids", "samples")
PLAN_FIELDS = ("step_id", "chunks", "num_batched_tokens", "preempted_ids", "finished_ids")
RESULT_FIELDS = ("step_id", "sampled", "duration_s", "accepted")
_NO_DRAFTS: dict[str, tuple[SampledToken, ...]] = {}  # shared by every result built here; nothing writes to it

_new = object.__new__
_set_request_id, _set_start_pos, _set_token_ids, _set_block_ids, _set_samples = slot_setters(
    ScheduledChunk, CHUNK_FIELDS)
_set_plan_step_id, _set_chunks, _set_num_batched_tokens, _set_preempted_ids, _set_finished_ids = slot_setters(
    StepPlan, PLAN_FIELDS)
_set_result_step_id, _set_sampled, _set_duration_s, _set_accepted = slot_setters(StepResult, RESULT_FIELDS)


def make_chunk(request_id: str, start_pos: int, token_ids: tuple[int, ...], block_ids: tuple[int, ...],
               samples: bool) -> ScheduledChunk:
    """`ScheduledChunk(request_id, start_pos, token_ids, block_ids, samples)`."""
    chunk = _new(ScheduledChunk)
    _set_request_id(chunk, request_id)
    _set_start_pos(chunk, start_pos)
    _set_token_ids(chunk, token_ids)
    _set_block_ids(chunk, block_ids)
    _set_samples(chunk, samples)
    return chunk


def make_plan(step_id: int, chunks: tuple[ScheduledChunk, ...], num_batched_tokens: int,
              preempted_ids: tuple[str, ...] = (), finished_ids: tuple[str, ...] = ()) -> StepPlan:
    """`StepPlan(step_id, chunks, num_batched_tokens, preempted_ids, finished_ids)`."""
    plan = _new(StepPlan)
    _set_plan_step_id(plan, step_id)
    _set_chunks(plan, chunks)
    _set_num_batched_tokens(plan, num_batched_tokens)
    _set_preempted_ids(plan, preempted_ids)
    _set_finished_ids(plan, finished_ids)
    return plan


def make_result(step_id: int, sampled: dict[str, SampledToken], duration_s: float) -> StepResult:
    """`StepResult(step_id, sampled, duration_s)` (no speculative chunks)."""
    result = _new(StepResult)
    _set_result_step_id(result, step_id)
    _set_sampled(result, sampled)
    _set_duration_s(result, duration_s)
    _set_accepted(result, _NO_DRAFTS)
    return result
