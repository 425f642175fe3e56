"""Admission control wired into the simulator: rejected records, baseline's decode gate, determinism."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvbaton.bench.metrics import SLO, summarize
from kvbaton.bench.records import RequestRecord
from kvbaton.bench.workloads import create_workload
from kvbaton.core.errors import InvalidRequestError
from kvbaton.sim.run import SimSetup, simulate

SLO_S = (0.5, 0.1)
# A decode worker with little KV (300 blocks = 4,800 tokens) behind a fast prefill worker: decode is the bottleneck.
SETUP = SimSetup(model="opt-13b", gpu="a100", cluster="1P1D:link=nvlink-a100", cost_model="distserve",
                 num_blocks=300, max_model_len=2048, enable_prefix_cache=False, admission_slo=SLO_S)
REQUESTS = [r for r in create_workload("sharegpt-like", num_requests=160, seed=3, rate=12.0)
            if r.num_prompt_tokens + r.output_tokens <= 1500][:120]


def run(admission: str) -> list[RequestRecord]:
    return simulate(REQUESTS, replace(SETUP, admission=admission)).records


@pytest.fixture(scope="module")
def runs() -> dict[str, list[RequestRecord]]:
    return {name: run(name) for name in ("none", "baseline", "early", "predicted")}


def test_every_request_gets_one_record_and_none_rejects_nothing(runs: dict[str, list[RequestRecord]]) -> None:
    ids = [r.request_id for r in REQUESTS]
    for records in runs.values():
        assert [r.request_id for r in records] == ids
    assert not any(r.status == "rejected" for r in runs["none"])


def test_variants_reject_with_reasons_and_protect_admitted_requests(runs: dict[str, list[RequestRecord]]) -> None:
    slo = SLO(*SLO_S)
    unprotected = summarize(runs["none"], slo).overall.slo_attainment
    assert unprotected is not None and unprotected < 0.8
    for name in ("baseline", "early", "predicted"):
        rejected = [r for r in runs[name] if r.status == "rejected"]
        assert rejected, name
        assert all(r.reason.startswith(("prefill over capacity", "decode over capacity")) for r in rejected)
        admitted = [r for r in runs[name] if r.status != "rejected"]
        attained = summarize(admitted, slo).overall.slo_attainment
        assert attained is not None and attained > unprotected, name


def test_refusals_after_the_prefill_come_from_the_decode_gate(runs: dict[str, list[RequestRecord]]) -> None:
    def after_prefill(records: list[RequestRecord]) -> list[RequestRecord]:
        return [r for r in records if r.status == "rejected" and r.first_token_s is not None]

    wasted = {name: after_prefill(runs[name]) for name in ("baseline", "early", "predicted")}
    for records in wasted.values():
        assert all(r.reason.startswith("decode over capacity") and r.output_tokens == 1 for r in records)
    # Baseline never looks at decode before the prefill: it throws away the most prefill work.
    assert len(wasted["baseline"]) > len(wasted["early"]) >= len(wasted["predicted"])


def test_admission_runs_are_deterministic(runs: dict[str, list[RequestRecord]]) -> None:
    assert run("predicted") == runs["predicted"]


def test_admission_needs_an_slo() -> None:
    with pytest.raises(InvalidRequestError):
        simulate(REQUESTS[:2], replace(SETUP, admission="early", admission_slo=None))


def test_kvbaton_sim_admission_flag(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from kvbaton.cli import main

    argv = ["sim", "--workload", "sharegpt-like", "--model", "opt-13b", "--gpu", "a100", "--cost-model", "distserve",
            "--cluster", "1P1D:link=nvlink-a100", "--num-blocks", "300", "--max-model-len", "2048", "--rate", "12",
            "--num-requests", "60", "--seed", "3", "--no-prefix-cache", "--ttft-slo", "0.5", "--tpot-slo", "0.1",
            "--json", "--admission"]
    assert main([*argv, "early"]) == 0
    run = next(iter(json.loads(capsys.readouterr().out)["runs"].values()))
    assert run["overall"]["num_rejected"] > 0
    assert main([*argv[:-6], "--json", "--admission", "early"]) == 2  # no SLO to protect
    assert "admission_slo" in capsys.readouterr().err
