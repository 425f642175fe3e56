"""Simulator fidelity: the same percentiles from a live run and a simulated run of one trace, with the error.

Must-show 2 of issue 6 compares p50 and p99 TTFT and TPOT (targets: <= 10 % error at p50, <= 20 %
at p99). Both sides are `RequestRecord`s summarised by `kvbaton.bench.metrics`, so the figures are
defined identically; the error is (simulated - live) / live.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvbaton.bench.metrics import summarize
from kvbaton.bench.records import RequestRecord

TARGET_ERROR = {"p50": 0.10, "p99": 0.20}


@dataclass(frozen=True, slots=True)
class FidelityRow:
    metric: str  # "TTFT p50", "TPOT p99", ...
    live_s: float | None
    sim_s: float | None

    @property
    def error(self) -> float | None:
        """(sim - live) / live; None when either side has no figure."""
        if self.live_s is None or self.sim_s is None or self.live_s == 0:
            return None
        return (self.sim_s - self.live_s) / self.live_s

    @property
    def within_target(self) -> bool | None:
        error = self.error
        return None if error is None else abs(error) <= TARGET_ERROR[self.metric.split()[1]]


def compare_runs(live: Sequence[RequestRecord], simulated: Sequence[RequestRecord]) -> list[FidelityRow]:
    """p50 and p99 of TTFT and TPOT, live against simulated (completed requests only)."""
    a, b = summarize(live).overall, summarize(simulated).overall
    rows = []
    for name in ("ttft", "tpot"):
        for pct in ("p50", "p99"):
            live_s = getattr(getattr(a, name), f"{pct}_s")
            sim_s = getattr(getattr(b, name), f"{pct}_s")
            rows.append(FidelityRow(f"{name.upper()} {pct}", live_s, sim_s))
    return rows


def render_fidelity(rows: Sequence[FidelityRow], title: str) -> str:
    """A markdown table: metric, live, simulated (ms), error, and whether it meets the target."""
    lines = [f"### {title}", "", "| metric | live (ms) | sim (ms) | error | target met |", "|---|---|---|---|---|"]
    for row in rows:
        live = "-" if row.live_s is None else f"{1e3 * row.live_s:.1f}"
        sim = "-" if row.sim_s is None else f"{1e3 * row.sim_s:.1f}"
        error = "-" if row.error is None else f"{100 * row.error:+.1f} %"
        met = {None: "-", True: "yes", False: "no"}[row.within_target]
        lines.append(f"| {row.metric} | {live} | {sim} | {error} | {met} |")
    return "\n".join(lines) + "\n"
