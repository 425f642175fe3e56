"""Admission control (pure policy): TTFT/TPOT prediction and Mooncake's baseline / early / predicted variants."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbaton.core.errors import InvalidRequestError
from kvbaton.router.admission import (ADMISSION_POLICIES, AdmissionPolicy, AdmissionRequest, AdmissionSLO, DecodeLoad,
                                      DecodeSlot, PrefillLoad, create_admission, predict_ttft_s,
                                      present_at, queue_drain_s)


class LinearTimes:
    """prefill: 10 ms + 0.1 ms per token; decode step: 10 ms + 1 ms per sequence (context ignored)."""

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        return 0.010 + 1e-4 * new_tokens

    def decode_s(self, num_seqs: int, context_tokens: int) -> float:
        return 0.010 + 0.001 * num_seqs


SLO = AdmissionSLO(ttft_s=0.5, tpot_s=0.1)
TIMES = {"p0": LinearTimes(), "d0": LinearTimes()}
REQUEST = AdmissionRequest("r1", num_prompt_tokens=1000, num_output_tokens=100)


def policy(name: str) -> AdmissionPolicy:
    return AdmissionPolicy(name, SLO, TIMES)


def idle_decode(capacity: int = 100_000) -> DecodeLoad:
    return DecodeLoad("d0", (), (), capacity)


def test_ttft_prediction_drains_the_queue_first() -> None:
    p = policy("baseline")
    assert p.predict_ttft_s(REQUEST, PrefillLoad("p0", 0)) == pytest.approx(0.110)
    assert p.predict_ttft_s(REQUEST, PrefillLoad("p0", 2000)) == pytest.approx(0.310)
    cached = AdmissionRequest("r2", 1000, 100, num_cached_tokens=600)
    assert p.predict_ttft_s(cached, PrefillLoad("p0", 0)) == pytest.approx(0.050)


@pytest.mark.parametrize("name", ["baseline", "early", "predicted"])
def test_every_variant_refuses_an_overloaded_prefill_with_a_reason(name: str) -> None:
    decision = policy(name).check_arrival(REQUEST, PrefillLoad("p0", 5000), idle_decode(), now=0.0)
    assert not decision.admitted
    assert decision.reason.startswith("prefill over capacity")
    assert decision.predicted_ttft_s == pytest.approx(0.610)
    assert decision.prefill_load == pytest.approx(1.22)
    admitted = policy(name).check_arrival(REQUEST, PrefillLoad("p0", 1000), idle_decode(), now=0.0)
    assert admitted.admitted and admitted.reason == ""


def test_none_admits_everything() -> None:
    decision = policy("none").check_arrival(REQUEST, PrefillLoad("p0", 10**6), idle_decode(10), now=0.0)
    assert decision.admitted
    assert create_admission("none", SLO, TIMES) is None
    assert isinstance(create_admission("early", SLO, TIMES), AdmissionPolicy)


def test_decode_kv_full_now_is_full_for_every_variant_but_the_batch_drains() -> None:
    # 9 decodes of 1,000 context + 100 remaining on a 11,000-token worker: with this request's 1,100 the
    # reservation is 11,000 / 11,000 = 1.0 (admitted); one more decoding request makes it 1.1.
    decoding = tuple(DecodeSlot(1000, 100) for _ in range(9)) + (DecodeSlot(1095, 5),)
    decode = DecodeLoad("d0", decoding, (), 11_000)
    prefill = PrefillLoad("p0", 0)
    early = policy("early").check_arrival(REQUEST, prefill, decode, now=0.0)
    assert not early.admitted and early.reason.startswith("decode over capacity")
    assert early.decode_load == pytest.approx(12_100 / 11_000)
    assert early.predicted_tpot_s == pytest.approx(0.021)  # 11 sequences
    # The request reaches decode after its TTFT (0.11 s); at 20 ms a step (10 sequences) the one with 5 tokens
    # left is gone by then, so the batch it joins is 10: 20 ms. But the handoff reserves its prompt's blocks now,
    # while the running decodes hold theirs until they end (11,000 in full): 12,000 > 11,000, refused on KV too.
    predicted = policy("predicted").check_arrival(REQUEST, prefill, decode, now=0.0)
    assert predicted.predicted_tpot_s == pytest.approx(0.020)
    assert not predicted.admitted and predicted.decode_load == pytest.approx(12_000 / 11_000)
    # Baseline does not look at decode on arrival; its decode gate comes at handoff.
    assert policy("baseline").check_arrival(REQUEST, prefill, decode, now=0.0).admitted
    for name in ("baseline", "early", "predicted"):  # every variant keeps the decode stage's own gate
        gate = policy(name).check_decode(REQUEST, decode, now=1.0)
        assert not gate.admitted and gate.reason.startswith("decode over capacity")
    assert policy("none").check_decode(REQUEST, decode, now=1.0).admitted
    assert policy("early").check_decode(REQUEST, DecodeLoad("d0", decoding[:-1], (), 11_000), now=1.0).admitted


def test_predicted_prices_the_batch_the_request_meets_at_decode() -> None:
    # TPOT SLO 100 ms; a step is 10 ms + 1 ms per sequence: 91 sequences make 101 ms. 95 requests bound for the
    # decode worker with 1 token left to generate (context 10, KV is no constraint here).
    fast = DecodeSlot(10, 1, arrives_in_s=0.0)
    prefill = PrefillLoad("p0", 0)  # TTFT 0.11 s
    wide = 10**9

    def predicted(incoming: tuple[DecodeSlot, ...]) -> float:
        decision = policy("predicted").check_arrival(REQUEST, prefill, DecodeLoad("d0", (), incoming, wide), 0.0)
        assert decision.admitted == (decision.predicted_tpot_s <= 0.1)
        return decision.predicted_tpot_s

    # They reach decode now and, at 100 ms a step (96 sequences, capped by the SLO), are done after one step
    # (0.1 s), before this request arrives (0.11 s): it decodes alone.
    assert predicted((fast,) * 95) == pytest.approx(0.011)
    # Reaching decode at 0.05 s they are still decoding at 0.11 s: 96 sequences, 106 ms, refused.
    assert predicted((DecodeSlot(10, 1, arrives_in_s=0.05),) * 95) == pytest.approx(0.106)
    # Reaching decode after this request (their prefill queue is longer) they are not in its first batch.
    assert predicted((DecodeSlot(10, 1, arrives_in_s=0.2),) * 95) == pytest.approx(0.011)
    # Arrival unknown: counted there (the conservative reading).
    assert predicted((DecodeSlot(10, 1),) * 95) == pytest.approx(0.106)
    # Early reads the decode worker's batch now: empty, so it admits (only held prompt blocks count for its KV).
    early = policy("early").check_arrival(REQUEST, prefill, DecodeLoad("d0", (), (fast,) * 95, wide), 0.0)
    assert early.admitted and early.predicted_tpot_s == pytest.approx(0.011)


class StepTimes:
    """decode step: `per_seq_s` per sequence, or a constant `fixed_s` (context ignored); no prefill."""

    def __init__(self, per_seq_s: float = 0.0, fixed_s: float = 0.0) -> None:
        self.per_seq_s, self.fixed_s = per_seq_s, fixed_s

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        return 0.0

    def decode_s(self, num_seqs: int, context_tokens: int) -> float:
        return self.fixed_s + self.per_seq_s * num_seqs


class QuadraticPrefill(LinearTimes):
    """prefill: 1 us per token plus 1 us per thousand (query, key) pairs: attention grows with the prompt squared."""

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        return 1e-6 * new_tokens + 1e-9 * new_tokens * (new_tokens / 2 + cached_tokens)


def test_a_prefill_queue_costs_the_sum_of_its_prompts_not_one_prompt_of_their_sum() -> None:
    model = QuadraticPrefill()
    request = AdmissionRequest("r", 2000, 10)
    queue = ((4000, 0), (3000, 1000), (1000, 0))
    expected_s = sum(model.prefill_s(new, ctx) for new, ctx in queue) + model.prefill_s(2000)
    assert predict_ttft_s(model, request, PrefillLoad("p0", 8000, queue)) == pytest.approx(expected_s)
    assert queue_drain_s(model, queue) == pytest.approx(expected_s - model.prefill_s(2000))
    # Priced as one 10,000-token prompt the quadratic term is three times larger.
    as_one_s = predict_ttft_s(model, request, PrefillLoad("p0", 8000))
    assert as_one_s == pytest.approx(model.prefill_s(10_000)) and as_one_s > 1.5 * expected_s


def test_predicted_needs_room_now_for_the_prompt_and_at_arrival_for_the_whole() -> None:
    # 8 decodes of 1,000 + 100 and one of 1,000 + 5 (9,805 tokens reserved in full) on a 10,850-token worker.
    decoding = tuple(DecodeSlot(1000, 100) for _ in range(8)) + (DecodeSlot(1000, 5),)
    decode = DecodeLoad("d0", decoding, (), 10_850)
    prefill = PrefillLoad("p0", 0)  # TTFT 0.11 s
    # Early: 9,805 + this request's 1,100 = 10,905 > 10,850, refused.
    early = policy("early").check_arrival(REQUEST, prefill, decode, now=0.0)
    assert not early.admitted and early.decode_load == pytest.approx(10_905 / 10_850)
    # Predicted: the handoff holds only the prompt until it arrives (now 9,805 + 1,000 = 10,805); by 0.11 s the
    # 5-token decode is gone (5 steps of 19 ms), so on arrival 8 x 1,100 + 1,100 = 9,900 fit: admitted.
    predicted = policy("predicted").check_arrival(REQUEST, prefill, decode, now=0.0)
    assert predicted.admitted and predicted.decode_load == pytest.approx(10_805 / 10_850)
    # Without room for the prompt now it is refused however much frees up later ...
    tight = DecodeLoad("d0", decoding, (), 10_800)
    assert not policy("predicted").check_arrival(REQUEST, prefill, tight, now=0.0).admitted
    # ... unless the handoff reserves late (shortly before its prefill): then only the arrival counts, 9,900.
    late = DecodeLoad("d0", decoding, (), 10_800, reserves_on_arrival=False)
    decision = policy("predicted").check_arrival(REQUEST, prefill, late, now=0.0)
    assert decision.admitted and decision.decode_load == pytest.approx(9_900 / 10_800)


def test_requests_that_have_not_reserved_yet_hold_no_kv() -> None:
    # Late reservation: 10 requests on their way, none has reserved yet. Early and the gate see the worker's KV
    # as it stands: only this request's 1,100 of 11,000 (with them holding their prompts: 11,100, refused); its
    # load is then its step time, 11 ms of the 100 ms TPOT.
    waiting = tuple(DecodeSlot(1000, 100, 5.0, holds_kv=False) for _ in range(10))
    decode = DecodeLoad("d0", (), waiting, 11_000, reserves_on_arrival=False)
    early = policy("early").check_arrival(REQUEST, PrefillLoad("p0", 0), decode, now=0.0)
    assert early.admitted and early.decode_load == pytest.approx(0.11)
    held = DecodeLoad("d0", (), tuple(replace(s, holds_kv=True) for s in waiting), 11_000)
    assert not policy("early").check_arrival(REQUEST, PrefillLoad("p0", 0), held, now=0.0).admitted
    # Predicted: they arrive at 5 s, after this request (0.11 s); not holding KV, they do not count on arrival.
    predicted = policy("predicted").check_arrival(REQUEST, PrefillLoad("p0", 0), decode, now=0.0)
    assert predicted.admitted and predicted.decode_load == pytest.approx(0.11)
    held_late = replace(held, reserves_on_arrival=False)  # reserved already, arriving later: their prompts count
    assert not policy("predicted").check_arrival(REQUEST, PrefillLoad("p0", 0), held_late, now=0.0).admitted


def test_present_at_advances_and_drops_slots() -> None:
    slots = [DecodeSlot(100, 10, 0.0), DecodeSlot(200, 3, 0.0), DecodeSlot(50, 10, 0.5), DecodeSlot(70, 10, 2.0),
             DecodeSlot(80, 10)]
    # 1 s at 0.1 s a step: the first made 10 steps (gone: 10 left), the second is gone, the third arrived at
    # 0.5 s and made 5 steps, the fourth has not arrived, the fifth (unknown arrival) is kept unadvanced.
    fixed = StepTimes(fixed_s=0.1)
    assert present_at(slots, fixed, 1.0, 0.95) == [DecodeSlot(109, 1, 0.0), DecodeSlot(54, 6, 0.0), DecodeSlot(80, 10)]
    assert present_at(slots, fixed, 1.0, 1.0) == [DecodeSlot(55, 5, 0.0), DecodeSlot(80, 10)]
    # The cap holds every step to at most 50 ms: the first two are gone by 0.5 s, the third made 9 steps since.
    assert present_at(slots, fixed, 0.05, 0.95) == [DecodeSlot(59, 1, 0.0), DecodeSlot(80, 10)]


def test_present_at_follows_the_batch_as_it_changes() -> None:
    # 10 ms per sequence. A (4 left) and B (2 left) decode now, C (5 left) arrives at 50 ms; where is C at 100 ms?
    # 2 steps of 20 ms (A, B): B leaves at 40 ms; 1 step of 10 ms (A): 50 ms, C joins; 1 step of 20 ms (A, C):
    # A leaves at 70 ms; 3 steps of 10 ms (C alone) to 100 ms: C made 4 steps. Pricing every step at the
    # 3-sequence batch (30 ms) would have given C one step.
    slots = [DecodeSlot(100, 4, 0.0), DecodeSlot(100, 2, 0.0), DecodeSlot(100, 5, 0.05)]
    assert present_at(slots, StepTimes(per_seq_s=0.01), 1.0, 0.1) == [DecodeSlot(104, 1, 0.0)]
    # Idle gaps: nothing decodes until C arrives at 50 ms; then 5 steps of 10 ms end it by 100 ms.
    assert present_at(slots[2:], StepTimes(per_seq_s=0.01), 1.0, 0.1) == []
    assert present_at(slots[2:], StepTimes(per_seq_s=0.01), 1.0, 0.09) == [DecodeSlot(104, 1, 0.0)]


def test_requests_on_their_way_hold_prompt_blocks_for_early_and_the_gate() -> None:
    incoming = tuple(DecodeSlot(1000, 100) for _ in range(10))
    prefill = PrefillLoad("p0", 0)
    # Predicted counts their full reservations: 1,100 + 10 x 1,100 > 11,000; with 9 exactly 1.0.
    assert not policy("predicted").check_arrival(REQUEST, prefill, DecodeLoad("d0", (), incoming, 11_000), 0.0).admitted
    nine = policy("predicted").check_arrival(REQUEST, prefill, DecodeLoad("d0", (), incoming[:9], 11_000), 0.0)
    assert nine.admitted and nine.decode_load == pytest.approx(1.0)
    # Early and the decode gate see the decode worker as it stands: the prompt blocks it reserved for them
    # (10 x 1,000) plus this request's 1,100 = 11,100 > 11,000; with 9 of them 10,100.
    for decide in (lambda d: policy("early").check_arrival(REQUEST, prefill, d, now=0.0),
                   lambda d: policy("early").check_decode(REQUEST, d, now=1.0)):
        refused = decide(DecodeLoad("d0", (), incoming, 11_000))
        assert not refused.admitted and refused.decode_load == pytest.approx(11_100 / 11_000)
        assert decide(DecodeLoad("d0", (), incoming[:9], 11_000)).decode_load == pytest.approx(10_100 / 11_000)


def test_tpot_over_slo_is_a_decode_overload() -> None:
    # 95 sequences: step = 10 + 96 ms > 100 ms TPOT.
    decode = DecodeLoad("d0", tuple(DecodeSlot(10, 10_000) for _ in range(95)), (), 10**9)
    decision = policy("early").check_arrival(REQUEST, PrefillLoad("p0", 0), decode, now=0.0)
    assert not decision.admitted
    assert decision.predicted_tpot_s == pytest.approx(0.106)


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(InvalidRequestError):
        AdmissionPolicy("sometimes", SLO, TIMES)
    with pytest.raises(InvalidRequestError):
        AdmissionSLO(0.0, 0.1)
    with pytest.raises(InvalidRequestError):
        policy("early").check_arrival(REQUEST, PrefillLoad("p9", 0), None, now=0.0)
    assert ADMISSION_POLICIES == ("none", "baseline", "early", "predicted")


slots = st.lists(st.builds(DecodeSlot, st.integers(1, 4000), st.integers(0, 500)), max_size=30)


@settings(max_examples=150, deadline=None)
@given(decoding=slots, incoming=slots, queued=st.integers(0, 20_000), capacity=st.integers(1000, 200_000),
       prompt=st.integers(1, 4000), output=st.integers(1, 500))
def test_variants_agree_on_structure(decoding: list[DecodeSlot], incoming: list[DecodeSlot], queued: int,
                                     capacity: int, prompt: int, output: int) -> None:
    request = AdmissionRequest("r", prompt, output)
    prefill = PrefillLoad("p0", queued)
    decode = DecodeLoad("d0", tuple(decoding), tuple(incoming), capacity)
    alone = DecodeLoad("d0", tuple(decoding), (), capacity)
    decisions = {name: policy(name).check_arrival(request, prefill, decode, now=0.0)
                 for name in ("baseline", "early", "predicted")}
    assert len({d.prefill_load for d in decisions.values()}) == 1  # one TTFT prediction for all
    # Without requests in flight to decode, predicted only removes decodes that finish first.
    assert (policy("predicted").check_arrival(request, prefill, alone, now=0.0).decode_load
            <= decisions["early"].decode_load + 1e-12)
    # Requests in flight only add load.
    assert (decisions["predicted"].decode_load + 1e-12
            >= policy("predicted").check_arrival(request, prefill, alone, now=0.0).decode_load)
    for decision in decisions.values():
        assert decision.admitted == (max(decision.prefill_load, decision.decode_load) <= 1.0)
        assert decision.admitted == (decision.reason == "")
    if decisions["early"].admitted or decisions["predicted"].admitted:
        assert decisions["baseline"].admitted  # baseline refuses at arrival only what the others refuse too
