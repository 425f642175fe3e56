"""Serving workers' step logs: back-to-back steps are timed start to start, a lone step by itself, and the
log round-trips into `kvbaton profile --from-step-log`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbaton.cli import main
from kvbaton.core.errors import InvalidRequestError
from kvbaton.core.step import ScheduledChunk, StepPlan
from kvbaton.model.registry import load_model
from kvbaton.server.base import GenerateCall
from kvbaton.server.cluster import ClusterManager
from kvbaton.server.step_log import StepLog
from kvbaton.sim.costs.base import BatchShape
from kvbaton.sim.costs.fit import StepSample, read_step_samples
from kvbaton.sim.costs.linear import load_linear_model
from tests.server.pd_helpers import collect, greedy, run_pd
from tests.server.test_worker_cluster import WorkerThread


def prefill(num_tokens: int, step_id: int = 0) -> StepPlan:
    return StepPlan(step_id, (ScheduledChunk("r", 0, tuple(range(num_tokens)), (0,), True),), num_tokens)


def decode(num_seqs: int, context: int) -> StepPlan:
    chunks = tuple(ScheduledChunk(f"d{i}", context - 1, (5,), (0,), True) for i in range(num_seqs))
    return StepPlan(1, chunks, num_seqs)


def test_busy_steps_last_until_the_next_start_and_idle_ones_until_their_end(tmp_path: Path) -> None:
    log = StepLog(tmp_path / "w.steps.jsonl")
    log.on_step(prefill(64), 10.0, 10.2, still_busy=True)
    log.on_step(decode(2, 65), 10.25, 10.27, still_busy=False)  # the loop's 50 ms counted in the prefill's period
    log.on_step(StepPlan(2, (), 0), 11.0, 11.0, still_busy=False)  # an empty plan: nothing to learn
    log.on_step(prefill(32), 12.0, 12.1, still_busy=True)
    log.on_idle()  # the queue ran dry after it: its own time
    log.write()
    assert read_step_samples([log.path]) == [
        StepSample(BatchShape((64,), (0,), 0, 0), pytest.approx(0.25)),
        StepSample(BatchShape((), (), 2, 130), pytest.approx(0.02)),
        StepSample(BatchShape((32,), (0,), 0, 0), pytest.approx(0.1)),
    ]


def test_profile_fits_step_logs_and_rejects_a_malformed_one(tmp_path: Path) -> None:
    log = StepLog(tmp_path / "w.steps.jsonl")
    t = 0.0
    for num_tokens in (16, 32, 64, 128, 256, 16, 64, 256):  # 10 ms + 0.1 ms/token
        log.on_step(prefill(num_tokens), t, t + 0.01 + 1e-4 * num_tokens, still_busy=False)
        t += 1.0
    for num_seqs in (1, 2, 4, 8, 1, 4, 8, 2):  # 20 ms + 1 ms/sequence
        log.on_step(decode(num_seqs, 100), t, t + 0.02 + 1e-3 * num_seqs, still_busy=False)
        t += 1.0
    log.write()
    out = tmp_path / "fit.json"
    assert main(["profile", "--model", "tiny-random", "--from-step-log", str(log.path), "--out", str(out)]) == 0
    fitted = json.loads(out.read_text())
    coefficients = fitted["models"]["tiny-random"]["tp"]["1"]
    assert coefficients["prefill"][:2] == pytest.approx([0.01, 1e-4], rel=1e-3, abs=1e-7)
    assert coefficients["decode_small"][0] == pytest.approx(0.02, rel=1e-2)
    assert fitted["num_samples"] == 16 and "step-log" in fitted["source"]
    assert fitted["step_noise_sigma"] < 0.01  # exact synthetic steps: no spread for the simulator to draw
    assert load_linear_model(out).step_noise_sigma == fitted["step_noise_sigma"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"num_decodes": 1}\n')
    with pytest.raises(InvalidRequestError, match="bad.jsonl:1: not a step sample"):
        read_step_samples([bad])


def test_a_serving_worker_writes_its_step_log_when_it_stops(tmp_path: Path) -> None:
    path = tmp_path / "w0.steps.jsonl"

    async def body(cluster: ClusterManager, workers: dict[str, WorkerThread]) -> None:
        deltas = await collect(cluster, GenerateCall("r-0", tuple(range(3, 83)), greedy(6), 0.0))
        assert deltas[-1].finished

    run_pd(load_model("tiny-random"), {"w0": "mixed"}, body, {"w0": {"step_log": str(path)}})
    samples = read_step_samples([path])
    # 80 prompt tokens in 64-token chunks, then decodes: two prefill steps and five decode steps at least.
    assert sum(s.shape.num_prefill_tokens for s in samples) == 80
    assert sum(s.shape.num_decodes for s in samples) >= 5 and all(s.duration_s > 0 for s in samples)


def test_noise_correlation_between_consecutive_steps_is_fitted_per_worker_run() -> None:
    import math
    import random

    from kvbaton.engine.profiler import step_noise_rho
    from kvbaton.sim.costs.linear import LinearCoefficients, LinearCostModel

    model = LinearCostModel({1: LinearCoefficients((0.01, 0.0, 0.0, 0.0), (0.02, 0.0, 0.0), (0.02, 0.0, 0.0))}, 0)
    shape = BatchShape((), (), 2, 100)

    def run(rho: float, seed: int, n: int = 4000) -> list[StepSample]:
        rng, z, out = random.Random(seed), 0.0, []
        for _ in range(n):
            z = rho * z + math.sqrt(1 - rho * rho) * rng.gauss(0.0, 1.0)
            out.append(StepSample(shape, 0.02 * math.exp(0.2 * z)))
        return out

    assert step_noise_rho(model, [run(0.8, 1), run(0.8, 2)]) == pytest.approx(0.8, abs=0.03)
    assert step_noise_rho(model, [run(0.0, 3)]) == pytest.approx(0.0, abs=0.05)
    assert step_noise_rho(model, [run(0.8, 4, n=5)]) == 0.0  # too few consecutive pairs to tell
