"""The simulator's per-step fast paths give exactly what the general code gives.

`CostModel.plan_s(plan)` must equal `step_s(BatchShape.of_plan(plan))` to the last bit (the roofline
overrides it to skip building the shape), and `SimWorker.stats()` must report what the scheduler's
own `stats()` does.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvbaton.cache.hashing import CacheKey
from kvbaton.core.config import CacheConfig, SchedulerConfig
from kvbaton.core.request import Request
from kvbaton.core.sampling import SamplingParams
from kvbaton.core.step import SampledToken, ScheduledChunk, StepPlan, StepResult
from kvbaton.router.load import WorkerStats
from kvbaton.sim.catalog import GPUS, get_model
from kvbaton.sim.costs import BatchShape, LinearCostModel, Parallelism, RooflineCostModel
from kvbaton.sim.costs.linear import DISTSERVE_A100_PATH, load_linear_model
from kvbaton.sim.spec import parse_cluster_spec
from kvbaton.sim.worker import SimWorker

_chunk = st.builds(
    lambda start, n, samples: ScheduledChunk("r", start, tuple(range(n)), (0,), samples),
    st.integers(0, 5000), st.integers(0, 600), st.booleans())


@settings(max_examples=200, deadline=None)
@given(chunks=st.lists(_chunk, max_size=12), tp=st.sampled_from([1, 2, 4]), pp=st.sampled_from([1, 2]),
       model=st.sampled_from(["llama-3-8b", "llama-2-7b", "opt-13b"]))
def test_roofline_plan_s_is_step_s_of_the_shape(chunks: list[ScheduledChunk], tp: int, pp: int, model: str) -> None:
    cost = RooflineCostModel(get_model(model), GPUS["h100"])
    plan = StepPlan(1, tuple(chunks), sum(c.num_tokens for c in chunks))
    parallel = Parallelism(tp, pp)
    assert cost.plan_s(plan, parallel) == cost.step_s(BatchShape.of_plan(plan), parallel)  # bit-exact


def test_linear_model_uses_the_default_plan_s() -> None:
    cost = load_linear_model(DISTSERVE_A100_PATH, "opt-13b")
    assert isinstance(cost, LinearCostModel)
    plan = StepPlan(1, (ScheduledChunk("a", 40, (7,), (0,), True), ScheduledChunk("b", 0, tuple(range(300)), (1,), True)),
                    301)
    assert cost.plan_s(plan) == cost.step_s(BatchShape((300,), (0,), 1, 41))


def test_sim_worker_stats_match_the_scheduler_stats() -> None:
    spec = parse_cluster_spec("1xmixed").workers[0]
    worker = SimWorker(spec, SchedulerConfig(max_num_batched_tokens=64), CacheConfig(block_size=4, num_blocks=64),
                       CacheKey("m", "l"), RooflineCostModel(get_model("llama-3-8b"), GPUS["h100"]))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for i in range(4):  # shared prefix, so the cache holds blocks; more prompt than one step's budget
        worker.scheduler.add_request(Request(f"r{i}", [1] * 24 + [i] * 20, params, 0.0))
    for step in range(6):
        s = worker.scheduler.stats()
        stats = worker.stats()
        assert stats == WorkerStats(spec.worker_id, s.num_queued_prefill_tokens, s.num_used_blocks, s.num_free_blocks,
                                    s.num_running, s.num_waiting, s.num_cached_blocks, 4)
        assert stats.num_held_blocks == max(s.num_used_blocks - s.num_cached_blocks, 0)
        plan = worker.scheduler.schedule(float(step))
        sampled = {c.request_id: SampledToken(9) for c in plan.chunks if c.samples}
        worker.scheduler.update(plan, StepResult(plan.step_id, sampled), float(step))
    assert worker.stats().num_cached_blocks > 0
