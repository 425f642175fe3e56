"""A store node lost mid-run in the simulator: what it held is gone, its worker recomputes and serves on, the
router's directory drops it, every request still completes, and a node back is empty; bad losses are refused."""

from __future__ import annotations

import argparse
import json

import pytest

from kvbaton.bench.tokens import as_token_array
from kvbaton.bench.workloads import create_workload
from kvbaton.bench.workloads.base import WorkloadRequest
from kvbaton.core.errors import InvalidRequestError
from kvbaton.sim.cli import add_sim_arguments, run_sim
from kvbaton.sim.config import StoreNodeLoss
from kvbaton.sim.run import SimSetup, build_sim, simulate

PREFIX = as_token_array(list(range(20, 20 + 2048)))  # 32 blocks of 64 tokens


def _setup(**kwargs) -> SimSetup:
    base = dict(model="llama-3-8b", gpu="h100", cluster="2xmixed", policy="round_robin", block_size=64,
                num_blocks=2000, max_model_len=65536, kv_store_gb=1.0)
    return SimSetup(**{**base, **kwargs})


def _requests() -> list[WorkloadRequest]:
    """The prefix at 0 s (round robin: on w0), at 5 s (on w1) and at 12 s (on w0 again), each with its own tail."""
    tails = [as_token_array([7, 8, 9]), as_token_array([10, 11, 12]), as_token_array([13, 14, 15])]
    return [WorkloadRequest(0, 0.0, (PREFIX, tails[0]), 4), WorkloadRequest(1, 5.0, (PREFIX, tails[1]), 4),
            WorkloadRequest(2, 12.0, (PREFIX, tails[2]), 4)]


def test_a_lost_node_takes_its_blocks_and_its_worker_recomputes():
    kept, _, _ = build_sim(_setup())
    assert kept.run(_requests())[1].cached_tokens == 2048  # without a loss, w1 loads w0's prefix
    sim, _, _ = build_sim(_setup(store_node_losses=(StoreNodeLoss("w0", 2.0),)))
    records = sim.run(_requests())
    assert all(r.completed for r in records)
    assert records[1].cached_tokens == 0  # w0's node, with the prefix, was lost at 2 s: w1 recomputes it
    # w1 wrote its own copy through (w0 has no node now); the third request is w0's again, from its device
    store = sim.store_of["w0"]  # the one store over both nodes
    assert records[2].worker_ids == ("w0",) and records[2].cached_tokens == 2048 and "w0" not in store.nodes
    assert store.num_blocks == 32 and all(store.locations(h) for h in store.nodes["w1"].entries)
    store.check_invariants()
    # the router's directory dropped w0's blocks with the loss
    directory = sim.placement.state.store
    for block_hash in store.nodes["w1"].entries:
        assert directory.locations(block_hash) == store.locations(block_hash)
    report = sim.store_report()
    assert report is not None and report.nodes_lost == 1 and report.loaded_blocks == 0
    for worker in sim.workers.values():
        worker.cache.check_invariants()
        assert worker.pool.num_free_blocks + worker.cache.num_cached_blocks == worker.pool.num_blocks


def test_a_node_back_is_empty_and_serves_again():
    # w0's node lost at 2 s and back, empty, at 3 s: w1 recomputes at 5 s (and writes to its own node); w0's
    # next request, a new 1,024-token prompt at 12 s, is written to w0's node, which holds only that
    sim, _, _ = build_sim(_setup(store_node_losses=(StoreNodeLoss("w0", 2.0, 3.0),)))
    requests = _requests()[:2] + [WorkloadRequest(2, 12.0, (as_token_array(list(range(5000, 5000 + 1024))),), 4)]
    records = sim.run(requests)
    assert all(r.completed for r in records) and records[1].cached_tokens == 0
    assert records[2].worker_ids == ("w0",)
    store = sim.store_of["w0"]
    assert len(store.nodes["w0"].entries) == 16 and len(store.nodes["w1"].entries) == 32
    store.check_invariants()


def test_a_loss_under_load_ends_every_request_and_is_deterministic():
    requests = create_workload("conversation", seed=3, num_sessions=30, think_mean_s=2.0)
    setup = _setup(policy="conductor", kv_store_gb=0.5, num_blocks=400, kv_store_disk_gb=0.5,
                   store_node_losses=(StoreNodeLoss("w1", 10.0, 30.0), StoreNodeLoss("w0", 40.0)))
    first, second = simulate(requests, setup), simulate(requests, setup)
    assert [r.to_dict() for r in first.records] == [r.to_dict() for r in second.records]
    assert all(r.completed for r in first.records) and first.store.nodes_lost == 2
    kept = simulate(requests, _setup(policy="conductor", kv_store_gb=0.5, num_blocks=400, kv_store_disk_gb=0.5))
    assert first.store.loaded_blocks < kept.store.loaded_blocks  # what the lost nodes held was not loaded


def test_bad_losses_are_refused(capsys):
    with pytest.raises(InvalidRequestError, match="no store node 'w9'"):
        build_sim(_setup(store_node_losses=(StoreNodeLoss("w9", 1.0),)))
    with pytest.raises(InvalidRequestError, match="needs a KV store"):
        build_sim(_setup(kv_store_gb=0.0, store_node_losses=(StoreNodeLoss("w0", 1.0),)))
    with pytest.raises(InvalidRequestError, match="while lost already"):
        build_sim(_setup(store_node_losses=(StoreNodeLoss("w0", 1.0, 5.0), StoreNodeLoss("w0", 4.0))))
    with pytest.raises(InvalidRequestError, match="come back after"):
        StoreNodeLoss("w0", 5.0, 4.0)
    with pytest.raises(InvalidRequestError, match="NODE@SECONDS"):
        StoreNodeLoss.parse("w0@soon")
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    args = parser.parse_args(["--workload", "conversation", "--num-requests", "40", "--cluster", "2xmixed",
                              "--policy", "conductor", "--kv-store-gb", "1", "--lose-store-node", "w1@5:9",
                              "--no-progress", "--json"])
    assert run_sim(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["store"]["conductor"]["nodes_lost"] == 1
