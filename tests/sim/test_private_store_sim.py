"""Private KV store nodes in the simulator (islands): each worker's node keeps what its worker wrote and serves that
worker alone, loads priced over its own host link; the router's directory is told the same; runs stay exact."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest

from kvbaton.bench.metrics import summarize
from kvbaton.bench.tokens import as_token_array
from kvbaton.bench.workloads import create_workload
from kvbaton.bench.workloads.base import WorkloadRequest
from kvbaton.cache.kv_store import DRAM, StoreEvent
from kvbaton.cache.store_directory import StoreDirectory
from kvbaton.cli import main
from kvbaton.core.errors import InvalidRequestError
from kvbaton.sim.cli import add_sim_arguments, run_sim
from kvbaton.sim.cluster import ClusterSim
from kvbaton.sim.config import StoreNodeLoss
from kvbaton.sim.run import SimSetup, build_sim, check_setup, simulate

KV_BYTES_PER_TOKEN = 131072  # llama-3-8b: 2 x 32 layers x 8 KV heads x 128 x 2 bytes
PREFIX_A = as_token_array(list(range(20, 20 + 2048)))  # 32 blocks of 64 tokens
PREFIX_B = as_token_array(list(range(5000, 5000 + 2048)))


def setup(**changes: object) -> SimSetup:
    base = SimSetup(model="llama-3-8b", gpu="h100", cluster="2xmixed", policy="round_robin", block_size=64,
                    num_blocks=2000, max_model_len=65536, kv_store_gb=1.0, kv_store_private=True)
    return replace(base, **changes)


def run(requests: list[WorkloadRequest], **changes: object) -> tuple[ClusterSim, list]:
    sim, _, _ = build_sim(setup(**changes))
    return sim, sim.run(requests)


def one_prefix_twice() -> list[WorkloadRequest]:
    """The prefix at 0 s (round robin: on w0) and at 5 s (on w1), each with its own tail."""
    tails = [as_token_array([7, 8, 9]), as_token_array([10, 11, 12])]
    return [WorkloadRequest(i, 5.0 * i, (PREFIX_A, tails[i]), 4) for i in range(2)]


def shared_prefix_requests(num_requests: int = 300) -> list[WorkloadRequest]:
    """System prompts of 2,048 tokens (32 of them: 65k tokens) against a device cache of 600 x 16 tokens."""
    return create_workload("shared-prefix", num_requests=num_requests, seed=0, rate=8.0, num_groups=32,
                           prompts_per_group=16, system_prompt_tokens=2048, question_tokens=128, output_tokens=16)


def small_device(**changes: object) -> SimSetup:
    """Two workers whose 600-block devices (16-token blocks) hold 4 of the 32 system prompts, with 4 GB of store."""
    return setup(**{"block_size": 16, "num_blocks": 600, "max_model_len": 0, "kv_store_gb": 4.0, **changes})


def test_a_private_store_keeps_what_the_device_evicted_and_loads_it_over_the_host_link() -> None:
    # One worker with room for one prefix: A, then B (evicting A from the device), then A again, from the store.
    requests = [WorkloadRequest(0, 0.0, (PREFIX_A, as_token_array([7])), 4),
                WorkloadRequest(1, 5.0, (PREFIX_B, as_token_array([8])), 4),
                WorkloadRequest(2, 10.0, (PREFIX_A, as_token_array([9])), 4)]
    sim, records = run(requests, cluster="1xmixed", num_blocks=40)
    assert all(r.completed for r in records) and records[2].cached_tokens == 2048
    worker = sim.workers["w0"]
    tier, io = worker.cache.tier, worker.store_io
    assert tier.num_saved_blocks == 64 and io.num_saved_blocks == 64  # both prefixes written through
    assert 0 < tier.num_loaded_blocks == io.num_loaded_blocks <= 32 and tier.num_remote_loaded_blocks == 0
    # its node's DRAM over its GPU's host link (PCIe 5), charged to the step that admitted the request
    prices = sim.config.store_prices
    assert io.copy_s == pytest.approx(prices.path_s(tier.num_loaded_blocks, remote=False, on_disk=False))
    assert io.wait_s == 0.0


def test_a_private_store_never_serves_another_worker() -> None:
    sim, records = run(one_prefix_twice())
    assert [r.worker_ids for r in records] == [("w0",), ("w1",)]
    assert records[1].cached_tokens == 0  # w0's node holds the prefix, but only for w0: w1 recomputes it
    w0, w1 = sim.store_of["w0"], sim.store_of["w1"]
    assert w0 is not w1 and list(w0.nodes) == ["w0"] and list(w1.nodes) == ["w1"]
    # each wrote its own copy: the put deduplicates per worker, not across the cluster
    assert sim.workers["w0"].cache.tier.num_saved_blocks == sim.workers["w1"].cache.tier.num_saved_blocks == 32
    assert sorted(w0.nodes["w0"].entries) == sorted(w1.nodes["w1"].entries)
    report = sim.store_report()
    assert report is not None and (report.loaded_blocks, report.remote_loaded_blocks, report.saved_blocks) == (0, 0, 64)
    _, shared_records = run(one_prefix_twice(), kv_store_private=False)
    assert shared_records[1].cached_tokens == 2048  # the shared store serves w1 from w0's node


def test_the_router_directory_is_private_too() -> None:
    sim, _ = run(one_prefix_twice(), policy="conductor")
    directory = sim.placement.state.store
    assert directory is not None and directory.private
    hashes = sorted(sim.store_of["w0"].nodes["w0"].entries)
    for block_hash in hashes:  # both nodes' copies are known, as their events told
        assert directory.locations(block_hash) == {"w0": DRAM, "w1": DRAM}


def test_a_private_directory_sources_only_the_readers_own_node() -> None:
    directory = StoreDirectory(private=True)
    assert directory.on_events("n0", [StoreEvent(1, "stored", (1, 2, 3), DRAM)])
    assert directory.on_events("n1", [StoreEvent(1, "stored", (1, 2), DRAM), StoreEvent(2, "stored", (4,), DRAM)])
    assert directory.sources([1, 2, 3], "n0") == [("n0", DRAM)] * 3
    assert directory.sources([1, 2, 3], "n1") == [("n1", DRAM)] * 2  # n1 lacks block 3: its run stops there
    assert directory.sources([4], "n0") == [] and directory.sources([1], "n2") == []
    shared = StoreDirectory()
    shared.on_events("n0", [StoreEvent(1, "stored", (1, 2, 3), DRAM)])
    assert shared.sources([1, 2, 3], "n1") == [("n0", DRAM)] * 3
    directory.check_invariants()


def test_islands_raise_hits_and_lower_ttft_when_prefixes_exceed_the_device_cache() -> None:
    requests = shared_prefix_requests()
    without = simulate(requests, small_device(kv_store_gb=0.0, kv_store_private=False))
    islands = simulate(requests, small_device())
    assert all(r.completed for r in without.records + islands.records)
    hits = [sum(w.prefix_cache_hits_tokens for w in result.workers) for result in (without, islands)]
    assert hits[1] > 2 * hits[0]
    ttft = [summarize(result.records).overall.ttft.mean_s for result in (without, islands)]
    assert ttft[1] < ttft[0]
    assert all(w.store_saved_blocks >= w.store_loaded_blocks > 0 for w in islands.workers)
    assert islands.store is not None and islands.store.remote_loaded_blocks == 0 and islands.store.link_waits == 0


def test_blocks_are_accounted_for_after_a_run_with_private_stores() -> None:
    sim, _, _ = build_sim(small_device())
    records = sim.run(shared_prefix_requests(200))
    assert all(r.completed for r in records)
    capacity = 4_000_000_000 // (KV_BYTES_PER_TOKEN * 16)
    for worker_id, worker in sim.workers.items():
        cache, store = worker.cache, sim.store_of[worker_id]
        assert cache is not None and cache.tier is not None and worker.store_io is not None
        cache.check_invariants()  # the store's too: nothing pinned that no load holds
        worker.scheduler.check_invariants()
        assert worker.pool.num_used_blocks == cache.num_cached_blocks  # idle: only the cache holds blocks
        assert list(store.nodes) == [worker_id] and 0 < cache.tier.num_cached_blocks == store.num_blocks <= capacity
        assert worker.store_io.num_loaded_blocks == cache.tier.num_loaded_blocks > 0
        assert worker.store_io.num_saved_blocks == cache.tier.num_saved_blocks


def test_same_seed_gives_an_identical_simulation_with_private_stores() -> None:
    requests = create_workload("conversation", seed=3, num_sessions=30, think_mean_s=2.0)
    same = setup(policy="preble", kv_store_gb=0.5, kv_store_disk_gb=0.5, num_blocks=400, seed=3,
                 store_node_losses=(StoreNodeLoss("w1", 10.0, 30.0),))
    first, second = simulate(requests, same), simulate(requests, same)
    assert [r.to_dict() for r in first.records] == [r.to_dict() for r in second.records]
    assert first.workers == second.workers and first.store == second.store
    assert first.store is not None and first.store.loaded_blocks > 0 and first.store.nodes_lost == 1


def test_a_lost_node_takes_its_workers_store_only() -> None:
    requests = one_prefix_twice() + [WorkloadRequest(2, 12.0, (PREFIX_B, as_token_array([13])), 4)]
    sim, records = run(requests, store_node_losses=(StoreNodeLoss("w0", 2.0),))
    assert all(r.completed for r in records) and records[2].worker_ids == ("w0",)
    assert not sim.store_of["w0"].nodes and sim.store_of["w0"].num_blocks == 0  # w0's later writes go nowhere
    assert len(sim.store_of["w1"].nodes["w1"].entries) == 32
    directory = sim.placement.state.store
    assert directory.num_blocks("w0") == 0 and directory.num_blocks("w1") == 32
    report = sim.store_report()
    assert report is not None and report.nodes_lost == 1 and report.saved_blocks == 64  # B's blocks had no node
    assert sim.workers["w0"].cache.tier.num_saved_blocks == 32  # A's, before the loss


def test_decode_workers_keep_no_store_node() -> None:
    sim, records = run(one_prefix_twice(), cluster="1P1D")
    assert all(r.completed for r in records)
    assert list(sim.store_of) == ["p0"] and sim.workers["p0"].store_io is not None
    assert sim.workers["d0"].store_io is None and sim.workers["d0"].cache is None


def test_a_private_store_needs_a_store() -> None:
    with pytest.raises(InvalidRequestError, match="kv_store_private needs a KV store"):
        check_setup(setup(kv_store_gb=0.0))
    with pytest.raises(InvalidRequestError, match="needs the prefix cache"):
        check_setup(setup(enable_prefix_cache=False))


def test_sim_cli_kv_store_private_reports_per_worker_stores(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    args = parser.parse_args(["--workload", "shared-prefix", "--num-requests", "200", "--rate", "8",
                              "--param", "num_groups=32", "--param", "output_tokens=16", "--cluster", "2xmixed",
                              "--num-blocks", "600", "--kv-store-gb", "4", "--kv-store-private", "--json",
                              "--no-progress"])
    assert run_sim(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["simulator"]["kv_store_gb"] == 4.0 and report["simulator"]["kv_store_private"] is True
    assert all(w["store_loaded_blocks"] > 0 and w["store_saved_blocks"] > 0 for w in report["workers"]["round_robin"])
    assert report["store"]["round_robin"]["remote_loaded_blocks"] == 0


def test_sim_host_kv_gb_is_gone_and_names_its_replacement(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--workload", "shared-prefix", "--num-requests", "2", "--no-progress", "--json",
                 "--host-kv-gb", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("kvbaton: error: --host-kv-gb is gone: the KV store's DRAM tier took the host tier's place: "
                   "--kv-store-gb 1 (shared, Mooncake's store) or --kv-store-gb 1 --kv-store-private "
                   "(each worker's own node: islands)")
