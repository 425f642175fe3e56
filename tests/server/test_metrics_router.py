"""Regressions found by a bug hunt in the router's Prometheus /metrics; each test names the bug it guards,
which it showed on the code it was written against."""

from __future__ import annotations

from dataclasses import replace

from prometheus_client.parser import text_string_to_metric_families

from kvbaton.server import rpc
from kvbaton.server.cluster import ClusterConfig, ClusterManager
from kvbaton.server.metrics import ApiMetrics
from tests.server.test_cluster_manager import register


class _Socket:
    def send(self, worker_id: str, message: rpc.Message) -> None:
        return None


def _stats(worker_id: str, num_draft_tokens: int, num_accepted_tokens: int) -> rpc.Stats:
    return replace(rpc.Stats(worker_id, 0, 0, 0, 0, 64, 0, 0, 0, 0, 0, 0.0), num_draft_tokens=num_draft_tokens,
                   num_accepted_tokens=num_accepted_tokens)


def _families(metrics: ApiMetrics) -> dict[str, tuple[str, float]]:
    """name -> (type, value) of the single-sample families."""
    return {family.name: (family.type, family.samples[0].value)
            for family in text_string_to_metric_families(metrics.render().decode()) if len(family.samples) == 1}


# Was a bug: the speculative-decoding totals were gauges summed over the live workers
# (kvbaton:spec_decode_num_draft_tokens, ..._num_accepted_tokens), where vLLM's are counters
# (vllm:spec_decode_num_draft_tokens_total, vllm:spec_decode_num_accepted_tokens_total, read with rate()); and the sum
# dropped whenever a worker left or restarted, which rate() reads as a counter reset. They are now counters that keep
# the counts of workers that left.
def test_spec_decode_totals_are_counters_that_keep_what_departed_workers_counted() -> None:
    cluster = ClusterManager(ClusterConfig(model_name="tiny-random", block_size=4), clock=lambda: 0.0)
    cluster.pool.socket = _Socket()  # type: ignore[assignment]
    metrics = ApiMetrics()
    metrics.attach_cluster(cluster.cluster_info)
    for worker_id, drafts, accepted in (("w0", 40, 30), ("w1", 10, 4)):
        cluster.pool.handle(worker_id, register(worker_id))
        cluster.pool.handle(worker_id, _stats(worker_id, drafts, accepted))
    assert _families(metrics)["kvbaton:spec_decode_num_draft_tokens"] == ("counter", 50.0)
    assert _families(metrics)["kvbaton:spec_decode_num_accepted_tokens"] == ("counter", 34.0)
    cluster.pool.handle("w1", rpc.Goodbye("w1", "bye"))
    cluster.pool.handle("w0", register("w0"))  # restarted: its engine counts from 0 again
    cluster.pool.handle("w0", _stats("w0", 2, 1))
    assert _families(metrics)["kvbaton:spec_decode_num_draft_tokens"] == ("counter", 52.0)
    assert _families(metrics)["kvbaton:spec_decode_num_accepted_tokens"] == ("counter", 35.0)
    assert b"kvbaton:spec_decode_num_draft_tokens_total 52.0" in metrics.render()


# Was a bug: kvbaton:kv_cache_usage_perc counted the blocks only the prefix cache holds (no request) as used, so an
# idle worker with a warm cache read 100 % and an autoscaler keyed on it saw a full cluster. vLLM's usage counts
# them as free (its free queue holds them: they are given out on demand). The heartbeat now carries the worker's
# evictable blocks and the gauge leaves them out.
def test_kv_cache_usage_leaves_out_what_only_the_prefix_cache_holds() -> None:
    cluster = ClusterManager(ClusterConfig(model_name="tiny-random", block_size=4), clock=lambda: 0.0)
    cluster.pool.socket = _Socket()  # type: ignore[assignment]
    metrics = ApiMetrics()
    metrics.attach_cluster(cluster.cluster_info)
    cluster.pool.handle("w0", register("w0"))
    idle_warm = rpc.Stats("w0", 0, 0, 0, 48, 16, 48, 0, 0, 0, 5, 0.0, num_evictable_blocks=48)
    cluster.pool.handle("w0", idle_warm)
    assert _families(metrics)["kvbaton:kv_cache_usage_perc"] == ("gauge", 0.0)
    cluster.pool.handle("w0", replace(idle_warm, num_running=2, num_used_blocks=56, num_free_blocks=8,
                                  num_evictable_blocks=40))  # 16 blocks held by requests, 40 cached unused
    assert _families(metrics)["kvbaton:kv_cache_usage_perc"] == ("gauge", 0.25)
    assert cluster.cluster_info()["workers"][0]["num_evictable_blocks"] == 40  # type: ignore[index]


def test_a_workers_heartbeat_counts_its_evictable_blocks() -> None:
    from kvbaton.core.sampling import SamplingParams
    from kvbaton.engine.engine import Engine
    from kvbaton.core.config import CacheConfig, EngineConfig

    engine = Engine(EngineConfig(model="tiny-random", cache=CacheConfig(4, 32, True)))
    engine.add_request(list(range(10, 30)), SamplingParams(max_tokens=2, temperature=0.0), request_id="r")
    stats_running = None
    while engine.has_unfinished_requests():
        engine.step()
        stats_running = stats_running or engine.stats()
    assert stats_running is not None and stats_running.num_evictable_blocks < stats_running.num_used_blocks
    idle = engine.stats()
    assert idle.num_evictable_blocks == idle.num_used_blocks == idle.num_cached_blocks > 0
