"""The simulated cluster: exact output lengths, disaggregated handoffs, router feedback, determinism."""

from __future__ import annotations

import numpy as np
import pytest

from kvbaton.bench.metrics import summarize
from kvbaton.bench.records import RequestRecord
from kvbaton.bench.tokens import as_token_array
from kvbaton.bench.workloads import create_workload
from kvbaton.bench.workloads.base import WorkloadRequest
from kvbaton.core.config import CacheConfig, SchedulerConfig
from kvbaton.core.errors import InvalidRequestError
from kvbaton.sim.cluster import ClusterSim
from kvbaton.sim.config import SimConfig
from kvbaton.sim.costs import ConstantCostModel, create_cost_model
from kvbaton.sim.costs.linear import LinearCoefficients, LinearCostModel
from kvbaton.sim.run import SimSetup, simulate
from kvbaton.sim.spec import parse_cluster_spec


def small_workload(num: int = 40, seed: int = 0, prompt: int = 64, out: int = 6, gap_s: float = 0.01):
    rng = np.random.default_rng(seed)
    shared = rng.integers(20, 1000, size=prompt // 2)
    return [WorkloadRequest(i, i * gap_s, (as_token_array(np.concatenate(
        [shared, rng.integers(20, 1000, size=prompt // 2)])),), out + i % 3) for i in range(num)]


def test_disaggregated_requests_hand_off_kv_and_decode_elsewhere() -> None:
    cost = ConstantCostModel(0.01, kv_bytes_per_token=1000)
    sim = ClusterSim(parse_cluster_spec("2P2D:link=ethernet"), cost, SimConfig(cache=CacheConfig(16, 256)))
    requests = small_workload()
    records = sim.run(requests)
    assert [r.request_id for r in records] == [r.request_id for r in requests]
    assert all(r.completed for r in records)
    for record, request in zip(records, requests):
        assert record.output_tokens == request.output_tokens == len(record.token_times_s)
        assert record.worker_ids[0].startswith("p") and record.worker_ids[1].startswith("d")
        assert record.transfer_bytes == 1000 * request.num_prompt_tokens
        # The client sees the first token when the decode worker adopts the KV: one prefill step and the link
        # time after arrival at least; the second one decode step after that.
        assert record.token_times_s[0] - record.arrival_s >= 0.01 + 64_000 / 12.5e9 - 1e-12
        assert record.token_times_s[1] - record.token_times_s[0] >= 0.01 - 1e-12
    assert {r.worker_ids[1] for r in records} == {"d0", "d1"}
    links = sim.handoffs.links
    assert links["p0"].num_bytes + links["p1"].num_bytes == sum(r.transfer_bytes for r in records)
    # Every protocol leg ended: sources hold no blocks, destinations reserve none, idle pools hold only cache.
    for source in sim.handoffs.sources.values():
        source.check_invariants()
        assert source.num_live_transfers == 0 and source.num_held_blocks == 0
    for destination in sim.handoffs.destinations.values():
        destination.check_invariants()
        assert destination.num_live_transfers == 0 and destination.num_reserved_blocks == 0
    for worker in sim.workers.values():
        assert worker.pool.num_used_blocks == (worker.cache.num_cached_blocks if worker.cache else 0)


def test_decode_backpressure_queues_handoffs_until_blocks_free() -> None:
    cost = ConstantCostModel(0.01, kv_bytes_per_token=10)
    # 16 blocks of 16 on the decode worker: a reservation takes 4, a decoding request grows to 5-6,
    # so many reservations are refused at first (backpressure) and retried.
    sim = ClusterSim(parse_cluster_spec("2P1D"), cost, SimConfig(cache=CacheConfig(16, 16)))
    records = sim.run(small_workload(num=12, gap_s=0.01, out=20))
    assert all(r.completed and r.output_tokens >= 20 for r in records)
    assert max(len(w.pending_handoffs) for w in sim.workers.values()) == 0
    assert sim.handoffs.destinations["d0"].num_refusals > 0  # reservations were refused, then retried
    ttfts = sorted(r.ttft_s for r in records)
    assert ttfts[-1] > 10 * ttfts[0]  # refused requests waited for decode blocks before their prefill


def test_requests_longer_than_the_context_fail_with_a_reason() -> None:
    sim = ClusterSim(parse_cluster_spec("1xmixed"), ConstantCostModel(0.01), SimConfig(max_model_len=100))
    records = sim.run(small_workload(num=2, prompt=120))
    assert [r.status for r in records] == ["failed", "failed"] and "max_model_len" in records[0].reason


def test_router_hears_kv_events_and_locality_raises_hit_ratio() -> None:
    requests = create_workload("tool-use", num_requests=300, seed=1, rate=30.0)
    hit = {}
    for policy in ("round_robin", "longest_prefix"):
        result = simulate(requests, SimSetup(cluster="4xmixed", policy=policy, model="llama-3-8b", gpu="a100"))
        assert all(r.completed for r in result.records)
        hit[policy] = summarize(result.records).overall.cache_hit_ratio
    assert hit["longest_prefix"] > hit["round_robin"] + 0.05
    sim_setup = SimSetup(cluster="2xmixed", policy="preble")
    from kvbaton.sim.run import build_sim

    sim, _, _ = build_sim(sim_setup)
    sim.run(requests[:50])
    assert all(sim.state.index.num_worker_blocks(w) > 0 for w in ("w0", "w1"))


@pytest.mark.parametrize("cluster", ["3xmixed", "2P1D:tp_p=2"])
def test_same_seed_same_records(cluster: str) -> None:
    requests = create_workload("shared-prefix", num_requests=60, seed=4, rate=40.0)
    setup = SimSetup(cluster=cluster, policy="preble", seed=4)
    assert simulate(requests, setup).records == simulate(requests, setup).records


def test_roofline_cost_makes_time_pass_sensibly() -> None:
    cost = create_cost_model("roofline", "llama-3-8b", "h100")
    sim = ClusterSim(parse_cluster_spec("1xmixed"), cost, SimConfig(cache=CacheConfig(16, 4096),
                                                                   scheduler=SchedulerConfig(2048)))
    (record,) = sim.run([WorkloadRequest(0, 0.0, (as_token_array(np.arange(20, 2020)),), 11)])
    assert record.ttft_s == pytest.approx(cost.prefill_s(2000), rel=1e-9)
    assert 0.004 < record.tpot_s < 0.02  # a lone H100 decode of an 8B model: ~5-10 ms


def test_handoff_leases_expire_when_the_prefill_is_too_slow() -> None:
    # Every step takes 1 s; a granted reservation with a 0.5 s lease expires before the prefill
    # ends, so the protocol aborts both legs, the prefill is cancelled and the decode blocks freed.
    config = SimConfig(cache=CacheConfig(16, 64), handoff_lease_s=0.5)
    sim = ClusterSim(parse_cluster_spec("1P1D"), ConstantCostModel(1.0, kv_bytes_per_token=10), config)
    records = sim.run(small_workload(num=3, gap_s=0.0))
    assert [r.status for r in records] == ["failed"] * 3
    assert all("lease expired" in r.reason for r in records)
    assert sim.workers["d0"].pool.num_used_blocks == 0 and sim.handoffs.sources["p0"].num_held_blocks == 0


def test_first_token_leaves_the_decode_worker_unless_told_to_count_it_at_the_prefill() -> None:
    cost = ConstantCostModel(0.01, kv_bytes_per_token=1000)
    requests = small_workload()
    at = {where: ClusterSim(parse_cluster_spec("2P2D:link=ethernet"), cost,
                            SimConfig(cache=CacheConfig(16, 256), first_token_at=where)).run(requests)
          for where in ("decode", "prefill")}
    for via_decode, via_prefill in zip(at["decode"], at["prefill"]):
        # The KV crosses the link before the decode worker streams the first token; the rest is the same.
        assert via_decode.first_token_s >= via_prefill.first_token_s + 64_000 / 12.5e9 - 1e-12
        assert via_decode.token_times_s[1:] == via_prefill.token_times_s[1:]
    with pytest.raises(InvalidRequestError, match="first_token_at"):
        SimConfig(first_token_at="router")


def test_step_noise_is_seeded_per_worker_keeps_the_mean_and_zero_means_exact() -> None:
    def run(sigma: float, seed: int) -> tuple[list[RequestRecord], float]:
        cost = LinearCostModel({1: LinearCoefficients((0.01, 1e-4, 0.0, 0.0), (0.005, 0.0, 1e-4),
                                                      (0.005, 0.0, 1e-4))}, 0)
        cost.step_noise_sigma = sigma
        sim = ClusterSim(parse_cluster_spec("2xmixed"), cost, SimConfig(cache=CacheConfig(16, 256), seed=seed))
        records = sim.run(small_workload(num=12, gap_s=0.05, out=20))
        return records, sum(w.busy_s for w in sim.workers.values()) / sum(w.num_steps for w in sim.workers.values())

    exact, exact_step_s = run(0.0, 0)
    assert run(0.0, 1)[0] == exact  # without noise the seed only breaks routing ties, none here
    noisy, noisy_step_s = run(0.3, 0)
    assert run(0.3, 0)[0] == noisy and run(0.3, 1)[0] != noisy  # seeded: same seed, same run
    assert noisy != exact and abs(noisy_step_s / exact_step_s - 1.0) < 0.2  # lognormal with mean 1


def test_step_noise_follows_an_ar1_whose_rho_zero_case_is_independent_lognormal_draws() -> None:
    import math
    import random

    from kvbaton.cache.hashing import CacheKey
    from kvbaton.sim.spec import parse_cluster_spec as parse
    from kvbaton.sim.worker import SimWorker

    def factors(sigma: float, rho: float, n: int) -> list[float]:
        cost = LinearCostModel({1: LinearCoefficients((0.01, 0.0, 0.0, 0.0), (0.005, 0.0, 0.0),
                                                      (0.005, 0.0, 0.0))}, 0)
        cost.step_noise_sigma, cost.step_noise_rho = sigma, rho
        worker = SimWorker(parse("1xmixed").workers[0], SchedulerConfig(), CacheConfig(16, 64),
                           CacheKey("r", "l"), cost, rng=random.Random(7))
        return [worker._noise() for _ in range(n)]

    reference = random.Random(7)  # independent steps: exactly exp(N(-sigma^2/2, sigma)) from the same stream
    assert factors(0.3, 0.0, 50) == [math.exp(reference.gauss(-0.3 * 0.3 / 2, 0.3)) for _ in range(50)]
    logs = np.log(factors(0.3, 0.9, 20_000))
    assert np.corrcoef(logs[:-1], logs[1:])[0, 1] == pytest.approx(0.9, abs=0.02)
    assert np.std(logs) == pytest.approx(0.3, rel=0.1) and np.mean(np.exp(logs)) == pytest.approx(1.0, abs=0.03)


def test_late_reservation_holds_decode_kv_only_for_prefills_about_to_run() -> None:
    cost = ConstantCostModel(0.01, kv_bytes_per_token=10)
    burst = small_workload(num=30, gap_s=0.0001)  # 64-token prompts; the prefill worker computes 64 per step
    peaks: dict[str, int] = {}
    for mode, ahead in (("eager", None), ("late", 64)):
        sim = ClusterSim(parse_cluster_spec("1P1D"), cost, SimConfig(
            cache=CacheConfig(16, 512), scheduler=SchedulerConfig(max_num_batched_tokens=64),
            reserve_ahead_tokens=ahead))
        destination = sim.handoffs.destinations["d0"]
        deliver = sim.handoffs.deliver
        peak = [0]

        def spy(delivery, now, deliver=deliver, destination=destination, peak=peak):
            events = deliver(delivery, now)
            peak[0] = max(peak[0], destination.num_reserved_blocks)
            return events

        sim.handoffs.deliver = spy
        records = sim.run(burst)
        assert all(r.completed and r.output_tokens == q.output_tokens for r, q in zip(records, burst))
        assert destination.num_live_transfers == 0 and destination.num_reserved_blocks == 0
        for worker in sim.workers.values():
            assert worker.pool.num_used_blocks == (worker.cache.num_cached_blocks if worker.cache else 0)
        peaks[mode] = peak[0]
    # Eager: every prompt of the burst holds its 4 blocks on the decode worker while it waits for the prefill
    # worker; late: only the one being prefilled and the next (64 tokens ahead at most), and one whose KV is
    # complete and waits for the end of the decode worker's step in flight to be adopted.
    assert peaks["eager"] == 30 * 4
    assert peaks["late"] <= 3 * 4


def test_reserve_ahead_must_not_be_negative() -> None:
    with pytest.raises(InvalidRequestError):
        SimConfig(reserve_ahead_tokens=-1)


class _SlowDecodeCost(ConstantCostModel):
    """Prefill steps take 0.1 s, all-decode steps 2 s: a handoff completes long before the decode step ends."""

    def step_s(self, shape, parallel=None) -> float:  # type: ignore[override]
        if not shape.num_tokens:
            return 0.0
        return 2.0 if shape.num_decodes and not shape.prefill_new_tokens else 0.1


def test_leg_whose_lease_runs_out_while_the_decode_step_runs_fails_cleanly() -> None:
    """A decode worker applies protocol messages mid-step but adopts after it: a complete leg whose lease ends
    first is never adopted; the request fails with the reason and every block is back (the destination freed
    them at expiry)."""
    # r0 decodes on d0 in 2 s steps (0.1 -> 2.1 -> ...). r1's KV is complete at 0.8 and its lease ends at 1.2;
    # leases are checked at events, and r2's arrival at 1.4 is one, before d0's step ends. r2's leg completes at
    # 1.5 and is adopted at 2.1, within its lease.
    requests = small_workload(num=3, gap_s=0.7)
    sim = ClusterSim(parse_cluster_spec("1P1D"), _SlowDecodeCost(kv_bytes_per_token=10), SimConfig(
        cache=CacheConfig(16, 64), handoff_lease_s=0.4))
    records = sim.run(requests)
    assert [r.status for r in records] == ["completed", "failed", "completed"], [(r.status, r.reason) for r in records]
    assert "lease" in records[1].reason, records[1].reason
    assert records[2].output_tokens == requests[2].output_tokens
    destination = sim.handoffs.destinations["d0"]
    assert destination.num_live_transfers == 0 and destination.num_reserved_blocks == 0
    for worker in sim.workers.values():
        assert worker.pool.num_used_blocks == (worker.cache.num_cached_blocks if worker.cache else 0)
