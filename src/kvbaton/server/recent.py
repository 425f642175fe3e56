"""The router's recent traffic over a sliding window, for the dashboard: request rate, TTFT and ITL
percentiles, refusals by reason.

Observations are (time, value) pairs appended to bounded deques (a few appends per request); a read drops
those older than the window and sorts what is left, which at a dashboard's one read a second costs less
than a scrape. Time is passed in by the caller (the API layer's clock).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_WINDOW_S = 300.0
MAX_NUM_OBSERVATIONS = 50_000  # per kind: beyond it the oldest go first, whatever the window


@dataclass(frozen=True, slots=True)
class RecentSummary:
    window_s: float
    num_finished: int
    requests_per_s: float  # finished samples per second over the window (or since the first, if sooner)
    ttft_s: dict[str, float | None]  # "p50", "p90", "p99"
    itl_s: dict[str, float | None]
    refusals: dict[str, int]  # reason -> count within the window


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """The nearest-rank q-quantile (0 < q <= 1) of sorted values; None when there are none."""
    if not sorted_values:
        return None
    rank = max(1, -(-int(q * 1000) * len(sorted_values) // 1000))
    return sorted_values[min(rank, len(sorted_values)) - 1]


class RecentWindow:
    def __init__(self, window_s: float = DEFAULT_WINDOW_S, max_num_observations: int = MAX_NUM_OBSERVATIONS) -> None:
        self.window_s = window_s
        self._ttfts: deque[tuple[float, float]] = deque(maxlen=max_num_observations)
        self._itls: deque[tuple[float, float]] = deque(maxlen=max_num_observations)
        self._finished: deque[float] = deque(maxlen=max_num_observations)
        self._refusals: deque[tuple[float, str]] = deque(maxlen=max_num_observations)
        self._first_at: float | None = None

    def on_first_token(self, at: float, ttft_s: float) -> None:
        self._note(at)
        self._ttfts.append((at, ttft_s))

    def on_tokens(self, at: float, num_tokens: int, gap_s: float) -> None:
        self._note(at)
        self._itls.append((at, gap_s / max(num_tokens, 1)))

    def on_finished(self, at: float) -> None:
        self._note(at)
        self._finished.append(at)

    def on_refusal(self, at: float, reason: str) -> None:
        self._note(at)
        self._refusals.append((at, reason))

    def _note(self, at: float) -> None:
        if self._first_at is None:
            self._first_at = at

    def summary(self, now: float) -> RecentSummary:
        since = now - self.window_s
        for values in (self._ttfts, self._itls, self._refusals):
            while values and values[0][0] < since:
                values.popleft()
        while self._finished and self._finished[0] < since:
            self._finished.popleft()
        span_s = min(self.window_s, now - self._first_at) if self._first_at is not None else 0.0
        refusals: dict[str, int] = {}
        for _, reason in self._refusals:
            refusals[reason] = refusals.get(reason, 0) + 1
        return RecentSummary(self.window_s, len(self._finished),
                             len(self._finished) / span_s if span_s > 0 else 0.0,
                             _percentiles(sorted(v for _, v in self._ttfts)),
                             _percentiles(sorted(v for _, v in self._itls)), refusals)


def _percentiles(sorted_values: Sequence[float]) -> dict[str, float | None]:
    return {name: percentile(sorted_values, q) for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))}
