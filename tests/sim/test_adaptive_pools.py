"""Adaptive pools in the simulator: after the mix shifts to long outputs, idle prefill workers are lent to
mixed duty, take whole requests, and SLO attainment recovers; every block is back afterwards."""

from __future__ import annotations

from dataclasses import replace

from kvbaton.bench.metrics import SLO, summarize
from kvbaton.bench.records import RequestRecord
from kvbaton.bench.workloads import create_workload
from kvbaton.router.pools import PoolConfig
from kvbaton.sim.cluster import ClusterSim
from kvbaton.sim.run import SimSetup, build_sim

SLO_ = SLO(ttft_s=1.0, tpot_s=0.02)


def run(adaptive: bool) -> tuple[float | None, float | None, list[RequestRecord], ClusterSim]:
    requests = create_workload("shifting-mix", num_requests=600, seed=0, rate=24.0, shift_fraction=0.3,
                               second_output_mean_tokens=800)
    setup = SimSetup(model="llama-3-8b", gpu="a100", cluster="3P1D", cost_model="roofline", enable_prefix_cache=False,
                     admission_slo=(SLO_.ttft_s, SLO_.tpot_s), adaptive_pools=adaptive,
                     pools=PoolConfig(sustain_s=0.5, cooldown_s=1.0, max_lent_per_pool=2))
    sim, _, _ = build_sim(setup)
    records = {r.request_id: r for r in sim.run(requests)}
    assert all(r.completed for r in records.values())
    late = [records[q.request_id] for q in requests if q.arrival_s > 0.7 * requests[-1].arrival_s]
    phase1 = [records[q.request_id] for q in requests if q.group == "phase1"]
    return (summarize(phase1, SLO_).overall.slo_attainment, summarize(late, SLO_).overall.slo_attainment,
            list(records.values()), sim)


def test_lent_prefill_workers_restore_attainment_after_the_shift_to_long_outputs() -> None:
    fixed_phase1, fixed_late, _, _ = run(adaptive=False)
    adaptive_phase1, adaptive_late, records, sim = run(adaptive=True)
    assert fixed_phase1 == adaptive_phase1 and fixed_phase1 is not None and fixed_phase1 > 0.98  # nothing lent yet
    assert fixed_late < 0.3 and adaptive_late > 0.9
    lent = [s for s in sim.pools.switches if s.lent]
    assert lent and all(s.role == "prefill" for s in lent) and lent[0].at_s > 0.3 * records[-1].arrival_s
    whole = [r for r in records if len(r.worker_ids) == 1]
    assert whole and {r.worker_ids[0] for r in whole} <= {s.worker_id for s in lent}
    assert all(r.transfer_bytes == 0 for r in whole)
    for worker in sim.workers.values():  # whole requests on lent workers freed their blocks like any other
        worker.scheduler.check_invariants()
        assert worker.pool.num_used_blocks == (worker.cache.num_cached_blocks if worker.cache else 0)
    for source in sim.handoffs.sources.values():
        assert source.num_live_transfers == 0 and source.num_held_blocks == 0


def test_same_seed_same_records_with_adaptive_pools() -> None:
    first, second = run(adaptive=True)[2], run(adaptive=True)[2]
    assert first == second


def test_splitwise_mixed_pool_on_heterogeneous_pools_is_the_lending() -> None:
    """Splitwise's mixed pool (H100 prompt machines, A100 token machines): when the token pool queues, a prompt
    machine joins a mixed pool, runs whole requests at its own GPU's speed, and goes back when prompts return."""
    shifted = create_workload("shifting-mix", num_requests=600, seed=0, rate=24.0, shift_fraction=0.3,
                              second_output_mean_tokens=800)
    tail = create_workload("sharegpt-like", num_requests=200, seed=1, rate=24.0, prompt_mean_tokens=1500,
                           prompt_std_tokens=500, output_mean_tokens=20, output_std_tokens=7)
    start_s = shifted[-1].arrival_s + 30.0  # the long outputs' backlog on the token machine has drained by then
    requests = shifted + [replace(r, index=len(shifted) + r.index, arrival_s=start_s + r.arrival_s, group="phase3")
                          for r in tail]
    setup = SimSetup(model="llama-3-8b", gpu="h100", cluster="3P1D:gpu_p=h100,gpu_d=a100", enable_prefix_cache=False,
                     admission_slo=(SLO_.ttft_s, SLO_.tpot_s), adaptive_pools=True,
                     pools=PoolConfig(sustain_s=0.5, cooldown_s=1.0, max_lent_per_pool=2))
    sim, _, _ = build_sim(setup)
    records = sim.run(requests)
    assert all(r.completed for r in records)
    lent = [s for s in sim.pools.switches if s.lent]
    back = [s for s in sim.pools.switches if not s.lent]
    assert lent and all(s.role == "prefill" for s in lent)
    assert sorted(s.worker_id for s in back) == sorted(s.worker_id for s in lent) and not sim.pools.lent
    assert all(s.at_s >= start_s and s.reason == "the decode pool is calm again" for s in back)
    whole = [r for r in records if len(r.worker_ids) == 1 and r.worker_ids[0].startswith("p")]
    assert whole and all(r.transfer_bytes == 0 for r in whole)
    for worker_id in {r.worker_ids[0] for r in whole}:
        assert sim.workers[worker_id].cost_model.name == "roofline:llama-3-8b@h100"
    assert sim.workers["d0"].cost_model.name == "roofline:llama-3-8b@a100"
    for worker in sim.workers.values():
        worker.scheduler.check_invariants()
        assert worker.pool.num_used_blocks == 0
