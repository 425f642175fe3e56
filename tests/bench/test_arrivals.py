"""Arrival processes: determinism, mean rates, burstiness and trace replay."""

from __future__ import annotations

import random
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbaton.bench.arrivals import (
    constant_arrivals, create_arrivals, gamma_arrivals, on_off_arrivals, piecewise_poisson_arrivals,
    poisson_arrivals, trace_arrivals,
)
from kvbaton.core.errors import InvalidRequestError


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip([0.0] + times, times)]


def test_poisson_mean_rate_and_determinism() -> None:
    times = poisson_arrivals(random.Random(7), 20_000, rate=50.0)
    assert times == poisson_arrivals(random.Random(7), 20_000, rate=50.0)
    assert times != poisson_arrivals(random.Random(8), 20_000, rate=50.0)
    assert statistics.fmean(gaps(times)) == pytest.approx(1 / 50, rel=0.03)
    # exponential gaps: coefficient of variation 1
    assert statistics.pstdev(gaps(times)) / statistics.fmean(gaps(times)) == pytest.approx(1.0, abs=0.05)


def test_gamma_cv() -> None:
    g = gaps(gamma_arrivals(random.Random(1), 40_000, rate=10.0, cv=3.0))
    assert statistics.fmean(g) == pytest.approx(0.1, rel=0.05)
    assert statistics.pstdev(g) / statistics.fmean(g) == pytest.approx(3.0, rel=0.1)


def test_on_off_is_silent_when_off_and_keeps_the_mean_rate() -> None:
    times = on_off_arrivals(random.Random(3), 20_000, rate=10.0, on_s=2.0, off_s=3.0)
    assert all((t % 5.0) < 2.0 for t in times)
    assert len(times) / times[-1] == pytest.approx(10.0, rel=0.05)


def test_piecewise_rates() -> None:
    times = piecewise_poisson_arrivals(random.Random(5), 30_000, [(0.0, 10.0), (100.0, 100.0), (200.0, 10.0)])
    in_first = sum(t < 100.0 for t in times)
    in_burst = sum(100.0 <= t < 200.0 for t in times)
    assert in_first == pytest.approx(1000, rel=0.1)
    assert in_burst == pytest.approx(10_000, rel=0.05)


def test_constant_and_trace() -> None:
    assert constant_arrivals(4, 2.0) == [0.0, 0.5, 1.0, 1.5]
    assert trace_arrivals([10.0, 11.0, 13.0], speed=2.0) == [0.0, 0.5, 1.5]
    with pytest.raises(InvalidRequestError):
        trace_arrivals([2.0, 1.0])


def test_bad_arguments_raise() -> None:
    with pytest.raises(InvalidRequestError):
        poisson_arrivals(random.Random(0), 3, rate=0.0)
    with pytest.raises(InvalidRequestError):
        create_arrivals("weibull", random.Random(0), 3, 1.0)


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(["poisson", "gamma", "on-off", "constant"]), seed=st.integers(0, 2**32),
       num=st.integers(0, 200), rate=st.floats(0.1, 1000.0))
def test_every_process_is_sorted_positive_and_counted(kind: str, seed: int, num: int, rate: float) -> None:
    times = create_arrivals(kind, random.Random(seed), num, rate, cv=1.5, on_s=1.0, off_s=2.0)
    assert len(times) == num
    assert all(t >= 0 for t in times)
    assert times == sorted(times)
    assert times == create_arrivals(kind, random.Random(seed), num, rate, cv=1.5, on_s=1.0, off_s=2.0)
