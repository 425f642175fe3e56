"""Regressions found by bug hunting: sampling parameters the API accepts must not make a step raise.

A step that raises ends the worker process and every request on it, not just the request that asked. Each test
failed on the code it was written against; the fixes it guards are named in its comment.
"""

from __future__ import annotations

import pytest

from kvbaton.core.config import CacheConfig, EngineConfig, SchedulerConfig
from kvbaton.core.sampling import SamplingParams
from kvbaton.engine.engine import Engine
from kvbaton.model.registry import LoadedModel, load_model


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random")


def run(loaded: LoadedModel, params: SamplingParams) -> list[int]:
    engine = Engine(EngineConfig(model="tiny-random", cache=CacheConfig(4, 64),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=16)), loaded=loaded)
    engine.add_request(list(range(3, 20)), params, request_id="r")
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    engine.check_invariants()
    return tokens


@pytest.mark.parametrize("temperature", [1e-6, 1e-38, 1e-45, 5e-324])
def test_a_tiny_temperature_samples_greedily(tiny: LoadedModel, temperature: float) -> None:
    # Was a bug (engine/sampler.py `Sampler._probs`, core/sampling.py `SamplingParams.greedy`): only temperature 0
    # was greedy, and a positive temperature below ~1e-37 divided the logits into inf (or, below float32's
    # smallest, by 0): softmax made NaNs and torch.multinomial raised, out of the step and the worker's loop. The
    # API accepts any temperature in [0, 100], so one request with "temperature": 1e-40 killed its worker.
    # Fixed: as vLLM, a temperature below 1e-5 samples greedily.
    params = SamplingParams(max_tokens=6, temperature=temperature, seed=3, ignore_eos=True)
    assert run(tiny, params) == run(tiny, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_tiny_repetition_penalty_runs(tiny: LoadedModel, temperature: float) -> None:
    # Was a bug (engine/sampler.py `adjust_logits`, `Sampler._probs`): a repetition penalty in (0, 1) divides the
    # positive logits of seen tokens; near 0 (the API accepts any value in (0, 10]) they overflowed to inf, softmax
    # made NaNs and a sampled request's step raised. Fixed: the tempered logits are capped at float32's max.
    params = SamplingParams(max_tokens=6, temperature=temperature, seed=3, ignore_eos=True, repetition_penalty=1e-40)
    tokens = run(tiny, params)
    assert len(tokens) == 6
