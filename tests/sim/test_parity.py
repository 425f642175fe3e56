"""Must-show 1 (same code): the live Engine and the simulator make identical scheduling decisions.

The real Engine runs tiny-random (torch) with a spy on its scheduler; the simulator runs the same
request stream on one mixed worker with a constant step cost, fed the tokens the engine sampled.
The engine is driven by the simulator's event semantics: a step that starts at t ends at t + step_s,
requests arriving up to then join the next step, and an idle worker starts a step at an arrival.
Every StepPlan (chunks, token ids, block ids, preemptions) must match, in order.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from kvbaton.bench.tokens import as_token_array
from kvbaton.bench.workloads.base import WorkloadRequest
from kvbaton.core.config import CacheConfig, EngineConfig, SchedulerConfig
from kvbaton.core.sampling import SamplingParams
from kvbaton.core.step import StepPlan
from kvbaton.engine.engine import Engine
from kvbaton.sim.cluster import ClusterSim
from kvbaton.sim.config import SimConfig
from kvbaton.sim.costs import ConstantCostModel
from kvbaton.sim.spec import parse_cluster_spec


CACHE = CacheConfig(block_size=4, num_blocks=24)
SCHEDULER = SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=4)


def make_stream(seed: int, step_s: float) -> list[WorkloadRequest]:
    """Prompts from 3 shared prefixes (cache hits), lengths that force chunking and, with 24 blocks, preemption."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(20, 200, size=n) for n in (12, 20, 9)]
    requests = []
    for i in range(14):
        prompt = np.concatenate([prefixes[i % 3], rng.integers(20, 200, size=int(rng.integers(3, 30)))])
        arrival_s = (0.0 if step_s == 0 else float(i // 2) * step_s * 1.5 + 0.5 * step_s)
        requests.append(WorkloadRequest(i, arrival_s, (as_token_array(prompt),), int(rng.integers(2, 12))))
    return requests


def drive_engine(engine: Engine, stream: list[WorkloadRequest], step_s: float) -> None:
    pending = list(stream)
    now = 0.0
    while pending or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests():
            now = max(now, pending[0].arrival_s)
            first = pending.pop(0)  # an idle worker starts a step at one arrival
            engine.add_request(first.prompt_array.tolist(), _params(first), request_id=first.request_id)
        engine.step()
        now += step_s
        while pending and pending[0].arrival_s <= now:
            r = pending.pop(0)
            engine.add_request(r.prompt_array.tolist(), _params(r), request_id=r.request_id)


def _params(r: WorkloadRequest) -> SamplingParams:
    return SamplingParams(max_tokens=r.output_tokens, temperature=0.0, ignore_eos=True)


def spy(scheduler: object, plans: list[StepPlan]) -> None:
    """Record every StepPlan the scheduler plans."""
    original: Callable[[float], StepPlan] = scheduler.schedule

    def schedule(now: float) -> StepPlan:
        plan = original(now)
        plans.append(plan)
        return plan

    scheduler.schedule = schedule


@pytest.mark.parametrize("step_s", [0.0, 1.0], ids=["zero-cost", "constant-cost"])
def test_engine_and_simulator_make_identical_step_plans(step_s: float) -> None:
    stream = make_stream(3, step_s)
    engine = Engine(EngineConfig(model="tiny-random", dtype="float32", cache=CACHE, scheduler=SCHEDULER))
    engine_plans: list[StepPlan] = []
    spy(engine.scheduler, engine_plans)
    tokens: dict[str, list[int]] = {}
    original_step = engine.step

    def step() -> list:
        outputs = original_step()
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return outputs

    engine.step = step
    drive_engine(engine, stream, step_s)
    assert all(len(tokens[r.request_id]) == r.output_tokens for r in stream)

    config = SimConfig(policy="round_robin", cache=CACHE, scheduler=SCHEDULER, max_model_len=engine.max_model_len,
                       cache_key=engine.cache_key)
    sim = ClusterSim(parse_cluster_spec("1xmixed"), ConstantCostModel(step_s), config,
                     token_for=lambda rid, index: tokens[rid][index])
    sim_plans: list[StepPlan] = []
    spy(sim.workers["w0"].scheduler, sim_plans)
    records = sim.run(stream)

    engine_nonempty = [p for p in engine_plans if not p.is_empty]
    assert [p for p in sim_plans if not p.is_empty] == engine_nonempty
    assert [r.output_tokens for r in records] == [r.output_tokens for r in stream]
    # The stream exercises what parity is about: prefix hits, chunked prefill and preemption.
    chunks = [c for p in engine_nonempty for c in p.chunks]
    assert any(c.start_pos > 0 and c.num_tokens > 1 for c in chunks)
    assert any(not c.samples for c in chunks)
    assert engine.stats().prefix_cache_hits_tokens > 0
    assert any(p.preempted_ids for p in engine_nonempty)
