"""The simulated store's shared links: loads from several workers queue for a node's NIC and disk, first come first
served in simulated time; a load that meets no busy link costs exactly its price."""

from __future__ import annotations

import pytest

from kvbaton.bench.tokens import as_token_array
from kvbaton.bench.workloads.base import WorkloadRequest
from kvbaton.cache.kv_store import DISK, DRAM
from kvbaton.cache.store_prices import StorePrices
from kvbaton.sim.run import SimSetup, build_sim
from kvbaton.sim.store_io import SimStoreIO, StoreLinks

PRICES = StorePrices(block_bytes=8 << 20)  # 25 GB/s NIC, 5 GB/s disk, 50 GB/s host link, 10 us per path


def _io(node: str, links: StoreLinks | None) -> SimStoreIO:
    return SimStoreIO(PRICES, node, 1, links)


def test_a_load_on_idle_links_costs_exactly_its_price():
    links = StoreLinks(PRICES)
    sources = [("a", DRAM)] * 3 + [("a", DISK)] * 2 + [("b", DRAM)] * 4
    alone, contended = _io("b", None), _io("b", links)
    alone.load([], sources, [])
    contended.load([], sources, [])
    assert contended.take_copy_s(1.0) == alone.take_copy_s(1.0) == PRICES.load_s(sources, "b")
    assert links.num_waits == 0 and links.wait_s == 0.0 and contended.wait_s == 0.0


def test_two_loads_from_one_node_share_its_nic():
    links = StoreLinks(PRICES)
    one = PRICES.path_s(10, remote=True, on_disk=False)
    first, second = _io("b", links), _io("c", links)
    first.load([], [("a", DRAM)] * 10, [])
    second.load([], [("a", DRAM)] * 10, [])
    assert first.take_copy_s(0.0) == pytest.approx(one)
    # c starts half way through b's transfer: a's NIC out is busy for the other half
    assert second.take_copy_s(one / 2) == pytest.approx(one / 2 + one)
    assert links.num_waits == 1 and links.wait_s == pytest.approx(one / 2) == pytest.approx(second.wait_s)
    # after both ended, the NIC is free again
    third = _io("d", links)
    third.load([], [("a", DRAM)] * 10, [])
    assert third.take_copy_s(10.0) == pytest.approx(one)


def test_a_reader_nic_in_and_a_disk_are_shared_too():
    links = StoreLinks(PRICES)
    reader = _io("r", links)
    reader.load([], [("a", DRAM)] * 4, [])
    end = reader.take_copy_s(0.0)
    other_source = _io("r", links)  # another worker on r's host reads from b: r's NIC in is busy until `end`
    other_source.load([], [("b", DRAM)] * 4, [])
    assert other_source.take_copy_s(0.0) == pytest.approx(end + PRICES.path_s(4, remote=True, on_disk=False))
    disk_a, disk_b = _io("a", links), _io("a", links)  # two readers of a's own disk: no NIC, one disk
    disk_a.load([], [("a", DISK)] * 5, [])
    disk_b.load([], [("a", DISK)] * 5, [])
    local_disk = PRICES.path_s(5, remote=False, on_disk=True)
    assert disk_a.take_copy_s(20.0) == pytest.approx(local_disk)
    assert disk_b.take_copy_s(20.0) == pytest.approx(2 * local_disk)
    local_dram = _io("a", links)  # a's DRAM over its own host link: nothing shared
    local_dram.load([], [("a", DRAM)] * 5, [])
    assert local_dram.take_copy_s(20.0) == PRICES.path_s(5, remote=False, on_disk=False)


PREFIX = as_token_array(list(range(20, 20 + 2048)))  # 32 blocks of 64 tokens


def test_simultaneous_loads_of_one_prefix_queue_at_its_node():
    """w0 computes a prefix; w1, w2 and w3 each get a request for it at the same instant and load it from w0's
    DRAM over w0's one NIC: the second and third wait for the ones before them, and the store says so."""
    setup = SimSetup(model="llama-3-8b", gpu="h100", cluster="4xmixed", policy="round_robin", block_size=64,
                     num_blocks=2000, max_model_len=65536, kv_store_gb=1.0)
    tail = [as_token_array([7 + i, 8, 9]) for i in range(4)]
    requests = [WorkloadRequest(0, 0.0, (PREFIX, tail[0]), 4)] + [
        WorkloadRequest(i, 5.0, (PREFIX, tail[i]), 4) for i in (1, 2, 3)]
    sim, _, _ = build_sim(setup)
    records = sim.run(requests)
    assert [r.worker_ids for r in records] == [("w0",), ("w1",), ("w2",), ("w3",)]
    assert all(r.cached_tokens == 2048 for r in records[1:])
    one = sim.config.store_prices.path_s(32, remote=True, on_disk=False)
    copies = sorted(sim.workers[w].store_io.copy_s for w in ("w1", "w2", "w3"))
    assert copies == pytest.approx([one, 2 * one, 3 * one])
    report = sim.store_report()
    assert report is not None and report.link_waits == 2 and report.link_wait_s == pytest.approx(3 * one)
    assert report.remote_loaded_blocks == 96 and report.nodes_lost == 0
    ttft = [r.first_token_s - r.arrival_s for r in records[1:]]
    assert ttft[0] < ttft[1] < ttft[2]
