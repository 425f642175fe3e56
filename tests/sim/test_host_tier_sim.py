"""The simulator's host KV tier: it serves evicted prefixes again, prices its copies, and keeps the runs exact."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest

from kvbaton.bench.metrics import summarize
from kvbaton.bench.records import RequestRecord
from kvbaton.bench.workloads import create_workload
from kvbaton.bench.workloads.base import WorkloadRequest
from kvbaton.core.config import CacheConfig
from kvbaton.core.errors import InvalidRequestError
from kvbaton.sim.cli import add_sim_arguments, run_sim
from kvbaton.sim.cluster import ClusterSim
from kvbaton.sim.config import SimConfig
from kvbaton.sim.costs import ConstantCostModel
from kvbaton.sim.host_link import HostLink
from kvbaton.sim.links import get_link
from kvbaton.sim.run import SimSetup, build_sim, simulate
from kvbaton.sim.spec import parse_cluster_spec

KV_BYTES_PER_TOKEN = 131072  # llama-3-8b: 2 x 32 layers x 8 KV heads x 128 x 2 bytes


def shared_prefix_requests(num_requests: int = 300, num_groups: int = 32) -> list[WorkloadRequest]:
    """System prompts of 2,048 tokens (32 of them: 65k tokens) against a device cache of 600 x 16 tokens."""
    return create_workload("shared-prefix", num_requests=num_requests, seed=0, rate=8.0, num_groups=num_groups,
                           prompts_per_group=16, system_prompt_tokens=2048, question_tokens=128, output_tokens=16)


def setup(host_kv_gb: float, **changes: object) -> SimSetup:
    base = SimSetup(model="llama-3-8b", gpu="h100", cluster="2xmixed", policy="round_robin", num_blocks=600,
                    host_kv_gb=host_kv_gb)
    return replace(base, **changes)


def run(host_kv_gb: float, requests: list[WorkloadRequest],
        **changes: object) -> tuple[ClusterSim, list[RequestRecord]]:
    sim, _, _ = build_sim(setup(host_kv_gb, **changes))
    return sim, sim.run(requests)


def test_host_tier_raises_hits_and_lowers_ttft_when_prefixes_exceed_the_device_cache() -> None:
    requests = shared_prefix_requests()
    without = simulate(requests, setup(0.0))
    with_tier = simulate(requests, setup(4.0))
    assert all(r.completed for r in without.records + with_tier.records)
    hits = [sum(w.prefix_cache_hits_tokens for w in result.workers) for result in (without, with_tier)]
    assert hits[1] > 2 * hits[0]
    ttft = [summarize(result.records).overall.ttft.mean_s for result in (without, with_tier)]
    assert ttft[1] < ttft[0]
    assert all(w.host_loaded_blocks > 0 and w.host_saved_blocks >= w.host_loaded_blocks for w in with_tier.workers)
    assert all(w.host_loaded_blocks == w.host_saved_blocks == 0 for w in without.workers)


def test_blocks_are_accounted_for_after_a_run_with_a_host_tier() -> None:
    sim, records = run(4.0, shared_prefix_requests(200))
    assert all(r.completed for r in records)
    for worker in sim.workers.values():
        cache = worker.cache
        assert cache is not None and cache.tier is not None and worker.host_link is not None
        cache.check_invariants()  # the tier's too: no block in both tiers, no host block leaked or taken
        worker.scheduler.check_invariants()
        assert worker.pool.num_used_blocks == cache.num_cached_blocks  # idle: only the cache holds blocks
        assert cache.tier.num_blocks == 4_000_000_000 // (KV_BYTES_PER_TOKEN * 16)
        assert 0 < cache.tier.num_cached_blocks <= cache.tier.num_blocks
        assert worker.host_link.num_loaded_blocks == cache.tier.num_loaded_blocks > 0
        assert worker.host_link.num_saved_blocks == cache.tier.num_saved_blocks


def test_same_seed_same_records_and_reports_with_a_host_tier() -> None:
    requests = shared_prefix_requests(200)
    first, second = run(4.0, requests, policy="preble", seed=3), run(4.0, requests, policy="preble", seed=3)
    assert first[1] == second[1]
    assert first[0].worker_reports() == second[0].worker_reports()


def test_copies_are_charged_to_the_next_general_step_at_the_host_link_rate() -> None:
    cost = ConstantCostModel(0.01, kv_bytes_per_token=1000)
    config = SimConfig(cache=CacheConfig(16, 300, host_num_blocks=1000), host_link="host-pcie4")
    sim = ClusterSim(parse_cluster_spec("1xmixed"), cost, config)
    assert all(r.completed for r in sim.run(shared_prefix_requests(60, num_groups=8)))
    worker = sim.workers["w0"]
    link = worker.host_link
    assert link is not None and link.num_loaded_blocks > 0 and link.num_saved_blocks > 0
    assert link.take_copy_s(0.0) == 0.0  # everything copied was charged to a step
    # Each step is 0.01 s of compute plus the copies made before it: each copy 10 us, and 16 kB per block at 25 GB/s.
    num_blocks = link.num_loaded_blocks + link.num_saved_blocks
    assert link.copy_s == pytest.approx(link.num_copies * 10e-6 + num_blocks * 16_000 / 25e9, rel=1e-12)
    assert worker.busy_s == pytest.approx(worker.num_steps * 0.01 + link.copy_s, rel=1e-12)


def test_decode_workers_keep_no_host_tier() -> None:
    sim, records = run(4.0, shared_prefix_requests(40), cluster="1P1D")
    assert all(r.completed for r in records)
    assert sim.workers["p0"].host_link is not None and sim.workers["d0"].host_link is None
    assert sim.workers["d0"].cache is None


def test_host_link_prices_copies_by_bytes_gpus_and_latency() -> None:
    link = HostLink(get_link("host-pcie5"), block_bytes=2_000_000, num_gpus=2)
    link.save([0, 1, 2], [5, 6, 7])
    link.load([5], [9])
    assert (link.num_saved_blocks, link.num_loaded_blocks) == (3, 1)
    assert link.take_copy_s(0.0) == pytest.approx(2 * 10e-6 + 4 * 2_000_000 / (2 * 50e9))
    assert link.take_copy_s(0.0) == 0.0


def test_host_kv_gb_needs_kv_bytes_and_a_prefix_cache() -> None:
    with pytest.raises(InvalidRequestError):
        build_sim(setup(4.0, cost_model="zero"))
    with pytest.raises(InvalidRequestError):
        build_sim(setup(4.0, enable_prefix_cache=False))
    with pytest.raises(InvalidRequestError):
        build_sim(setup(-1.0))


def test_sim_cli_host_kv_gb_reports_the_tier_per_worker(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    args = parser.parse_args(["--workload", "shared-prefix", "--num-requests", "200", "--rate", "8",
                              "--param", "num_groups=32", "--param", "output_tokens=16", "--cluster", "2xmixed",
                              "--num-blocks", "600", "--host-kv-gb", "4", "--json"])
    assert run_sim(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["simulator"]["host_kv_gb"] == 4.0
    workers = report["workers"]["round_robin"]
    assert all(w["host_loaded_blocks"] > 0 and w["host_saved_blocks"] > 0 for w in workers)
