"""Admission control (pure policy): TTFT/TPOT prediction and Mooncake's baseline / early / predicted variants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbaton.core.errors import InvalidRequestError
from kvbaton.router.admission import (ADMISSION_POLICIES, AdmissionPolicy, AdmissionRequest, AdmissionSLO, DecodeLoad,
                                      DecodeSlot, PrefillLoad, create_admission)


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


def test_decode_kv_full_now_but_draining_before_arrival() -> None:
    # 9 decodes of 1,000 context + 100 remaining on a 11,000-token worker: with this request's 1,100 the
    # reservation is 11,000 / 11,000 = 1.0 (admitted); one more decoding request makes it 1.1.
    decoding = tuple(DecodeSlot(1000, 100) for _ in range(9)) + (DecodeSlot(1090, 10),)
    decode = DecodeLoad("d0", decoding, (), 11_000)
    prefill = PrefillLoad("p0", 0)
    early = policy("early").check_arrival(REQUEST, prefill, decode, now=0.0)
    assert not early.admitted and early.reason.startswith("decode over capacity")
    assert early.decode_load == pytest.approx(12_100 / 11_000)
    # The request reaches decode after its TTFT (0.11 s); the decode step now is 20 ms, so the request
    # with 10 tokens left (0.2 s) is still there... but with 5 left it is gone by then.
    almost_done = DecodeLoad("d0", decoding[:-1] + (DecodeSlot(1095, 5),), (), 11_000)
    predicted = policy("predicted").check_arrival(REQUEST, prefill, almost_done, now=0.0)
    assert predicted.admitted and predicted.decode_load == pytest.approx(1.0)
    assert not policy("early").check_arrival(REQUEST, prefill, almost_done, now=0.0).admitted
    assert not policy("predicted").check_arrival(REQUEST, prefill, decode, now=0.0).admitted
    # Baseline does not look at decode on arrival; its decode gate comes at handoff.
    assert policy("baseline").check_arrival(REQUEST, prefill, decode, now=0.0).admitted
    for name in ("baseline", "early", "predicted"):  # every variant keeps the decode stage's own gate
        gate = policy(name).check_decode(REQUEST, decode, now=1.0)
        assert not gate.admitted and gate.reason.startswith("decode over capacity")
    assert policy("none").check_decode(REQUEST, decode, now=1.0).admitted
    assert policy("early").check_decode(REQUEST, DecodeLoad("d0", decoding[:-1], (), 11_000), now=1.0).admitted


def test_only_predicted_sees_requests_still_prefilling() -> None:
    incoming = tuple(DecodeSlot(1000, 100) for _ in range(10))
    decode = DecodeLoad("d0", (), incoming, 11_000)
    assert not policy("predicted").check_arrival(REQUEST, PrefillLoad("p0", 0), decode, now=0.0).admitted
    assert policy("predicted").check_arrival(REQUEST, PrefillLoad("p0", 0), DecodeLoad("d0", (), incoming[:9], 11_000),
                                             now=0.0).admitted
    # Early, and the decode gate, read the decode worker's own state: empty, so both admit.
    assert policy("early").check_arrival(REQUEST, PrefillLoad("p0", 0), decode, now=0.0).admitted
    assert policy("early").check_decode(REQUEST, decode, now=1.0).admitted


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
