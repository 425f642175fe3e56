"""Arrival processes: when each request of a workload reaches the server, in seconds from 0.

Every process takes a seeded `random.Random` (never the global one) and returns sorted times.
A process is given the number of requests it must produce; rates are requests per second.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from kvbaton.core.errors import InvalidRequestError

ARRIVALS = ("poisson", "gamma", "on-off", "constant", "trace")


def _check_rate(rate: float) -> None:
    if not rate > 0 or math.isinf(rate):
        raise InvalidRequestError(f"arrival rate must be a positive finite number, got {rate}")


def poisson_arrivals(rng: random.Random, num_requests: int, rate: float, start_s: float = 0.0) -> list[float]:
    """Exponential gaps with mean 1/rate; the first request arrives one gap after `start_s`."""
    _check_rate(rate)
    times, now_s = [], start_s
    for _ in range(num_requests):
        now_s += rng.expovariate(rate)
        times.append(now_s)
    return times


def gamma_arrivals(rng: random.Random, num_requests: int, rate: float, cv: float, start_s: float = 0.0) -> list[float]:
    """Gamma-distributed gaps with mean 1/rate and coefficient of variation `cv`.

    cv = 1 is Poisson; cv > 1 is burstier (DistServe and AlpaServe sweep cv this way);
    shape k = 1/cv**2 and scale = 1/(rate*k) keep the mean gap at 1/rate.
    """
    _check_rate(rate)
    shape = 1.0 / (cv * cv) if cv > 0 else 0.0
    if not shape > 0:  # also NaN, and a cv whose square overflows to inf
        raise InvalidRequestError(f"gamma arrivals need a finite cv > 0, got {cv}")
    scale = 1.0 / (rate * shape)
    times, now_s = [], start_s
    for _ in range(num_requests):
        now_s += rng.gammavariate(shape, scale)
        times.append(now_s)
    return times


def piecewise_poisson_arrivals(rng: random.Random, num_requests: int, rate_at: Sequence[tuple[float, float]],
                               period_s: float | None = None) -> list[float]:
    """A Poisson process whose rate is piecewise constant.

    `rate_at` lists (start_s, rate) with increasing starts, the first at 0; rate 0 means
    silence. With `period_s` the schedule repeats with that period. Exact, not thinned: the
    process is memoryless, so a gap that crosses a rate change is redrawn from the change.
    """
    if not rate_at or rate_at[0][0] != 0.0:
        raise InvalidRequestError("rate_at must start at time 0")
    if any(b[0] <= a[0] for a, b in zip(rate_at, rate_at[1:])) or any(r < 0 for _, r in rate_at):
        raise InvalidRequestError("rate_at needs increasing start times and non-negative rates")
    if period_s is not None and period_s <= rate_at[-1][0]:
        raise InvalidRequestError("period_s must exceed the last segment start")
    if all(r == 0 for _, r in rate_at) or (period_s is None and rate_at[-1][1] == 0):
        raise InvalidRequestError("the rate schedule must stay positive somewhere it repeats or ends")
    times: list[float] = []
    now_s, seg, base_s = 0.0, 0, 0.0
    while len(times) < num_requests:
        seg_rate = rate_at[seg][1]
        if seg + 1 < len(rate_at):
            seg_end_s = base_s + rate_at[seg + 1][0]
        else:
            seg_end_s = base_s + period_s if period_s is not None else math.inf
        gap_s = rng.expovariate(seg_rate) if seg_rate > 0 else math.inf
        if now_s + gap_s < seg_end_s:
            now_s += gap_s
            times.append(now_s)
            continue
        now_s = seg_end_s
        seg += 1
        if seg == len(rate_at):
            seg, base_s = 0, seg_end_s
    return times


def on_off_arrivals(rng: random.Random, num_requests: int, rate: float, on_s: float, off_s: float) -> list[float]:
    """Bursts: Poisson at rate*(on_s+off_s)/on_s for `on_s`, then silence for `off_s`, repeated.

    The long-run mean rate stays `rate`, so on/off and Poisson runs at the same --rate carry
    the same load and differ only in burstiness.
    """
    _check_rate(rate)
    if not (on_s > 0 and off_s >= 0):
        raise InvalidRequestError(f"on/off arrivals need on_s > 0 and off_s >= 0, got {on_s}, {off_s}")
    if off_s == 0:
        return poisson_arrivals(rng, num_requests, rate)
    burst_rate = rate * (on_s + off_s) / on_s
    return piecewise_poisson_arrivals(rng, num_requests, [(0.0, burst_rate), (on_s, 0.0)], period_s=on_s + off_s)


def constant_arrivals(num_requests: int, rate: float) -> list[float]:
    """Evenly spaced: request i arrives at i/rate (deterministic; the first at 0)."""
    _check_rate(rate)
    return [i / rate for i in range(num_requests)]


def trace_arrivals(timestamps_s: Sequence[float], speed: float = 1.0) -> list[float]:
    """Replays recorded times relative to the first one, `speed` times faster (2.0 = half the gaps)."""
    if not speed > 0:
        raise InvalidRequestError(f"trace speed must be positive, got {speed}")
    if not timestamps_s:
        return []
    origin_s = timestamps_s[0]
    if any(b < a for a, b in zip(timestamps_s, timestamps_s[1:])):
        raise InvalidRequestError("trace timestamps must be non-decreasing")
    return [(t - origin_s) / speed for t in timestamps_s]


def create_arrivals(kind: str, rng: random.Random, num_requests: int, rate: float, *, cv: float = 2.0,
                    on_s: float = 5.0, off_s: float = 5.0) -> list[float]:
    """Times for `num_requests` requests from a named synthetic process (not "trace")."""
    if kind == "poisson":
        return poisson_arrivals(rng, num_requests, rate)
    if kind == "gamma":
        return gamma_arrivals(rng, num_requests, rate, cv)
    if kind == "on-off":
        return on_off_arrivals(rng, num_requests, rate, on_s, off_s)
    if kind == "constant":
        return constant_arrivals(num_requests, rate)
    raise InvalidRequestError(f"unknown arrival process {kind!r}; choose from {', '.join(ARRIVALS)}")
