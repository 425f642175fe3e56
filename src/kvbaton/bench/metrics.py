"""Figures from `RequestRecord`s: latency percentiles, SLO attainment, goodput, cache hits, fairness.

Definitions (the same for live runs, the simulator and the planner):
- TTFT = first_token_s - arrival_s; TPOT = (last token - first token) / (n - 1), the first token
  excluded; ITL = every gap between consecutive tokens; E2E = finish_s - arrival_s. Percentiles
  interpolate linearly between order statistics (numpy's default), over completed requests.
- Attainment: the fraction of *all* requests of a group (rejected and failed ones count as
  misses) that completed with TTFT <= SLO.ttft_s (TTFT attainment), with TPOT <= SLO.tpot_s
  (a 1-token request has no TPOT and meets it), or both (joint attainment).
- Goodput: requests meeting both SLOs per second of the run; per-GPU goodput divides by num_gpus.
  The run lasts from the first arrival to the last finish (or arrival), unless duration_s is given.
- Cache hit ratio: cached / prompt tokens over completed requests that reported cached tokens.
- Slowdown of a request: E2E over its reference latency — the SLO budget
  ttft_s + (n-1)*tpot_s when an SLO is given (1.0 = exactly on budget), else its execution time
  E2E - queue_s when the queueing delay is known. Fairness is Jain's index over the per-class
  mean slowdowns; the maximum slowdown is reported per class and overall.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvbaton.bench.records import RequestRecord, records_by_class
from kvbaton.core.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class SLO:
    ttft_s: float  # time-to-first-token target
    tpot_s: float  # time-per-output-token target (first token excluded)

    def __post_init__(self) -> None:
        # Every command that takes --ttft-slo/--tpot-slo builds one: a NaN or infinite target would reach reports.
        if not all(math.isfinite(s) and s > 0 for s in (self.ttft_s, self.tpot_s)):
            raise InvalidRequestError(f"SLO targets (--ttft-slo, --tpot-slo) must be positive finite seconds, got "
                                      f"{self.ttft_s}, {self.tpot_s}")

    def budget_s(self, output_tokens: int) -> float:
        """The latency the SLO allows a request with `output_tokens` tokens: TTFT + (n-1)*TPOT."""
        return self.ttft_s + max(0, output_tokens - 1) * self.tpot_s


@dataclass(frozen=True, slots=True)
class LatencyStats:
    count: int  # samples behind the figures; the figures are None when 0
    mean_s: float | None = None
    p50_s: float | None = None
    p90_s: float | None = None
    p95_s: float | None = None
    p99_s: float | None = None
    max_s: float | None = None


def latency_stats(values_s: Sequence[float]) -> LatencyStats:
    if len(values_s) == 0:
        return LatencyStats(count=0)
    arr = np.asarray(values_s, dtype=np.float64)
    p50, p90, p95, p99 = (float(v) for v in np.percentile(arr, [50, 90, 95, 99]))
    return LatencyStats(count=len(arr), mean_s=float(arr.mean()), p50_s=p50, p90_s=p90, p95_s=p95, p99_s=p99,
                        max_s=float(arr.max()))


@dataclass(frozen=True, slots=True)
class ClassSummary:
    num_requests: int  # all records of the group
    num_completed: int
    num_rejected: int  # refused by admission control (HTTP 429/503)
    num_failed: int  # errors and timeouts
    reasons: dict[str, int]  # rejection/failure reason -> count
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats  # over every inter-token gap of every completed request
    e2e: LatencyStats
    queue: LatencyStats  # queueing delay, over requests that report it
    execution: LatencyStats  # E2E minus queueing delay, same requests
    ttft_attainment: float | None  # None without an SLO
    tpot_attainment: float | None
    slo_attainment: float | None  # both SLOs met
    goodput_rps: float | None  # requests meeting both SLOs per second of the run
    throughput_rps: float  # completed requests per second of the run
    output_tokens_per_s: float  # output tokens of completed requests per second of the run
    prompt_tokens: int  # over completed requests
    cached_tokens: int  # over completed requests that reported it
    cache_hit_ratio: float | None  # cached / prompt tokens over requests that reported cached tokens
    transfer_bytes: int  # KV bytes moved between workers
    mean_slowdown: float | None  # mean E2E / reference latency (see module docstring)
    max_slowdown: float | None


@dataclass(frozen=True, slots=True)
class Summary:
    slo: SLO | None
    num_gpus: int
    duration_s: float  # the run's length used for every rate below
    overall: ClassSummary
    per_class: dict[str, ClassSummary] = field(default_factory=dict)  # sorted by class name
    goodput_per_gpu_rps: float | None = None  # overall goodput / num_gpus
    jain_fairness: float | None = None  # Jain's index over per-class mean slowdowns
    max_class_slowdown: float | None = None  # the worst class's mean slowdown

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def jain_index(values: Sequence[float]) -> float:
    """Jain's fairness index (sum x)^2 / (n * sum x^2): 1 when all equal, 1/n when one takes all."""
    if len(values) == 0:
        raise InvalidRequestError("Jain's index needs at least one value")
    if any(v < 0 for v in values):
        raise InvalidRequestError("Jain's index is defined for non-negative values")
    square_sum = sum(v * v for v in values)
    if square_sum == 0:
        return 1.0
    return sum(values) ** 2 / (len(values) * square_sum)


def run_duration_s(records: Sequence[RequestRecord]) -> float:
    """First arrival to the last finish (or arrival, for records without a finish)."""
    if not records:
        return 0.0
    start_s = min(r.arrival_s for r in records)
    end_s = max(r.finish_s if r.finish_s is not None else r.arrival_s for r in records)
    return end_s - start_s


def _slowdown(record: RequestRecord, slo: SLO | None) -> float | None:
    e2e_s = record.e2e_s
    if not record.completed or e2e_s is None:
        return None
    if slo is not None:
        reference_s = slo.budget_s(record.output_tokens)
    elif record.queue_s is not None:
        reference_s = e2e_s - record.queue_s
    else:
        return None
    return e2e_s / reference_s if reference_s > 0 else None


def _summarize_group(records: Sequence[RequestRecord], slo: SLO | None, duration_s: float) -> ClassSummary:
    done = [r for r in records if r.completed]
    meets_ttft = meets_tpot = meets_both = 0
    if slo is not None:
        for r in done:
            ttft_ok = r.ttft_s is not None and r.ttft_s <= slo.ttft_s
            tpot_ok = r.tpot_s is None or r.tpot_s <= slo.tpot_s
            meets_ttft += ttft_ok
            meets_tpot += tpot_ok
            meets_both += ttft_ok and tpot_ok
    n = len(records)
    queued = [r for r in done if r.queue_s is not None and r.e2e_s is not None]
    reporting_cache = [r for r in done if r.cached_tokens is not None]
    cache_prompt_tokens = sum(r.prompt_tokens for r in reporting_cache)
    slowdowns = [s for s in (_slowdown(r, slo) for r in done) if s is not None]
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    return ClassSummary(
        num_requests=n,
        num_completed=len(done),
        num_rejected=sum(r.status == "rejected" for r in records),
        num_failed=sum(r.status == "failed" for r in records),
        reasons=dict(sorted(Counter(r.reason for r in records if not r.completed).items())),
        ttft=latency_stats([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot=latency_stats([r.tpot_s for r in done if r.tpot_s is not None]),
        itl=latency_stats([gap for r in done for gap in r.itls_s]),
        e2e=latency_stats([r.e2e_s for r in done if r.e2e_s is not None]),
        queue=latency_stats([r.queue_s for r in queued]),  # type: ignore[misc]
        execution=latency_stats([r.e2e_s - r.queue_s for r in queued]),  # type: ignore[operator]
        ttft_attainment=meets_ttft / n if slo is not None and n else None,
        tpot_attainment=meets_tpot / n if slo is not None and n else None,
        slo_attainment=meets_both / n if slo is not None and n else None,
        goodput_rps=meets_both * per_s if slo is not None else None,
        throughput_rps=len(done) * per_s,
        output_tokens_per_s=sum(r.output_tokens for r in done) * per_s,
        prompt_tokens=sum(r.prompt_tokens for r in done),
        cached_tokens=sum(r.cached_tokens for r in reporting_cache),  # type: ignore[misc]
        cache_hit_ratio=(sum(r.cached_tokens for r in reporting_cache) / cache_prompt_tokens  # type: ignore[misc]
                         if cache_prompt_tokens else None),
        transfer_bytes=sum(r.transfer_bytes for r in records),
        mean_slowdown=float(np.mean(slowdowns)) if slowdowns else None,
        max_slowdown=max(slowdowns) if slowdowns else None,
    )


def summarize(records: Sequence[RequestRecord], slo: SLO | None = None, num_gpus: int = 1,
              duration_s: float | None = None) -> Summary:
    """All metrics, overall and per SLO class (see the module docstring for definitions)."""
    if num_gpus <= 0:
        raise InvalidRequestError(f"num_gpus must be positive, got {num_gpus}")
    duration = run_duration_s(records) if duration_s is None else duration_s
    overall = _summarize_group(records, slo, duration)
    per_class = {name: _summarize_group(group, slo, duration) for name, group in records_by_class(records).items()}
    class_slowdowns = [c.mean_slowdown for c in per_class.values() if c.mean_slowdown is not None]
    return Summary(
        slo=slo, num_gpus=num_gpus, duration_s=duration, overall=overall, per_class=per_class,
        goodput_per_gpu_rps=overall.goodput_rps / num_gpus if overall.goodput_rps is not None else None,
        jain_fairness=jain_index(class_slowdowns) if class_slowdowns else None,
        max_class_slowdown=max(class_slowdowns) if class_slowdowns else None,
    )


def pool_goodput_per_gpu(g_p: int, g_d: int, rate_p: float, rate_d: float) -> float:
    """Per-GPU goodput of a disaggregated system (seed 000 §6, DistServe):
    min(g_p * rate_p, g_d * rate_d) / (g_p + g_d), with rate_p / rate_d the goodput of one
    prefill / decode instance. (2, 1, 5.6, 10) gives 10/3 req/s per GPU."""
    if g_p <= 0 or g_d <= 0:
        raise InvalidRequestError(f"both pools need at least one GPU, got {g_p} prefill and {g_d} decode")
    return min(g_p * rate_p, g_d * rate_d) / (g_p + g_d)


@dataclass(frozen=True, slots=True)
class GoodputProbe:
    rate_rps: float
    ttft_attainment: float
    tpot_attainment: float
    slo_attainment: float
    met: bool


@dataclass(frozen=True, slots=True)
class GoodputSearch:
    rate_rps: float  # the largest probed rate that met the target; 0.0 if even `low` missed
    capped: bool  # True when `high` itself met the target (the true goodput may be higher)
    probes: tuple[GoodputProbe, ...]  # every probe, in the order run


def max_goodput_rate(run_at_rate: Callable[[float], Sequence[RequestRecord] | Summary], slo: SLO,
                     attainment: float = 0.9, low: float = 0.1, high: float = 100.0, tol: float = 0.05,
                     joint: bool = False) -> GoodputSearch:
    """Bisection on the request rate for the largest rate meeting the SLOs (DistServe's goodput).

    `run_at_rate(rate)` runs the workload at that rate (live or simulated) and returns its
    records or Summary. A rate meets the target when TTFT attainment and TPOT attainment are
    each >= `attainment` (DistServe's definition), or the joint attainment when `joint`.
    Assumes attainment falls as the rate rises; stops when the bracket is narrower than `tol`.
    """
    if not (0 < low < high) or tol <= 0 or not 0 < attainment <= 1:
        raise InvalidRequestError("max_goodput_rate needs 0 < low < high, tol > 0 and 0 < attainment <= 1")
    probes: list[GoodputProbe] = []

    def probe(rate: float) -> bool:
        result = run_at_rate(rate)
        if isinstance(result, Summary):
            if result.slo != slo:
                raise InvalidRequestError("run_at_rate returned a Summary computed under a different SLO")
            summary = result
        else:
            summary = summarize(result, slo)
        o = summary.overall
        ttft_a, tpot_a, both_a = o.ttft_attainment or 0.0, o.tpot_attainment or 0.0, o.slo_attainment or 0.0
        met = both_a >= attainment if joint else (ttft_a >= attainment and tpot_a >= attainment)
        probes.append(GoodputProbe(rate, ttft_a, tpot_a, both_a, met))
        return met

    if not probe(low):
        return GoodputSearch(0.0, False, tuple(probes))
    if probe(high):
        return GoodputSearch(high, True, tuple(probes))
    while high - low > tol:
        mid = (low + high) / 2
        if probe(mid):
            low = mid
        else:
            high = mid
    return GoodputSearch(low, False, tuple(probes))
