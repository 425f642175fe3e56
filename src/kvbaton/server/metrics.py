"""Prometheus metrics of the router process: vLLM's own metrics per worker, and kvbaton's under `kvbaton:`.

Per worker, as a vLLM engine exports them (`vllm:` names, the labels `model_name` and `engine`, here the
worker id, with vLLM's types and units; `VLLM_METRICS`), so dashboards, autoscalers (KEDA) and gateways
(llm-d's EPP, production-stack) built for vLLM read a kvbaton cluster as a set of vLLM engines: the
scheduler gauges, KV use, prefix-cache and preemption counters from each worker's heartbeat, and the
token counters, finished requests and latency histograms from the deltas each worker sent. The same
cluster-wide figures, summed, stay under `kvbaton:` beside kvbaton's own (router decisions, KV handoffs,
the tokenizer cache).

Each app owns its CollectorRegistry (no process-global state, so tests can build many apps). Latency
histograms and request/token counters are observed by the API layer as deltas stream through, into
plain lists and ints that are folded into the prometheus metrics when the registry is collected (the
first collector registered does it) or when a list grows long: per request that costs a few appends
instead of a dozen locked metric updates, and a scrape reads exactly what immediate updates would
have given. The cluster-wide gauges (running, waiting, KV usage) and the router's decision counters are read from
`cluster.cluster_info()` at scrape time, so they are never stale and need no background thread.

Expected `cluster_info()` keys (all optional; missing ones read as 0):
  "workers": [{"worker_id", "num_running", "num_waiting", "num_used_blocks", "num_evictable_blocks",
               "num_free_blocks", "num_blocks"?, "prefix_cache_queries_tokens", "prefix_cache_hits_tokens",
               "num_preemptions", ...}, ...]
  "router_decisions": {reason: count}  # router placement decisions by reason, cumulative
  "transfers": {name: value}  # KV handoff totals (bytes, time_s, queue_s, num_fallbacks, ...): kv_transfer_<name>
  "spec_decode": {"num_draft_tokens", "num_accepted_tokens"}  # cumulative over all workers ever registered
  "num_migrations", "num_failed_by_worker_loss"  # calls moved to another worker / failed after losing theirs
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from kvbaton.model.token_cache import TokenCacheStats
from kvbaton.server.recent import RecentWindow

PREFIX = "kvbaton:"
VLLM = "vllm:"
VLLM_LABELS = ("model_name", "engine")  # vLLM v1's labels; `engine` is the worker id
# vLLM's metric names and types (docs.vllm.ai, "Production Metrics"): what each worker exports under them.
VLLM_METRICS = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter", "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_queue_time_seconds": "histogram",
}
# vLLM's buckets (seconds), so dashboards built for vLLM read these unchanged.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
_MAX_PENDING = 4096  # observations held before folding them in without waiting for a scrape
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                 480.0, 960.0, 1920.0, 7680.0)
QUEUE_BUCKETS_S = E2E_BUCKETS_S  # vLLM's request_queue_time_seconds uses its request-latency buckets


def _number(value: object) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


class ClusterCollector(Collector):
    """Gauges and router counters computed from one `cluster_info()` call per scrape."""

    def __init__(self, cluster_info: Callable[[], Mapping[str, object]]) -> None:
        self._cluster_info = cluster_info

    def collect(self) -> Iterator[Metric]:
        info = self._cluster_info()
        workers = [w for w in info.get("workers", []) or [] if isinstance(w, Mapping)]  # type: ignore[union-attr]
        running = sum(_number(w.get("num_running")) for w in workers)
        waiting = sum(_number(w.get("num_waiting")) for w in workers)
        # As vLLM's: blocks only the prefix cache holds count as free (they are given out on demand), so an idle
        # worker with a full cache reads 0, not 100 %.
        used_blocks = sum(_number(w.get("num_used_blocks")) - _number(w.get("num_evictable_blocks"))
                          for w in workers)
        total_blocks = sum(
            _number(w.get("num_blocks")) or _number(w.get("num_used_blocks")) + _number(w.get("num_free_blocks"))
            for w in workers
        )  # as kv_cache_usage, over all workers
        yield GaugeMetricFamily(f"{PREFIX}num_requests_running", "Requests running on the workers.", value=running)
        yield GaugeMetricFamily(f"{PREFIX}num_requests_waiting", "Requests waiting in the workers' queues.",
                                value=waiting)
        yield GaugeMetricFamily(f"{PREFIX}kv_cache_usage_perc", "KV-cache usage over all workers; 1 means 100%. "
                                "Cached blocks no request holds count as free, as in vLLM.",
                                value=used_blocks / total_blocks if total_blocks else 0.0)
        yield GaugeMetricFamily(f"{PREFIX}num_workers", "Workers registered and alive.", value=len(workers))
        decisions = CounterMetricFamily(f"{PREFIX}router_decisions", "Router placement decisions, by reason.",
                                        labels=["reason"])
        raw_decisions = info.get("router_decisions", {}) or {}
        for reason, count in sorted(raw_decisions.items()):  # type: ignore[union-attr]
            decisions.add_metric([str(reason)], _number(count))
        yield decisions
        yield CounterMetricFamily(f"{PREFIX}num_migrations", "Calls moved to another worker after losing theirs.",
                                  value=_number(info.get("num_migrations")))
        yield CounterMetricFamily(f"{PREFIX}num_failed_by_worker_loss",
                                  "Calls that failed when their worker was lost (not migrated).",
                                  value=_number(info.get("num_failed_by_worker_loss")))
        spec_decode = info.get("spec_decode", {}) or {}
        for name in ("num_draft_tokens", "num_accepted_tokens"):  # counters, as vLLM's (a worker leaving keeps its)
            yield CounterMetricFamily(f"{PREFIX}spec_decode_{name}", f"Speculative decoding: {name.replace('_', ' ')}.",
                                      value=_number(spec_decode.get(name)))  # type: ignore[union-attr]
        for name in ("num_loaded_blocks", "num_saved_blocks"):  # the workers' loads from and saves to the KV store
            total = sum(_number((w.get("kv_store") or {}).get(name)) for w in workers)  # type: ignore[union-attr]
            yield GaugeMetricFamily(f"{PREFIX}kv_store_{name}", f"KV store: {name.replace('_', ' ')} by the workers "
                                    "(summed over the live workers).", value=total)
        transfers = info.get("transfers", {}) or {}
        for name, value in sorted(transfers.items()):  # type: ignore[union-attr]
            yield GaugeMetricFamily(f"{PREFIX}kv_transfer_{name}", f"KV handoffs: {name} (summed over workers).",
                                    value=_number(value))


def kv_cache_usage(worker: Mapping[str, object]) -> float:
    """As vLLM's: blocks only the prefix cache holds count as free, so an idle worker with a full cache reads 0."""
    used = _number(worker.get("num_used_blocks")) - _number(worker.get("num_evictable_blocks"))
    total = _number(worker.get("num_blocks")) or _number(worker.get("num_used_blocks")) + _number(
        worker.get("num_free_blocks"))
    return used / total if total else 0.0


class VllmWorkerCollector(Collector):
    """vLLM's scheduler gauges and cache counters, one series per live worker, from its latest heartbeat."""

    def __init__(self, cluster_info: Callable[[], Mapping[str, object]], model_name: str) -> None:
        self._cluster_info = cluster_info
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        info = self._cluster_info()
        workers = [w for w in info.get("workers", []) or [] if isinstance(w, Mapping)]  # type: ignore[union-attr]
        families = (
            (GaugeMetricFamily, "num_requests_running", "Number of requests in model execution batches.",
             lambda w: _number(w.get("num_running"))),
            (GaugeMetricFamily, "num_requests_waiting", "Number of requests waiting to be processed.",
             lambda w: _number(w.get("num_waiting"))),
            (GaugeMetricFamily, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv_cache_usage),
            (CounterMetricFamily, "prefix_cache_queries",
             "Prefix cache queries, in terms of number of queried tokens.",
             lambda w: _number(w.get("prefix_cache_queries_tokens"))),
            (CounterMetricFamily, "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             lambda w: _number(w.get("prefix_cache_hits_tokens"))),
            (CounterMetricFamily, "num_preemptions", "Cumulative number of preemption from the engine.",
             lambda w: _number(w.get("num_preemptions"))),
        )
        for kind, name, documentation, value_of in families:
            family = kind(f"{VLLM}{name}", documentation, labels=list(VLLM_LABELS))
            for worker in workers:
                family.add_metric([self._model_name, str(worker.get("worker_id", ""))], value_of(worker))
            yield family


class TokenCacheCollector(Collector):
    """The ingress tokenization cache's counters (`TokenizationCache.stats()`), read at scrape time."""

    def __init__(self, stats: Callable[[], TokenCacheStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        yield CounterMetricFamily(f"{PREFIX}tokenizer_cache_queries", "Texts tokenized at ingress.",
                                  value=stats.num_queries)
        yield CounterMetricFamily(f"{PREFIX}tokenizer_cache_exact_hits", "Texts whose ids were cached whole.",
                                  value=stats.num_exact_hits)
        yield CounterMetricFamily(f"{PREFIX}tokenizer_cache_prefix_hits",
                                  "Texts that reused the cached ids of a leading part.", value=stats.num_prefix_hits)
        yield CounterMetricFamily(f"{PREFIX}tokenizer_cache_prefix_tokens_reused",
                                  "Token ids taken from cached leading parts.", value=stats.num_prefix_tokens_reused)
        yield GaugeMetricFamily(f"{PREFIX}tokenizer_cache_chars", "Characters the cache's entries stand for.",
                                value=stats.num_cached_chars)


class _FoldPending(Collector):
    """Registered first, so collecting the registry folds the pending observations in before any metric is read."""

    def __init__(self, fold: Callable[[], None]) -> None:
        self._fold = fold

    def collect(self) -> Iterator[Metric]:
        self._fold()
        return iter(())


class ApiMetrics:
    """The metrics one app exposes at /metrics; `observe_*` are called by the API layer."""

    def __init__(self, registry: CollectorRegistry | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        """`clock` times the observations of `recent` (the dashboard's sliding window)."""
        self.registry = registry if registry is not None else CollectorRegistry()
        self._clock = clock
        self.recent = RecentWindow()
        r = self.registry
        r.register(_FoldPending(self.fold_pending))
        # Pending observations, in arrival order (folded in that order: sums come out exactly as before).
        self._num_generation_tokens = 0
        self._generation_tokens_by_worker: dict[str, int] = {}
        self._ttfts_s: list[tuple[float, str]] = []  # (ttft_s, worker id)
        self._itls: list[tuple[int, float, str]] = []  # (num_tokens, gap_s, worker id)
        self._queues_s: list[tuple[float, str]] = []  # (queue_s, worker id)
        # (finish reason, e2e_s, prompt, cached tokens, worker id)
        self._finished: list[tuple[str, float, int, int, str]] = []
        self.model_name = ""
        self.ttft_s = Histogram(f"{PREFIX}time_to_first_token_seconds", "Time to first token (per sample).",
                                buckets=TTFT_BUCKETS_S, registry=r)
        self.itl_s = Histogram(f"{PREFIX}inter_token_latency_seconds", "Time between consecutive output tokens.",
                               buckets=ITL_BUCKETS_S, registry=r)
        self.e2e_s = Histogram(f"{PREFIX}e2e_request_latency_seconds", "Arrival to last token (per sample).",
                               buckets=E2E_BUCKETS_S, registry=r)
        self.request_success = Counter(f"{PREFIX}request_success", "Samples finished, by finish reason.",
                                       ["finished_reason"], registry=r)
        self.request_failure = Counter(f"{PREFIX}request_failure", "Requests failed or refused, by reason.",
                                       ["reason"], registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens of finished samples.", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens", "Output tokens generated.", registry=r)
        self.prefix_cache_queries = Counter(f"{PREFIX}prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.", registry=r)
        self.prefix_cache_hits = Counter(f"{PREFIX}prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                         registry=r)
        labels = VLLM_LABELS
        self.vllm_ttft_s = Histogram(f"{VLLM}time_to_first_token_seconds", "Histogram of time to first token in "
                                     "seconds.", labels, buckets=TTFT_BUCKETS_S, registry=r)
        self.vllm_itl_s = Histogram(f"{VLLM}inter_token_latency_seconds", "Histogram of inter-token latency in "
                                    "seconds.", labels, buckets=ITL_BUCKETS_S, registry=r)
        self.vllm_e2e_s = Histogram(f"{VLLM}e2e_request_latency_seconds", "Histogram of e2e request latency in "
                                    "seconds.", labels, buckets=E2E_BUCKETS_S, registry=r)
        self.vllm_queue_s = Histogram(f"{VLLM}request_queue_time_seconds", "Histogram of time spent in WAITING "
                                      "phase for request.", labels, buckets=QUEUE_BUCKETS_S, registry=r)
        self.vllm_prompt_tokens = Counter(f"{VLLM}prompt_tokens", "Number of prefill tokens processed.", labels,
                                          registry=r)
        self.vllm_generation_tokens = Counter(f"{VLLM}generation_tokens", "Number of generation tokens processed.",
                                              labels, registry=r)
        self.vllm_request_success = Counter(f"{VLLM}request_success", "Count of successfully processed requests.",
                                            [*labels, "finished_reason"], registry=r)
        self._cluster_collector: ClusterCollector | None = None
        self._token_cache_collector: TokenCacheCollector | None = None

    def attach_cluster(self, cluster_info: Callable[[], Mapping[str, object]], model_name: str = "") -> None:
        """Registers the scrape-time cluster gauges and the per-worker vLLM ones (once per app); `model_name`
        is the served model's (vLLM's `model_name` label)."""
        if self._cluster_collector is None:
            self.model_name = model_name
            self._cluster_collector = ClusterCollector(cluster_info)
            self.registry.register(self._cluster_collector)
            self.registry.register(VllmWorkerCollector(cluster_info, model_name))

    def _worker(self, metric: MetricWrapperBase, worker_id: str) -> MetricWrapperBase:
        return metric.labels(model_name=self.model_name, engine=worker_id)

    def attach_token_cache(self, stats: Callable[[], TokenCacheStats]) -> None:
        """Registers the tokenization cache's counters (once per app)."""
        if self._token_cache_collector is None:
            self._token_cache_collector = TokenCacheCollector(stats)
            self.registry.register(self._token_cache_collector)

    # `worker_id` on each: the worker whose delta it was (vLLM's `engine` label); "" counts in the totals only.

    def observe_first_token(self, num_tokens: int, ttft_s: float, worker_id: str = "") -> None:
        self._count_tokens(num_tokens, worker_id)
        self._ttfts_s.append((ttft_s, worker_id))
        self.recent.on_first_token(self._clock(), ttft_s)
        if len(self._ttfts_s) >= _MAX_PENDING:
            self.fold_pending()

    def observe_tokens(self, num_tokens: int, gap_s: float, worker_id: str = "") -> None:
        """`num_tokens` arrived `gap_s` after the previous ones: each gets an equal share of the gap."""
        self._count_tokens(num_tokens, worker_id)
        self._itls.append((num_tokens, gap_s, worker_id))
        self.recent.on_tokens(self._clock(), num_tokens, gap_s)
        if len(self._itls) >= _MAX_PENDING:
            self.fold_pending()

    def _count_tokens(self, num_tokens: int, worker_id: str) -> None:
        self._num_generation_tokens += num_tokens
        if worker_id:
            by_worker = self._generation_tokens_by_worker
            by_worker[worker_id] = by_worker.get(worker_id, 0) + num_tokens

    def observe_queue(self, queue_s: float, worker_id: str) -> None:
        """A sample waited `queue_s` in `worker_id`'s queue before its first step there (as the worker measured)."""
        self._queues_s.append((queue_s, worker_id))
        if len(self._queues_s) >= _MAX_PENDING:
            self.fold_pending()

    def observe_finished(self, finish_reason: str, e2e_s: float, num_prompt_tokens: int,
                         num_cached_tokens: int, worker_id: str = "") -> None:
        self._finished.append((finish_reason, e2e_s, num_prompt_tokens, num_cached_tokens, worker_id))
        if finish_reason == "error":
            self.recent.on_refusal(self._clock(), "error")
        else:
            self.recent.on_finished(self._clock())
        if len(self._finished) >= _MAX_PENDING:
            self.fold_pending()

    def observe_failure(self, reason: str) -> None:
        self.request_failure.labels(reason=reason).inc()
        self.recent.on_refusal(self._clock(), reason)

    def fold_pending(self) -> None:
        """Apply the pending observations to the prometheus metrics (idempotent; runs at every collection)."""
        num_tokens, self._num_generation_tokens = self._num_generation_tokens, 0
        by_worker, self._generation_tokens_by_worker = self._generation_tokens_by_worker, {}
        ttfts_s, self._ttfts_s = self._ttfts_s, []
        itls, self._itls = self._itls, []
        queues_s, self._queues_s = self._queues_s, []
        finished, self._finished = self._finished, []
        if num_tokens:
            self.generation_tokens.inc(num_tokens)
        for worker_id, count in by_worker.items():
            self._worker(self.vllm_generation_tokens, worker_id).inc(count)
        for ttft_s, worker_id in ttfts_s:
            self.ttft_s.observe(max(ttft_s, 0.0))
            if worker_id:
                self._worker(self.vllm_ttft_s, worker_id).observe(max(ttft_s, 0.0))
        for count, gap_s, worker_id in itls:
            worker_itl = self._worker(self.vllm_itl_s, worker_id) if worker_id else None
            for _ in range(count):
                self.itl_s.observe(max(gap_s, 0.0) / count)
                if worker_itl is not None:
                    worker_itl.observe(max(gap_s, 0.0) / count)
        for queue_s, worker_id in queues_s:
            self._worker(self.vllm_queue_s, worker_id).observe(max(queue_s, 0.0))
        if not finished:
            return
        endings: dict[str, int] = {}
        num_prompt_tokens = num_cached_tokens = 0
        for finish_reason, e2e_s, num_prompt, num_cached, worker_id in finished:
            endings[finish_reason] = endings.get(finish_reason, 0) + 1
            if finish_reason == "error":
                continue
            self.e2e_s.observe(max(e2e_s, 0.0))
            num_prompt_tokens += num_prompt
            num_cached_tokens += num_cached
            if worker_id:
                self._worker(self.vllm_e2e_s, worker_id).observe(max(e2e_s, 0.0))
                self._worker(self.vllm_prompt_tokens, worker_id).inc(num_prompt)
                self.vllm_request_success.labels(model_name=self.model_name, engine=worker_id,
                                                 finished_reason=finish_reason).inc()
        for finish_reason, count in endings.items():
            if finish_reason == "error":
                self.request_failure.labels(reason="error").inc(count)
            else:
                self.request_success.labels(finished_reason=finish_reason).inc(count)
        if num_prompt_tokens:
            self.prompt_tokens.inc(num_prompt_tokens)
            self.prefix_cache_queries.inc(num_prompt_tokens)
        if num_cached_tokens:
            self.prefix_cache_hits.inc(num_cached_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
