"""Matplotlib figures for a report: TTFT/TPOT CDFs, per-class bars, latency and attainment against rate.

matplotlib is imported inside each function (Agg backend, no display) so that importing
kvbaton.bench stays light. Every function writes one PNG and returns its path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvbaton.bench.metrics import Summary
from kvbaton.bench.records import RequestRecord


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_cdf(path: Path, runs: Mapping[str, Sequence[RequestRecord]], metric: str, slo_s: float | None) -> Path:
    """CDF of `metric` ("ttft" or "tpot") over completed requests, one line per run."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, records in runs.items():
        values = sorted(v for v in ((r.ttft_s if metric == "ttft" else r.tpot_s) for r in records if r.completed)
                        if v is not None)
        if values:
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=name)
    if slo_s is not None:
        ax.axvline(slo_s, color="grey", linestyle="--", label=f"SLO {slo_s:g} s")
    ax.set_xlabel(f"{metric.upper()} (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.01)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_class_bars(path: Path, summaries: Mapping[str, Summary]) -> Path:
    """Per-class p99 TTFT and joint SLO attainment, runs side by side."""
    plt = _pyplot()
    classes = sorted({c for s in summaries.values() for c in s.per_class})
    fig, (ax_ttft, ax_att) = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / max(1, len(summaries))
    for k, (name, summary) in enumerate(summaries.items()):
        xs = [i + k * width for i in range(len(classes))]
        p99 = [(summary.per_class[c].ttft.p99_s or 0.0) if c in summary.per_class else 0.0 for c in classes]
        att = [(summary.per_class[c].slo_attainment or 0.0) if c in summary.per_class else 0.0 for c in classes]
        ax_ttft.bar(xs, p99, width, label=name)
        ax_att.bar(xs, att, width, label=name)
    for ax, label in ((ax_ttft, "p99 TTFT (s)"), (ax_att, "SLO attainment (both)")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(classes))], classes)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    ax_att.set_ylim(0, 1.05)
    ax_ttft.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_sweep(path: Path, sweeps: Mapping[str, Sequence[tuple[float, Summary]]], what: str) -> Path:
    """`what` = "latency" (p50/p99 TTFT and p99 TPOT) or "attainment" (TTFT, TPOT, joint) against rate."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in sweeps.items():
        rates = [rate for rate, _ in points]
        if what == "latency":
            ax.plot(rates, [s.overall.ttft.p50_s for _, s in points], marker="o", label=f"{name} p50 TTFT")
            ax.plot(rates, [s.overall.ttft.p99_s for _, s in points], marker="^", label=f"{name} p99 TTFT")
            ax.plot(rates, [s.overall.tpot.p99_s for _, s in points], marker="s", label=f"{name} p99 TPOT")
            ax.set_ylabel("latency (s)")
        else:
            ax.plot(rates, [s.overall.ttft_attainment for _, s in points], marker="o", label=f"{name} TTFT")
            ax.plot(rates, [s.overall.tpot_attainment for _, s in points], marker="^", label=f"{name} TPOT")
            ax.plot(rates, [s.overall.slo_attainment for _, s in points], marker="s", label=f"{name} both")
            ax.set_ylabel("SLO attainment")
            ax.set_ylim(0, 1.05)
    ax.set_xlabel("request rate (req/s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
