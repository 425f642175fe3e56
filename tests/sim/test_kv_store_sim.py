"""The cluster KV store in the simulator: write-through, loads across workers priced by their path, determinism."""

from __future__ import annotations

import argparse
import json

import pytest

from kvbaton.bench.tokens import as_token_array
from kvbaton.bench.workloads import create_workload
from kvbaton.bench.workloads.base import WorkloadRequest
from kvbaton.cache.kv_store import DRAM
from kvbaton.core.errors import InvalidRequestError
from kvbaton.sim.cli import add_sim_arguments, run_sim
from kvbaton.sim.run import SimSetup, build_sim, simulate

PREFIX = as_token_array(list(range(20, 20 + 2048)))  # 32 blocks of 64 tokens


def _setup(**kwargs) -> SimSetup:
    base = dict(model="llama-3-8b", gpu="h100", cluster="2xmixed", policy="round_robin", block_size=64,
                num_blocks=2000, max_model_len=65536, kv_store_gb=1.0)
    return SimSetup(**{**base, **kwargs})


def _two_requests(tenants: tuple[str, str] = ("", "")) -> list[WorkloadRequest]:
    tail = [as_token_array([7, 8, 9]), as_token_array([10, 11, 12])]
    return [WorkloadRequest(i, 5.0 * i, (PREFIX, tail[i]), 4, tenant=tenants[i]) for i in range(2)]


def _run(requests, setup):
    sim, _, _ = build_sim(setup)
    records = sim.run(requests)
    return sim, records


def test_a_prefix_computed_on_one_worker_is_loaded_on_another():
    sim, records = _run(_two_requests(), _setup())
    assert [r.worker_ids for r in records] == [("w0",), ("w1",)]  # round robin: the second lands elsewhere
    assert records[0].cached_tokens == 0 and records[1].cached_tokens == 2048
    w1 = sim.workers["w1"]
    assert w1.cache.tier.num_remote_loaded_blocks == 32 and w1.store_io.num_loaded_blocks == 32
    # 32 blocks of 8 MiB over the NIC (25 GB/s), charged to w1's step: recomputing them costs far more
    prices = sim.config.store_prices
    assert w1.store_io.copy_s == pytest.approx(prices.path_s(32, remote=True, on_disk=False))
    for worker in sim.workers.values():
        worker.cache.check_invariants()
    sim.store_of["w0"].check_invariants()  # the one store over both nodes
    no_store = simulate(_two_requests(), _setup(kv_store_gb=0.0)).records
    assert no_store[1].cached_tokens == 0
    ttft = [r.first_token_s - r.arrival_s for r in (records[1], no_store[1])]
    assert ttft[0] < 0.5 * ttft[1]


def test_new_blocks_are_written_through_once():
    sim, _ = _run(_two_requests(), _setup())
    # 32 prefix blocks: stored by w0 when computed; w1 loaded them and stored only its own new full block(s)
    assert sim.workers["w0"].cache.tier.num_saved_blocks == 32
    assert sim.workers["w1"].cache.tier.num_saved_blocks == 0  # 2048 + 3 tokens: no full block of its own
    store = sim.store_of["w0"]
    assert store is sim.store_of["w1"]  # shared: one store over both nodes
    assert store.num_blocks == 32 and all(
        holders == {"w0": DRAM} for holders in (store.locations(h) for h in store.nodes["w0"].entries))


def test_another_tenant_never_hits_the_store():
    _, records = _run(_two_requests(("a", "b")), _setup())
    assert records[1].cached_tokens == 0


def test_the_router_directory_follows_the_store():
    sim, _ = _run(_two_requests(), _setup(policy="conductor"))
    directory = sim.placement.state.store
    store = sim.store_of["w0"]
    for block_hash in store.nodes["w0"].entries:
        assert directory.locations(block_hash) == store.locations(block_hash)


def test_same_seed_gives_an_identical_simulation():
    requests = create_workload("conversation", seed=3, num_sessions=30, think_mean_s=2.0)
    setup = _setup(policy="conductor", kv_store_gb=0.5, num_blocks=400, kv_store_disk_gb=0.5)

    def fingerprint(result):
        return [(r.request_id, r.worker_ids, r.cached_tokens, r.token_times_s, r.finish_s) for r in result.records]

    first = simulate(requests, setup)
    assert fingerprint(first) == fingerprint(simulate(requests, setup))
    assert sum(w.store_loaded_blocks for w in first.workers) > 0
    other = simulate(requests, _setup(policy="conductor", kv_store_gb=0.5, num_blocks=400, kv_store_disk_gb=0.5,
                                      seed=1))
    assert [r.request_id for r in other.records] == [r.request_id for r in first.records]


def test_the_store_raises_the_hit_ratio_over_islands_under_memory_pressure():
    requests = create_workload("conversation", seed=5, num_sessions=40, think_mean_s=20.0)
    islands = simulate(requests, _setup(policy="round_robin", kv_store_gb=0.0, num_blocks=300))
    pooled = simulate(requests, _setup(policy="round_robin", kv_store_gb=2.0, num_blocks=300))

    def hit(result):
        return sum(r.cached_tokens for r in result.records) / sum(r.prompt_tokens for r in result.records)

    assert hit(pooled) > hit(islands) + 0.05


def test_cli_flags_and_bad_setups(capsys):
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    args = parser.parse_args(["--workload", "conversation", "--param", "num_sessions=5", "--cluster", "2xmixed",
                              "--gpu", "h100", "--model", "llama-3-8b", "--policy", "conductor", "--kv-store-gb",
                              "1", "--kv-store-disk-gb", "2", "--block-size", "64", "--json", "--no-progress"])
    assert run_sim(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["simulator"]["kv_store_gb"] == 1.0 and out["simulator"]["kv_store_disk_gb"] == 2.0
    with pytest.raises(InvalidRequestError, match="needs the prefix cache"):
        build_sim(_setup(enable_prefix_cache=False))
    with pytest.raises(InvalidRequestError):
        build_sim(_setup(kv_store_gb=-1.0))


def test_a_prefix_on_another_nodes_disk_is_priced_at_the_disk_and_promoted():
    # one DRAM block per node (8 MiB blocks), 1 GB of disk: w0's 32 prefix blocks end 1 in DRAM, 31 on disk
    sim, records = _run(_two_requests(), _setup(kv_store_gb=0.009, kv_store_disk_gb=1.0))
    assert records[1].cached_tokens == 2048
    prices = sim.config.store_prices
    w1 = sim.workers["w1"]
    assert w1.store_io.copy_s == pytest.approx(prices.path_s(1, remote=True, on_disk=False)
                                               + prices.path_s(31, remote=True, on_disk=True))
    store = sim.store_of["w0"]
    assert store.nodes["w0"].num_in == {"dram": 1, "disk": 31}  # a promotion swapped one disk block into DRAM
    store.check_invariants()
    for worker in sim.workers.values():
        worker.cache.check_invariants()
