"""The router's recent traffic over a sliding window, for the dashboard: request rate, TTFT and ITL
percentiles, refusals by reason.

Observations are (time, value) pairs appended to bounded rings (a few appends per request); a read drops
those older than the window and sorts what is left, which at a dashboard's one read a second costs less
than a scrape. Time is passed in by the caller (the API layer's clock).
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Iterator
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


class _Series:
    """A bounded ring of (time, value) floats, oldest first: 16 bytes an observation where a deque of tuples took
    ~110 (a soak's 50,000 inter-token gaps were 5 MB of the router's memory); beyond `capacity` the oldest goes."""

    def __init__(self, capacity: int) -> None:
        self._times = array("d", bytes(8 * capacity))
        self._values = array("d", bytes(8 * capacity))
        self._head = 0  # index of the oldest
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def append(self, at: float, value: float) -> None:
        capacity = len(self._times)
        tail = (self._head + self._size) % capacity
        self._times[tail], self._values[tail] = at, value
        if self._size < capacity:
            self._size += 1
        else:
            self._head = (self._head + 1) % capacity

    def drop_before(self, since: float) -> None:
        capacity = len(self._times)
        while self._size and self._times[self._head] < since:
            self._head = (self._head + 1) % capacity
            self._size -= 1

    def values(self) -> Iterator[float]:
        capacity = len(self._values)
        return (self._values[(self._head + i) % capacity] for i in range(self._size))


class RecentWindow:
    def __init__(self, window_s: float = DEFAULT_WINDOW_S, max_num_observations: int = MAX_NUM_OBSERVATIONS) -> None:
        self.window_s = window_s
        self._ttfts = _Series(max_num_observations)
        self._itls = _Series(max_num_observations)
        self._finished: deque[float] = deque(maxlen=max_num_observations)
        self._refusals: deque[tuple[float, str]] = deque(maxlen=max_num_observations)
        self._first_at: float | None = None

    def on_first_token(self, at: float, ttft_s: float) -> None:
        self._note(at)
        self._ttfts.append(at, ttft_s)

    def on_tokens(self, at: float, num_tokens: int, gap_s: float) -> None:
        self._note(at)
        self._itls.append(at, gap_s / max(num_tokens, 1))

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
        self._ttfts.drop_before(since)
        self._itls.drop_before(since)
        while self._refusals and self._refusals[0][0] < since:
            self._refusals.popleft()
        while self._finished and self._finished[0] < since:
            self._finished.popleft()
        span_s = min(self.window_s, now - self._first_at) if self._first_at is not None else 0.0
        refusals: dict[str, int] = {}
        for _, reason in self._refusals:
            refusals[reason] = refusals.get(reason, 0) + 1
        return RecentSummary(self.window_s, len(self._finished),
                             len(self._finished) / span_s if span_s > 0 else 0.0,
                             _percentiles(sorted(self._ttfts.values())),
                             _percentiles(sorted(self._itls.values())), refusals)


def _percentiles(sorted_values: Sequence[float]) -> dict[str, float | None]:
    return {name: percentile(sorted_values, q) for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))}
