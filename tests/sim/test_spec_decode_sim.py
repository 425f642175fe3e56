"""Speculative decoding in the simulator: the live scheduler's prompt-lookup drafts over outputs that copy their
prompt (`CopyingOutputs`), checked by the simulated worker as a greedy model checks them."""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace

import pytest

from kvbaton.bench.records import RequestRecord
from kvbaton.bench.workloads import create_workload
from kvbaton.bench.workloads.base import WorkloadRequest
from kvbaton.sim.cli import add_sim_arguments, run_sim
from kvbaton.sim.outputs import FIRST_FRESH_TOKEN, CopyingOutputs
from kvbaton.sim.run import SimSetup, build_sim, simulate

PROMPT = list(range(1000, 1400))


def copying(copy_fraction: float, mean_span: float = 16.0, seed: int = 0) -> CopyingOutputs:
    outputs = CopyingOutputs(copy_fraction, mean_span, seed)
    outputs.prompt_of = lambda request_id: PROMPT
    return outputs


def test_copying_outputs_copy_about_their_fraction_in_spans_and_repeat_exactly() -> None:
    outputs = copying(0.5)
    tokens = [outputs("r", i) for i in range(20_000)]
    copied = [t < FIRST_FRESH_TOKEN for t in tokens]
    assert all(t in PROMPT for t, c in zip(tokens, copied) if c)
    assert 0.4 < sum(copied) / len(copied) < 0.6
    # Within a span each copied token follows the one before it in the prompt; spans average ~16 tokens.
    num_spans = sum(1 for i, c in enumerate(copied) if c and (i == 0 or not copied[i - 1]
                                                                or tokens[i] != tokens[i - 1] + 1))
    assert 10 < sum(copied) / num_spans < 24
    again = copying(0.5)
    assert [again("r", i) for i in reversed(range(200))] == tokens[:200][::-1]  # asked in any order
    assert [copying(0.5, seed=1)("r", i) for i in range(200)] != tokens[:200]
    assert all(t >= FIRST_FRESH_TOKEN for t in (copying(0.0)("r", i) for i in range(500)))
    assert all(t in PROMPT for t in (copying(1.0)("r", i) for i in range(500)))
    with pytest.raises(ValueError):
        CopyingOutputs(1.5)


def requests(rate: float = 2.0, num: int = 120) -> list[WorkloadRequest]:
    return create_workload("sharegpt-like", num_requests=num, seed=0, rate=rate)


def setup(k: int, **changes: object) -> SimSetup:
    base = SimSetup(model="llama-3-8b", gpu="h100", cluster="1xmixed", policy="round_robin",
                    num_speculative_tokens=k, spec_max_running=256, output_copy_fraction=0.5)
    return replace(base, **changes)


def mean_tpot(records: list[RequestRecord]) -> float:
    return statistics.mean((r.token_times_s[-1] - r.token_times_s[0]) / (len(r.token_times_s) - 1)
                           for r in records if len(r.token_times_s) > 1)


def test_drafts_from_copied_spans_are_accepted_and_cut_time_per_token() -> None:
    workload = requests()
    plain = simulate(workload, setup(0))
    spec = simulate(workload, setup(4))
    for result in (plain, spec):
        assert [r.status for r in result.records] == ["completed"] * len(workload)
        assert [r.output_tokens for r in result.records] == [w.output_tokens for w in workload]
    drafts = sum(w.num_draft_tokens for w in spec.workers)
    accepted = sum(w.num_accepted_tokens for w in spec.workers)
    assert drafts > 0 and 0.5 < accepted / drafts <= 1.0
    assert sum(w.num_draft_tokens for w in plain.workers) == 0
    assert mean_tpot(spec.records) < 0.8 * mean_tpot(plain.records)
    assert sum(w.num_steps for w in spec.workers) < sum(w.num_steps for w in plain.workers)


def test_outputs_that_never_repeat_their_prompt_get_no_accepted_drafts() -> None:
    result = simulate(requests(num=40), setup(4, output_copy_fraction=0.0))
    assert sum(w.num_accepted_tokens for w in result.workers) == 0


def test_speculating_workers_output_the_same_tokens_and_free_every_block() -> None:
    """The tokens each request outputs do not depend on speculation (drafts only decide how many come per step),
    and the rejected drafts' blocks go back: at the end only the prefix cache holds blocks."""
    workload = requests(rate=20.0, num=60)
    seen: dict[int, dict[str, list[int]]] = {}
    for k in (0, 4):
        sim, _, _ = build_sim(setup(k, cluster="1P1D"))
        outputs: dict[str, list[int]] = {}
        for worker in sim.workers.values():
            take_finished = worker.scheduler.take_finished

            def record(take_finished=take_finished):  # noqa: ANN001, ANN202
                finished = take_finished()
                for request in finished:
                    outputs.setdefault(request.request_id, []).append(list(request.output_token_ids))
                return finished

            worker.scheduler.take_finished = record
        records = sim.run(workload)
        assert all(r.status == "completed" for r in records)
        for worker in sim.workers.values():
            worker.scheduler.check_invariants()
            cached = worker.cache.num_cached_blocks if worker.cache is not None else 0
            assert worker.pool.num_used_blocks == cached
        seen[k] = {rid: outs[-1] for rid, outs in outputs.items()}  # the decode worker's (last) view
    assert seen[0] == seen[4]
    assert any(len(tokens) > 1 for tokens in seen[4].values())


def test_cli_takes_speculation_and_copying_outputs(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    args = parser.parse_args(["--workload", "sharegpt-like", "--num-requests", "30", "--rate", "2", "--cluster",
                              "1xmixed", "--speculative-tokens", "4", "--spec-max-running", "64",
                              "--output-copy-fraction", "0.5", "--no-progress", "--json"])
    assert run_sim(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["simulator"]["speculative_tokens"] == 4
    workers = next(iter(report["workers"].values()))
    assert sum(w["num_accepted_tokens"] for w in workers) > 0
