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


def test_each_worker_gets_vllms_series_labelled_by_model_and_engine() -> None:
    metrics = ApiMetrics()
    workers = [{"worker_id": "w0", "num_running": 2, "num_waiting": 1, "num_used_blocks": 6, "num_evictable_blocks": 2,
                "num_blocks": 8, "prefix_cache_queries_tokens": 100, "prefix_cache_hits_tokens": 48,
                "num_preemptions": 3},
               {"worker_id": "w1", "num_running": 0, "num_waiting": 0, "num_used_blocks": 0, "num_blocks": 8}]
    metrics.attach_cluster(lambda: {"workers": workers}, "tiny-random")
    metrics.observe_first_token(1, 0.003, "w0")
    metrics.observe_tokens(2, 0.04, "w0")
    metrics.observe_queue(0.002, "w0")
    metrics.observe_finished("length", 0.7, 100, 48, "w0")
    metrics.observe_first_token(1, 0.2, "w1")
    metrics.observe_finished("stop", 0.3, 10, 0, "w1")
    values = _values(metrics)
    w0, w1 = 'engine="w0",model_name="tiny-random"', 'engine="w1",model_name="tiny-random"'
    assert values[f"vllm:num_requests_running{{{w0}}}"] == 2 and values[f"vllm:num_requests_waiting{{{w0}}}"] == 1
    assert values[f"vllm:kv_cache_usage_perc{{{w0}}}"] == 0.5  # blocks only the cache holds count as free
    assert values[f"vllm:prefix_cache_queries_total{{{w0}}}"] == 100
    assert values[f"vllm:prefix_cache_hits_total{{{w0}}}"] == 48
    assert values[f"vllm:num_preemptions_total{{{w0}}}"] == 3 and values[f"vllm:num_preemptions_total{{{w1}}}"] == 0
    assert values[f"vllm:generation_tokens_total{{{w0}}}"] == 3 and values[f"vllm:generation_tokens_total{{{w1}}}"] == 1
    assert values[f"vllm:prompt_tokens_total{{{w0}}}"] == 100 and values[f"vllm:prompt_tokens_total{{{w1}}}"] == 10
    assert values['vllm:request_success_total{engine="w0",finished_reason="length",model_name="tiny-random"}'] == 1
    assert values['vllm:request_success_total{engine="w1",finished_reason="stop",model_name="tiny-random"}'] == 1
    assert values[f"vllm:time_to_first_token_seconds_count{{{w0}}}"] == 1
    assert values[f"vllm:time_to_first_token_seconds_sum{{{w1}}}"] == 0.2
    assert values[f"vllm:inter_token_latency_seconds_count{{{w0}}}"] == 2
    assert values[f"vllm:e2e_request_latency_seconds_sum{{{w0}}}"] == 0.7
    assert values[f"vllm:request_queue_time_seconds_count{{{w0}}}"] == 1
    # The cluster-wide figures stay under kvbaton:, summed over the workers.
    assert values["kvbaton:generation_tokens_total"] == 4 and values["kvbaton:num_requests_running"] == 2
