"""Admission control (pure policy): TTFT/TPOT prediction and Mooncake's baseline / early / predicted variants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbaton.core.errors import InvalidRequestError
from kvbaton.router.admission import (ADMISSION_POLICIES, AdmissionPolicy, AdmissionRequest, AdmissionSLO, DecodeLoad,
                                      DecodeSlot, PrefillLoad, create_admission, present_at)


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
    # left is gone by then, so the batch it joins is 10: 20 ms. But the handoff reserves its KV now, while that
    # decode still holds its blocks: predicted refuses on KV as early does.
    predicted = policy("predicted").check_arrival(REQUEST, prefill, decode, now=0.0)
    assert predicted.predicted_tpot_s == pytest.approx(0.020)
    assert not predicted.admitted and predicted.decode_load == pytest.approx(12_100 / 11_000)
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


def test_present_at_advances_and_drops_slots() -> None:
    slots = [DecodeSlot(100, 10, 0.0), DecodeSlot(200, 3, 0.0), DecodeSlot(50, 10, 0.5), DecodeSlot(70, 10, 2.0),
             DecodeSlot(80, 10)]
    # 1 s at 0.1 s a step: the first made 10 steps (gone: 10 left), the second is gone, the third arrived at
    # 0.5 s and made 5 steps, the fourth has not arrived, the fifth (unknown arrival) is kept unadvanced.
    assert present_at(slots, 0.1, 0.95) == [DecodeSlot(109, 1, 0.0), DecodeSlot(54, 6, 0.0), DecodeSlot(80, 10)]
    assert present_at(slots, 0.1, 1.0) == [DecodeSlot(55, 5, 0.0), DecodeSlot(80, 10)]


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
