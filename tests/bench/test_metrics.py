"""Metric functions on small hand-built timelines; the expected values are worked out in comments."""

from __future__ import annotations

import pytest

from kvbaton.bench.metrics import (
    SLO, GoodputSearch, Summary, jain_index, latency_stats, max_goodput_rate, pool_goodput_per_gpu, summarize,
)
from kvbaton.bench.records import RequestRecord
from kvbaton.core.errors import InvalidRequestError


def done(rid: str, arrival_s: float, token_times_s: tuple[float, ...], *, slo_class: str = "A", prompt_tokens: int = 10,
         cached_tokens: int | None = None, queue_s: float | None = None, transfer_bytes: int = 0) -> RequestRecord:
    return RequestRecord(request_id=rid, arrival_s=arrival_s, slo_class=slo_class, prompt_tokens=prompt_tokens,
                         cached_tokens=cached_tokens, output_tokens=len(token_times_s), first_token_s=token_times_s[0],
                         token_times_s=token_times_s, finish_s=token_times_s[-1], queue_s=queue_s,
                         transfer_bytes=transfer_bytes)


def timeline() -> list[RequestRecord]:
    return [
        # ttft 1.0, tpot (2.0-1.0)/2 = 0.5, itls 0.5 0.5, e2e 2.0
        done("r1", 0.0, (1.0, 1.5, 2.0), slo_class="A", prompt_tokens=100, cached_tokens=60, queue_s=0.5,
             transfer_bytes=1000),
        # ttft 0.5, tpot 0.2, itl 0.2, e2e 0.7
        done("r2", 1.0, (1.5, 1.7), slo_class="B", prompt_tokens=50, cached_tokens=0, queue_s=0.1),
        # ttft 2.0, no tpot (one token), e2e 2.0
        done("r3", 2.0, (4.0,), slo_class="A", prompt_tokens=10),
        RequestRecord(request_id="r4", arrival_s=3.0, status="rejected", reason="overloaded", slo_class="B",
                      prompt_tokens=20, finish_s=3.0),
    ]


SLO_1 = SLO(ttft_s=1.0, tpot_s=0.3)


def test_record_derived_latencies() -> None:
    r1 = timeline()[0]
    assert r1.ttft_s == 1.0
    assert r1.tpot_s == 0.5
    assert r1.itls_s == (0.5, 0.5)
    assert r1.e2e_s == 2.0
    assert timeline()[2].tpot_s is None


def test_latency_stats_interpolate_linearly() -> None:
    stats = latency_stats([1.0, 0.5, 2.0])
    assert stats.count == 3
    assert stats.mean_s == pytest.approx(3.5 / 3)
    assert stats.p50_s == pytest.approx(1.0)
    # sorted [0.5, 1, 2]; p90 sits at rank 0.9*2 = 1.8 -> 1 + 0.8*(2-1)
    assert stats.p90_s == pytest.approx(1.8)
    assert stats.p99_s == pytest.approx(1.98)
    assert stats.max_s == 2.0
    assert latency_stats([]).mean_s is None


def test_summarize_overall_exact() -> None:
    summary = summarize(timeline(), SLO_1, num_gpus=2)
    o = summary.overall
    assert (o.num_requests, o.num_completed, o.num_rejected, o.num_failed) == (4, 3, 1, 0)
    assert o.reasons == {"overloaded": 1}
    # duration: first arrival 0 -> last finish 4.0
    assert summary.duration_s == 4.0
    assert o.ttft.mean_s == pytest.approx((1.0 + 0.5 + 2.0) / 3)
    assert o.tpot.mean_s == pytest.approx((0.5 + 0.2) / 2)
    assert o.itl.mean_s == pytest.approx((0.5 + 0.5 + 0.2) / 3)
    assert o.itl.p50_s == pytest.approx(0.5)
    assert o.e2e.mean_s == pytest.approx((2.0 + 0.7 + 2.0) / 3)
    # TTFT met by r1 (1.0 <= 1.0) and r2; TPOT by r2 (0.2) and r3 (no TPOT); both only by r2;
    # the rejected r4 counts as a miss: denominators are 4.
    assert o.ttft_attainment == 0.5
    assert o.tpot_attainment == 0.5
    assert o.slo_attainment == 0.25
    assert o.goodput_rps == pytest.approx(1 / 4.0)
    assert summary.goodput_per_gpu_rps == pytest.approx(1 / 4.0 / 2)
    assert o.throughput_rps == pytest.approx(3 / 4.0)
    assert o.output_tokens_per_s == pytest.approx((3 + 2 + 1) / 4.0)
    # hit ratio over completed requests that reported cached tokens: (60 + 0) / (100 + 50)
    assert o.cache_hit_ratio == pytest.approx(0.4)
    assert o.cached_tokens == 60
    assert o.queue.mean_s == pytest.approx((0.5 + 0.1) / 2)
    assert o.execution.mean_s == pytest.approx(((2.0 - 0.5) + (0.7 - 0.1)) / 2)
    assert o.transfer_bytes == 1000


def test_summarize_per_class_and_fairness() -> None:
    summary = summarize(timeline(), SLO_1)
    assert list(summary.per_class) == ["A", "B"]
    a, b = summary.per_class["A"], summary.per_class["B"]
    assert (a.ttft_attainment, a.tpot_attainment, a.slo_attainment) == (0.5, 0.5, 0.0)
    assert (b.ttft_attainment, b.tpot_attainment, b.slo_attainment) == (0.5, 0.5, 0.5)
    assert b.goodput_rps == pytest.approx(1 / 4.0)
    # slowdown = e2e / (ttft_slo + (n-1) * tpot_slo): r1 2.0/1.6, r3 2.0/1.0, r2 0.7/1.3
    slow_a = (2.0 / 1.6 + 2.0 / 1.0) / 2
    slow_b = 0.7 / 1.3
    assert a.mean_slowdown == pytest.approx(slow_a)
    assert a.max_slowdown == pytest.approx(2.0)
    assert b.mean_slowdown == pytest.approx(slow_b)
    assert summary.jain_fairness == pytest.approx((slow_a + slow_b) ** 2 / (2 * (slow_a ** 2 + slow_b ** 2)))
    assert summary.max_class_slowdown == pytest.approx(slow_a)
    assert summary.overall.max_slowdown == pytest.approx(2.0)


def test_summarize_without_slo_uses_queue_for_slowdown() -> None:
    summary = summarize(timeline())
    assert summary.overall.slo_attainment is None and summary.overall.goodput_rps is None
    # only r1 (2.0 / 1.5) and r2 (0.7 / 0.6) report their queueing delay
    assert summary.per_class["A"].mean_slowdown == pytest.approx(2.0 / 1.5)
    assert summary.per_class["B"].mean_slowdown == pytest.approx(0.7 / 0.6)


def test_jain_index() -> None:
    assert jain_index([2.0, 2.0, 2.0]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0, 0.0]) == pytest.approx(1 / 3)
    assert jain_index([1.0, 3.0]) == pytest.approx(16 / (2 * 10))
    with pytest.raises(InvalidRequestError):
        jain_index([])


def test_pool_goodput_formula_seed_000() -> None:
    # min(2 * 5.6, 1 * 10) / (2 + 1) = 10 / 3 req/s per GPU
    assert pool_goodput_per_gpu(2, 1, 5.6, 10) == pytest.approx(10 / 3)
    # prefill-bound: min(1 * 5.6, 2 * 10) / 3
    assert pool_goodput_per_gpu(1, 2, 5.6, 10) == pytest.approx(5.6 / 3)


def _synthetic_run(rate: float) -> list[RequestRecord]:
    # Request i has TTFT (i+1)/100 * rate/10, so with a 1 s TTFT SLO the attainment is
    # min(1, floor(1000/rate)/100): it reaches 90 % exactly up to rate 1000/90 = 11.11 req/s.
    return [done(f"r{i}", 0.0, ((i + 1) / 100 * rate / 10,)) for i in range(100)]


def test_max_goodput_rate_bisection() -> None:
    result = max_goodput_rate(_synthetic_run, SLO(1.0, 1.0), attainment=0.9, low=1.0, high=100.0, tol=0.01)
    assert isinstance(result, GoodputSearch)
    assert 1000 / 90 - 0.01 <= result.rate_rps <= 1000 / 90
    assert not result.capped
    assert [p.met for p in result.probes[:2]] == [True, False]
    rates_met = [p.rate_rps for p in result.probes if p.met]
    rates_missed = [p.rate_rps for p in result.probes if not p.met]
    assert max(rates_met) < min(rates_missed)


def test_max_goodput_rate_edges_and_summary_input() -> None:
    slo = SLO(1.0, 1.0)
    assert max_goodput_rate(_synthetic_run, slo, low=50.0, high=100.0).rate_rps == 0.0
    capped = max_goodput_rate(lambda r: summarize(_synthetic_run(r), slo), slo, low=1.0, high=5.0)
    assert capped.capped and capped.rate_rps == 5.0
    with pytest.raises(InvalidRequestError):
        max_goodput_rate(lambda r: summarize(_synthetic_run(r)), slo, low=1.0, high=5.0)


def test_summary_to_dict_is_json_ready() -> None:
    import json

    data = summarize(timeline(), SLO_1).to_dict()
    text = json.dumps(data)
    assert json.loads(text)["per_class"]["B"]["num_rejected"] == 1
    assert isinstance(summarize([], SLO_1), Summary)
