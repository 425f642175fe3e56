"""`LocalScheduler.admit_prefilled`: the decode side of a handoff admits a request with its prompt KV computed."""

from __future__ import annotations

import pytest

from kvbaton.core.errors import InvalidRequestError
from kvbaton.core.request import FinishReason, RequestStatus
from tests.scheduler.helpers import make_request, make_scheduler, step


def handed_off(request_id: str, prompt_tokens: int, max_tokens: int, first_token: int = 55):
    request = make_request(request_id, prompt_tokens, max_tokens=max_tokens, ignore_eos=True)
    request.output_token_ids.append(first_token)
    return request


def test_admitted_request_decodes_from_its_first_token_at_once() -> None:
    scheduler = make_scheduler(num_blocks=16)
    request = handed_off("a", 10, max_tokens=3)
    assert scheduler.admit_prefilled(request, 10, now=1.0)
    assert request.status is RequestStatus.RUNNING and request.block_ids == [0, 1, 2]
    assert request.num_computed_tokens == 10 and request.first_scheduled_at == 1.0
    scheduler.check_invariants()
    plan, outputs = step(scheduler, token_for=lambda rid, pos: 8)
    assert [(c.request_id, c.start_pos, c.token_ids, c.samples) for c in plan.chunks] == [("a", 10, (55,), True)]
    assert request.output_token_ids == [55, 8]
    plan, outputs = step(scheduler)
    assert outputs[0].finish_reason is FinishReason.LENGTH and request.num_output_tokens == 3
    assert scheduler.take_finished() == [request]


def test_full_pool_or_seq_cap_refuses_without_side_effects() -> None:
    scheduler = make_scheduler(num_blocks=4, max_num_seqs=8)
    assert scheduler.admit_prefilled(handed_off("a", 12, 4), 12, now=0.0)  # 3 of 4 blocks
    late = handed_off("b", 8, 4)
    assert not scheduler.admit_prefilled(late, 8, now=0.0)
    assert late.block_ids == [] and late.num_computed_tokens == 0 and scheduler.get_request("b") is None
    scheduler.check_invariants()
    capped = make_scheduler(num_blocks=64, max_num_seqs=1)
    assert capped.admit_prefilled(handed_off("a", 4, 4), 4, now=0.0)
    assert not capped.admit_prefilled(handed_off("b", 4, 4), 4, now=0.0)


def test_bad_handoffs_are_rejected() -> None:
    scheduler = make_scheduler()
    with pytest.raises(InvalidRequestError):
        scheduler.admit_prefilled(handed_off("a", 8, 4), 9, now=0.0)  # more computed than known tokens
    scheduler.admit_prefilled(handed_off("a", 8, 4), 8, now=0.0)
    with pytest.raises(InvalidRequestError):
        scheduler.admit_prefilled(handed_off("a", 8, 4), 8, now=0.0)  # duplicate id


def test_preempted_handoff_recomputes_prompt_and_first_token_locally() -> None:
    scheduler = make_scheduler(num_blocks=6, max_num_batched_tokens=32)
    first = handed_off("a", 8, max_tokens=8)
    second = handed_off("b", 8, max_tokens=8)
    assert scheduler.admit_prefilled(first, 8, now=0.0) and scheduler.admit_prefilled(second, 8, now=0.0)
    for _ in range(5):  # at position 12 both need a 4th block: the most recent ("b") is preempted
        plan, _ = step(scheduler)
    assert plan.preempted_ids == ("b",) and second.num_preemptions == 1 and first.num_preemptions == 0
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert first.num_output_tokens == 8 and second.num_output_tokens == 8
