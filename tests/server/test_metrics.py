"""ApiMetrics: observations held in plain lists are folded in at every collection of the registry, exactly."""

from __future__ import annotations

from prometheus_client import generate_latest

from kvbaton.server import metrics as metrics_module
from kvbaton.server.metrics import ApiMetrics


def _values(metrics: ApiMetrics) -> dict[str, float]:
    text = generate_latest(metrics.registry).decode()  # straight from the registry, not through render()
    return {name: float(value) for name, value in
            (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
            if not name.endswith("_created")}


def _observe(metrics: ApiMetrics) -> None:
    metrics.observe_first_token(2, 0.003)
    metrics.observe_tokens(3, 0.09)
    metrics.observe_finished("length", 0.7, 100, 64)
    metrics.observe_first_token(1, 0.2)
    metrics.observe_finished("stop", 0.4, 10, 0)
    metrics.observe_finished("error", 0.1, 50, 0)
    metrics.observe_failure("rejected")


def test_collecting_the_registry_folds_every_pending_observation() -> None:
    metrics = ApiMetrics()
    _observe(metrics)
    values = _values(metrics)
    assert values["kvbaton:generation_tokens_total"] == 6
    assert values["kvbaton:time_to_first_token_seconds_count"] == 2
    assert values['kvbaton:time_to_first_token_seconds_bucket{le="0.005"}'] == 1
    assert values["kvbaton:time_to_first_token_seconds_sum"] == 0.003 + 0.2
    assert values["kvbaton:inter_token_latency_seconds_count"] == 3
    assert values['kvbaton:inter_token_latency_seconds_bucket{le="0.025"}'] == 0
    assert values['kvbaton:inter_token_latency_seconds_bucket{le="0.05"}'] == 3  # 0.09 s shared by 3 tokens
    assert values["kvbaton:e2e_request_latency_seconds_count"] == 2  # errors are failures, not latencies
    assert values['kvbaton:request_success_total{finished_reason="length"}'] == 1
    assert values['kvbaton:request_success_total{finished_reason="stop"}'] == 1
    assert values['kvbaton:request_failure_total{reason="error"}'] == 1
    assert values['kvbaton:request_failure_total{reason="rejected"}'] == 1
    assert values["kvbaton:prompt_tokens_total"] == 110
    assert values["kvbaton:prefix_cache_queries_total"] == 110
    assert values["kvbaton:prefix_cache_hits_total"] == 64
    assert _values(metrics) == values  # folding is idempotent: a second scrape reads the same


def test_a_long_pending_list_is_folded_without_a_scrape(monkeypatch: object) -> None:
    monkeypatch.setattr(metrics_module, "_MAX_PENDING", 3)  # type: ignore[attr-defined]
    metrics = ApiMetrics()
    for _ in range(3):
        metrics.observe_finished("length", 0.5, 10, 0)
    assert metrics.request_success.labels(finished_reason="length")._value.get() == 3
    assert metrics.e2e_s._sum.get() == 1.5
