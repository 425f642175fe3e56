"""Records round-trip through JSON; reports write JSON, Markdown and PNGs, alone and side by side."""

from __future__ import annotations

import json

import pytest

from kvbaton.bench.metrics import SLO, summarize
from kvbaton.bench.records import RequestRecord, read_records, write_records
from kvbaton.bench.report import write_report
from kvbaton.core.errors import InvalidRequestError


def run(scale: float) -> list[RequestRecord]:
    records = []
    for i in range(20):
        arrival = i * 0.1
        tokens = tuple(arrival + scale * (0.2 + 0.05 * k) for k in range(4))
        records.append(RequestRecord(request_id=f"r{i}", arrival_s=arrival, slo_class="A" if i % 2 else "B",
                                     prompt_tokens=100, cached_tokens=50 * (i % 2), output_tokens=4,
                                     first_token_s=tokens[0], token_times_s=tokens, finish_s=tokens[-1],
                                     worker_ids=("w0",), queue_s=0.01))
    records.append(RequestRecord(request_id="x", arrival_s=2.0, status="failed", reason="timeout", finish_s=3.0))
    return records


def test_record_json_round_trip(tmp_path) -> None:
    records = run(1.0)
    path = tmp_path / "r.jsonl"
    write_records(path, records)
    assert read_records(path) == records
    with pytest.raises(InvalidRequestError):
        RequestRecord.from_dict({"request_id": "a", "arrival_s": 0.0, "bogus": 1})
    with pytest.raises(InvalidRequestError):
        RequestRecord(request_id="a", arrival_s=0.0, status="done")
    with pytest.raises(InvalidRequestError):
        RequestRecord(request_id="a", arrival_s=0.0, token_times_s=(2.0, 1.0))
    with pytest.raises(InvalidRequestError):  # a decrease after a tie, anywhere in the sequence
        RequestRecord(request_id="a", arrival_s=0.0, token_times_s=(0.5, 1.0, 1.0, 0.75, 2.0))
    assert RequestRecord(request_id="a", arrival_s=0.0, token_times_s=(1.0, 1.0, 2.0)).output_tokens == 0


def test_comparison_report(tmp_path) -> None:
    slo = SLO(ttft_s=0.3, tpot_s=0.06)
    sweep = [(rate, run(scale)) for rate, scale in ((1.0, 1.0), (2.0, 1.5), (4.0, 2.0))]
    files = write_report(tmp_path, {"fast": run(1.0), "slow": run(2.0)}, slo=slo, num_gpus=2,
                         sweeps={"fast": sweep}, title="compare", extra={"workload": "unit"})
    report = json.loads(files.json_path.read_text())
    assert list(report["runs"]) == ["fast", "slow"]
    assert report["slo"] == {"ttft_s": 0.3, "tpot_s": 0.06}
    assert report["extra"] == {"workload": "unit"}
    assert report["runs"]["fast"] == summarize(run(1.0), slo, 2).to_dict()
    # fast: TTFT 0.2 s, TPOT 0.05 s meet the SLO; slow: TTFT 0.4 s misses; 20 of 21 complete
    assert report["runs"]["fast"]["overall"]["slo_attainment"] == pytest.approx(20 / 21)
    assert report["runs"]["slow"]["overall"]["slo_attainment"] == 0.0
    assert [p["rate_rps"] for p in report["sweeps"]["fast"]] == [1.0, 2.0, 4.0]
    md = files.markdown_path.read_text()
    assert "# compare" in md and "| fast |" in md and "| slow / A |" in md and "timeout x1" in md
    names = sorted(p.name for p in files.plot_paths)
    assert names == ["attainment_vs_rate.png", "class_bars.png", "latency_vs_rate.png", "tpot_cdf.png", "ttft_cdf.png"]
    for p in files.plot_paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert read_records(tmp_path / "records-fast.jsonl") == run(1.0)


def test_report_from_summaries_only(tmp_path) -> None:
    files = write_report(tmp_path, {"sim": summarize(run(1.0))}, plots=False)
    assert json.loads(files.json_path.read_text())["runs"]["sim"]["overall"]["num_failed"] == 1
    assert files.plot_paths == ()
