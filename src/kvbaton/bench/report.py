"""Writes a run (or several, side by side) as report.json, report.md and PNG plots in one directory.

Comparison mode is just several named runs: policies, colocated vs disaggregated, or one policy
at several rates (`sweeps`). Runs may be given as records (then CDF plots are drawn) or as
already computed Summaries (then only tables, bars and sweep plots).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvbaton.bench.metrics import SLO, ClassSummary, Summary, summarize
from kvbaton.bench.records import RequestRecord, write_records

RunInput = Sequence[RequestRecord] | Summary


@dataclass(frozen=True, slots=True)
class ReportFiles:
    json_path: Path
    markdown_path: Path
    plot_paths: tuple[Path, ...]
    summaries: dict[str, Summary]  # per run, as written


def _fmt(value: float | None, scale: float = 1.0, digits: int = 3) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


_HEADER = ("| {first} | requests | done | rej | fail | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) "
           "| E2E p50 / p99 (s) | TTFT att | TPOT att | both | goodput (req/s) | hit ratio | slowdown max |")


def _row(first: str, c: ClassSummary) -> str:
    return (f"| {first} | {c.num_requests} | {c.num_completed} | {c.num_rejected} | {c.num_failed} "
            f"| {_fmt(c.ttft.p50_s, 1e3, 1)} / {_fmt(c.ttft.p99_s, 1e3, 1)} "
            f"| {_fmt(c.tpot.p50_s, 1e3, 1)} / {_fmt(c.tpot.p99_s, 1e3, 1)} "
            f"| {_fmt(c.e2e.p50_s)} / {_fmt(c.e2e.p99_s)} | {_pct(c.ttft_attainment)} | {_pct(c.tpot_attainment)} "
            f"| {_pct(c.slo_attainment)} | {_fmt(c.goodput_rps)} | {_pct(c.cache_hit_ratio)} "
            f"| {_fmt(c.max_slowdown, digits=2)} |")


def _separator(header: str) -> str:
    return "|" + "---|" * (header.count("|") - 1)


def render_markdown(title: str, summaries: Mapping[str, Summary], sweeps: Mapping[str, Sequence[tuple[float, Summary]]],
                    plot_names: Sequence[str]) -> str:
    lines = [f"# {title}", ""]
    first = next(iter(summaries.values()), None)
    if first is not None:
        slo = first.slo
        lines += [f"SLO: {'none' if slo is None else f'TTFT <= {slo.ttft_s:g} s, TPOT <= {slo.tpot_s:g} s'}; "
                  f"GPUs: {first.num_gpus}.", ""]
        header = _HEADER.format(first="run")
        lines += ["## Overall", "", header, _separator(header)]
        lines += [_row(name, s.overall) for name, s in summaries.items()]
        lines += ["", "| run | duration (s) | throughput (req/s) | output tok/s | goodput/GPU (req/s) | Jain (classes) "
                  "| worst class slowdown | queue p50 (s) | transfer (MB) |", "|---|---|---|---|---|---|---|---|---|"]
        for name, s in summaries.items():
            o = s.overall
            lines.append(f"| {name} | {s.duration_s:.2f} | {o.throughput_rps:.3f} | {o.output_tokens_per_s:.1f} "
                         f"| {_fmt(s.goodput_per_gpu_rps)} | {_fmt(s.jain_fairness)} "
                         f"| {_fmt(s.max_class_slowdown, digits=2)} "
                         f"| {_fmt(o.queue.p50_s)} | {o.transfer_bytes / 1e6:.1f} |")
        header = _HEADER.format(first="run / class")
        lines += ["", "## Per class", "", header, _separator(header)]
        lines += [_row(f"{name} / {cls}", c) for name, s in summaries.items() for cls, c in s.per_class.items()]
        reasons = {name: s.overall.reasons for name, s in summaries.items() if s.overall.reasons}
        if reasons:
            lines += ["", "## Rejections and failures", ""]
            lines += [f"- {name}: " + ", ".join(f"{r or '(no reason)'} x{n}" for r, n in rs.items())
                      for name, rs in reasons.items()]
    if sweeps:
        header = _HEADER.format(first="run @ rate")
        lines += ["", "## Rate sweeps", "", header, _separator(header)]
        lines += [_row(f"{name} @ {rate:g}", s.overall) for name, points in sweeps.items() for rate, s in points]
    if plot_names:
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plot_names]
    return "\n".join(lines) + "\n"


def write_report(out_dir: str | Path, runs: Mapping[str, RunInput], *, slo: SLO | None = None, num_gpus: int = 1,
                 sweeps: Mapping[str, Sequence[tuple[float, RunInput]]] | None = None, title: str = "kvbaton bench",
                 extra: Mapping[str, Any] | None = None, plots: bool = True,
                 save_records: bool = True) -> ReportFiles:
    """Summarises each run (records are summarised under `slo` and `num_gpus`) and writes the files.

    `extra` is copied into report.json under "extra" (workload description, command line, ...).
    With `save_records`, each run given as records is also written as records-<run>.jsonl.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def as_summary(run: RunInput) -> Summary:
        return run if isinstance(run, Summary) else summarize(run, slo, num_gpus)

    summaries = {name: as_summary(run) for name, run in runs.items()}
    sweep_summaries = {name: [(rate, as_summary(run)) for rate, run in points]
                       for name, points in (sweeps or {}).items()}
    record_runs = {name: list(run) for name, run in runs.items() if not isinstance(run, Summary)}
    if save_records:
        for name, records in record_runs.items():
            write_records(out / f"records-{_slug(name)}.jsonl", records)

    plot_paths: list[Path] = []
    if plots:
        from kvbaton.bench import plots as plotting

        if record_runs:
            plot_paths.append(plotting.plot_cdf(out / "ttft_cdf.png", record_runs, "ttft", slo.ttft_s if slo else None))
            plot_paths.append(plotting.plot_cdf(out / "tpot_cdf.png", record_runs, "tpot", slo.tpot_s if slo else None))
        if summaries:
            plot_paths.append(plotting.plot_class_bars(out / "class_bars.png", summaries))
        if sweep_summaries:
            plot_paths.append(plotting.plot_sweep(out / "latency_vs_rate.png", sweep_summaries, "latency"))
            if slo is not None:
                plot_paths.append(plotting.plot_sweep(out / "attainment_vs_rate.png", sweep_summaries, "attainment"))

    report = {
        "title": title,
        "slo": asdict(slo) if slo else None,
        "num_gpus": num_gpus,
        "runs": {name: s.to_dict() for name, s in summaries.items()},
        "sweeps": {name: [{"rate_rps": rate, "summary": s.to_dict()} for rate, s in points]
                   for name, points in sweep_summaries.items()},
        "plots": [p.name for p in plot_paths],
        "extra": dict(extra or {}),
    }
    json_path = out / "report.json"
    json_path.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
    markdown_path = out / "report.md"
    markdown_path.write_text(render_markdown(title, summaries, sweep_summaries, [p.name for p in plot_paths]))
    return ReportFiles(json_path, markdown_path, tuple(plot_paths), summaries)


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name) or "run"
