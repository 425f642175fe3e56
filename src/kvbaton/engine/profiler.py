"""`kvbaton profile`: time the live engine over a grid of batch shapes and fit the simulator's cost model.

Each grid point is a small request mix run to completion through the real `Engine`; every step's
plan (captured from the scheduler) becomes a `BatchShape` and its wall time, `engine.step()`
included (scheduling, the forward, sampling: what a live step costs), a sample. Prefill-only and
decode-only steps fit DistServe's form (`kvbaton.sim.costs.fit`); the file it writes is what
`kvbaton sim --cost-model FILE` reads. Prefix-cached prefills come from a warm-up request that
leaves the shared prefix in the radix cache. This module reads the wall clock on purpose: it
measures the live executor.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvbaton.core.config import CacheConfig, EngineConfig, SchedulerConfig
from kvbaton.core.sampling import SamplingParams
from kvbaton.engine.engine import Engine
from kvbaton.sim.costs.base import BatchShape
from kvbaton.sim.costs.fit import StepSample, fit_linear, fit_quality, read_step_samples
from kvbaton.model.registry import read_model_header, resolve_model_source
from kvbaton.sim.costs.linear import LinearCostModel


@dataclass(frozen=True, slots=True)
class ProfileGrid:
    prefill_tokens: tuple[int, ...] = (32, 128, 384, 768)  # new tokens of one prefill
    cached_tokens: tuple[int, ...] = (0, 256)  # prefix-cache hit under it
    prefill_batch: tuple[int, ...] = (1, 2)  # prefills in one step
    decode_batch: tuple[int, ...] = (1, 4, 16)  # decoding requests
    decode_context_tokens: tuple[int, ...] = (128, 512)  # context of each
    decode_steps: int = 4  # decode steps timed per (batch, context) point
    repeats: int = 2


QUICK_GRID = ProfileGrid((16, 64, 128), (0, 64), (1, 2), (1, 4), (32, 128), 3, 1)


class _Recorder:
    """Steps the engine until idle, keeping each step's plan (the engine's `last_plan`) with its wall time."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def run(self, samples: list[StepSample] | None) -> None:
        """Step until idle; keep (shape, seconds) of every non-empty step when `samples` is given."""
        while self.engine.has_unfinished_requests():
            started = time.perf_counter()
            self.engine.step()
            elapsed_s = time.perf_counter() - started
            plan = self.engine.last_plan
            if samples is not None and plan is not None and not plan.is_empty:
                samples.append(StepSample(BatchShape.of_plan(plan), elapsed_s))


def _tokens(seed: int, n: int, vocab: int) -> list[int]:
    # Deterministic, non-special ids, distinct per seed so prompts never share by accident.
    return [17 + (seed * 7919 + i * 104729) % (vocab - 17) for i in range(n)]


def measure(engine: Engine, grid: ProfileGrid) -> list[StepSample]:
    vocab = engine.loaded.config.vocab_size
    recorder = _Recorder(engine)
    samples: list[StepSample] = []
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    seed = 0
    for _ in range(grid.repeats):
        for cached in grid.cached_tokens:
            for new in grid.prefill_tokens:
                for batch in grid.prefill_batch:
                    seed += 1
                    prefix = _tokens(seed, cached, vocab)
                    if cached:
                        engine.add_request(prefix + [17], one)  # leaves the prefix in the radix cache
                        recorder.run(None)
                    for b in range(batch):
                        engine.add_request(prefix + _tokens(seed * 100 + b, new, vocab), one)
                    recorder.run(samples)
    for ctx in grid.decode_context_tokens:
        for batch in grid.decode_batch:
            seed += 1
            decode = SamplingParams(max_tokens=grid.decode_steps + 1, temperature=0.0, ignore_eos=True)
            for b in range(batch):
                engine.add_request(_tokens(seed * 100 + b, ctx, vocab), decode)
            recorder.run(samples)
    return samples


def profile_engine(model: str, out: str | Path, grid: ProfileGrid = ProfileGrid(), dtype: str = "auto",
                   max_num_batched_tokens: int = 2048) -> dict:
    """Measure, fit and write the coefficient file; returns what was written."""
    config = EngineConfig(model=model, dtype=dtype, cache=CacheConfig(num_blocks=4096),
                          scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=256))
    engine = Engine(config)
    measure(engine, QUICK_GRID)  # warm-up: allocator, kernels, caches; discarded
    samples = measure(engine, grid)
    kv_bytes = engine.loaded.config.kv_bytes_per_token(engine.loaded.dtype.itemsize)
    return write_profile(samples, model, kv_bytes, f"kvbaton profile --model {model} (live engine on "
                         f"{engine.config.device}, dtype {engine.loaded.dtype})", out)


def write_profile(samples: list[StepSample], model: str, kv_bytes_per_token: int, source: str,
                  out: str | Path, runs: Sequence[Sequence[StepSample]] = ()) -> dict:
    """Fit DistServe's form to `samples` and write the coefficient file `kvbaton sim --cost-model` reads.

    `runs`: the same samples as each serving worker logged them, in order (for the noise's correlation
    between consecutive steps; none for a profile over a grid of shapes, whose order means nothing)."""
    coefficients = fit_linear(samples)
    fitted = LinearCostModel({1: coefficients}, kv_bytes_per_token, name=f"profile:{model}")
    quality = {kind: asdict(fit_quality(fitted, [s for s in samples if _kind(s.shape) == kind]))
               for kind in ("prefill", "decode", "mixed")}
    payload = {
        "source": source,
        "time_unit": "s",
        "models": {model: {"kv_bytes_per_token": kv_bytes_per_token, "tp": {"1": coefficients.to_json()}}},
        "fit_quality": quality,
        "step_noise_sigma": step_noise_sigma(fitted, samples),
        "step_noise_rho": step_noise_rho(fitted, runs),
        "num_samples": len(samples),
    }
    Path(out).write_text(json.dumps(payload, indent=2) + "\n")
    return payload


def step_noise_sigma(model: LinearCostModel, samples: list[StepSample]) -> float:
    """The spread the simulator draws step times with: std of log(measured / predicted) over the samples."""
    logs = [math.log(s.duration_s / predicted) for s in samples
            if s.duration_s > 0 and (predicted := model.step_s(s.shape)) > 0]
    if len(logs) < 2:
        return 0.0
    mean = sum(logs) / len(logs)
    return round(math.sqrt(sum((x - mean) ** 2 for x in logs) / (len(logs) - 1)), 4)


def step_noise_rho(model: LinearCostModel, runs: Sequence[Sequence[StepSample]]) -> float:
    """Lag-1 correlation of log(measured / predicted) between consecutive steps of one worker, over all runs
    (each centred on its own mean); 0 without at least 10 consecutive pairs, never below 0."""
    pairs: list[tuple[float, float]] = []
    for run in runs:
        logs = [math.log(s.duration_s / predicted) for s in run
                if s.duration_s > 0 and (predicted := model.step_s(s.shape)) > 0]
        if len(logs) < 2:
            continue
        mean = sum(logs) / len(logs)
        centred = [x - mean for x in logs]
        pairs.extend(zip(centred, centred[1:]))
    if len(pairs) < 10:
        return 0.0
    covariance = sum(a * b for a, b in pairs)
    variance = math.sqrt(sum(a * a for a, _ in pairs) * sum(b * b for _, b in pairs))
    return round(max(covariance / variance, 0.0), 4) if variance > 0 else 0.0


def _kind(shape: BatchShape) -> str:
    if shape.prefill_new_tokens and shape.num_decodes:
        return "mixed"
    return "prefill" if shape.prefill_new_tokens else "decode"


def run_profile(args: argparse.Namespace) -> int:
    if args.from_step_log:
        runs = [read_step_samples([path]) for path in args.from_step_log]
        samples = [sample for run in runs for sample in run]
        model_config, _ = read_model_header(resolve_model_source(args.model))
        itemsize = 4 if args.dtype == "float32" else 2  # the serving default is bf16
        payload = write_profile(samples, args.model, model_config.kv_bytes_per_token(itemsize),
                                f"kvbaton profile --from-step-log ({len(args.from_step_log)} serving workers' logs)",
                                args.out, runs)
    else:
        if args.threads > 0:  # profile with the threads a serving worker gets, or its step times are not its own
            torch.set_num_threads(args.threads)
        payload = profile_engine(args.model, args.out, QUICK_GRID if args.quick else ProfileGrid(), args.dtype)
    if args.json:
        print(json.dumps(payload))
        return 0
    coeffs = next(iter(payload["models"].values()))["tp"]["1"]
    a, b, c, d = coeffs["prefill"]
    da, db, dc = coeffs["decode_small"]
    print(f"profiled {args.model}: {payload['num_samples']} steps -> {args.out}")
    print(f"  prefill  {a * 1e3:.3f} ms + {b * 1e6:.3f} us/token + {c * 1e9:.4f} ns/token^2 "
          f"+ {d * 1e9:.4f} ns/(new x cached)")
    print(f"  decode   {da * 1e3:.3f} ms + {db * 1e9:.3f} ns/context token + {dc * 1e6:.3f} us/sequence")
    for kind, q in payload["fit_quality"].items():
        if q["num_samples"]:
            print(f"  {kind:<8} mean |error| {100 * q['mean_abs_rel_error']:.1f} % over {q['num_samples']} steps")
    return 0

