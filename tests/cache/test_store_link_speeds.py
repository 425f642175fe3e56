"""Store link speeds the router measures: the EWMA over cumulative counters (`LinkMeter`), the prices it puts in
place of the nominal ones (`MeasuredStorePrices`), the heartbeat fields that carry the workers' counters, and the
router pool replacing `RouterState.store_prices` from them (and the conductor pricing loads at the new speed)."""

from __future__ import annotations

import math
import random

import pytest

from kvbaton.cache.store_prices import MIN_MEASURED_BYTES, LinkMeter, MeasuredStorePrices, StorePrices
from kvbaton.router.policies import create_policy
from kvbaton.server import rpc
from kvbaton.server.cluster import ClusterConfig, ClusterManager
from tests.router.test_conductor import WORKERS, heartbeat, make_state, req, store_holds
from tests.server.test_cluster_manager import register

MIB = 1 << 20


def test_the_first_delta_that_is_big_enough_sets_the_speed_and_later_ones_average_in() -> None:
    meter = LinkMeter(alpha=0.5)
    assert meter.bytes_per_s is None
    assert not meter.observe("w0", MIB // 2, 0.001, now=1.0)  # too little to mean anything: waits
    assert meter.bytes_per_s is None and meter.num_samples == 0
    # the half MiB is not lost: the delta from 0 now holds 2 MiB in 2 ms
    assert meter.observe("w0", 2 * MIB, 0.002, now=2.0)
    assert meter.bytes_per_s == pytest.approx(MIB / 0.001) and meter.measured_at == 2.0
    assert meter.observe("w0", 4 * MIB, 0.006, now=3.0)  # 2 MiB in 4 ms: half the speed
    assert meter.bytes_per_s == pytest.approx(0.5 * MIB / 0.001 + 0.5 * MIB / 0.002)
    assert meter.num_samples == 2


def test_each_source_counts_from_its_own_counters_and_a_restart_counts_from_zero() -> None:
    meter = LinkMeter(alpha=1.0)  # the latest delta alone: each sample shows
    assert meter.observe("w0", 10 * MIB, 1.0, now=0.0)
    assert meter.observe("w1", 1 * MIB, 0.1, now=0.0)  # w1's counters are its own, not a delta from w0's
    assert meter.bytes_per_s == pytest.approx(10 * MIB)
    assert not meter.observe("w1", 1 * MIB, 0.1, now=1.0)  # nothing moved
    # w0 restarted: its counters went back; what they hold now is a delta from 0
    assert meter.observe("w0", 3 * MIB, 0.5, now=2.0)
    assert meter.bytes_per_s == pytest.approx(6 * MIB)
    meter.forget("w1")  # w1 left; one that registers again with that id counts from 0
    assert meter.observe("w1", 2 * MIB, 1.0, now=3.0)
    assert meter.bytes_per_s == pytest.approx(2 * MIB)


@pytest.mark.parametrize(("num_bytes", "seconds"), [(2 * MIB, math.nan), (2 * MIB, math.inf), (-2 * MIB, 1.0),
                                                    (2 * MIB, -1.0), (2 * MIB, 0.0)])
def test_counters_that_are_not_counters_never_reach_the_figure(num_bytes: int, seconds: float) -> None:
    meter = LinkMeter()
    assert not meter.observe("w0", num_bytes, seconds, now=0.0)
    assert meter.bytes_per_s is None
    assert meter.observe("w0", 4 * MIB, 1.0, now=1.0)  # the bad report left no baseline behind
    assert meter.bytes_per_s == pytest.approx(4 * MIB)


def test_bad_alpha_is_refused() -> None:
    for alpha in (0.0, 1.5):
        with pytest.raises(ValueError, match="alpha"):
            LinkMeter(alpha)


def test_measured_prices_replace_the_nominal_host_and_disk_speeds_only() -> None:
    nominal = StorePrices(8192, host_bytes_per_s=3e9, nic_bytes_per_s=25e9, disk_bytes_per_s=1e9, latency_s=1e-5)
    speeds = MeasuredStorePrices(nominal, alpha=1.0)
    assert speeds.prices() == nominal
    info = speeds.info()
    assert info["host_speed"] == "nominal" and info["host_bytes_per_s"] == 3e9
    assert info["disk_speed"] == "nominal" and info["disk_bytes_per_s"] == 1e9
    assert speeds.observe("tcp", "w1", 10 * MIB, 0.01, now=0.0)  # every load so far over TCP: that is the speed
    assert speeds.prices().host_bytes_per_s == pytest.approx(10 * MIB / 0.01)
    assert speeds.observe("shm", "w0", 30 * MIB, 0.01, now=1.0)  # shared memory measured: it prices the host link
    assert speeds.observe("disk", "node", 5 * MIB, 0.01, now=1.0)
    assert not speeds.observe("rdma", "w0", 30 * MIB, 0.01, now=1.0)  # a link no price reads counts nowhere
    prices = speeds.prices()
    assert prices.host_bytes_per_s == pytest.approx(30 * MIB / 0.01)
    assert prices.disk_bytes_per_s == pytest.approx(5 * MIB / 0.01)
    assert (prices.block_bytes, prices.nic_bytes_per_s, prices.latency_s) == (8192, 25e9, 1e-5)
    info = speeds.info()
    assert info["host_speed"] == info["disk_speed"] == "measured"
    assert info["links"]["tcp"] == {"bytes_per_s": pytest.approx(10 * MIB / 0.01), "latency_s": None,
                                    "num_samples": 1, "num_loads": 0}  # counters without round trips: no latency


def test_the_conductor_prices_a_load_at_the_measured_speed() -> None:
    # The conductor test's cluster: a block costs 40 ms to recompute, 1 ms to load from this node's DRAM at 1 GB/s.
    state = make_state()
    for worker in WORKERS:
        heartbeat(state, worker)

    def store_load_s(*blocks: int) -> float:
        request = req(f"r{blocks}", *blocks)  # blocks no device holds (each call's own), in every node's DRAM
        for worker in WORKERS:
            store_holds(state, worker, request.block_hashes)
        return create_policy("conductor", state, random.Random(0)).choose(request, WORKERS, now=1.0).costs.store_load_s

    assert store_load_s(1, 2, 3, 4) == pytest.approx(0.004)
    speeds = MeasuredStorePrices(state.store_prices, alpha=1.0)
    assert speeds.observe("shm", "w0", 10 * MIB, 10 * MIB / 5e7, now=1.0)  # the link measured at 50 MB/s
    state.store_prices = speeds.prices()
    assert store_load_s(5, 6, 7, 8) == pytest.approx(0.08)  # 4 blocks of 1 MB at 50 MB/s
    assert speeds.observe("shm", "w0", 20 * MIB, 10 * MIB / 5e7 + 10 * MIB / 1e6, now=2.0)  # now 1 MB/s
    state.store_prices = speeds.prices()
    assert store_load_s(9, 10, 11, 12) == 0.0  # 4 s to load: recomputing (0.17 s) is cheaper


def test_heartbeat_stats_carry_the_store_counters_and_an_older_worker_s_stats_still_read() -> None:
    stats = rpc.Stats("w0", 0, 0, 0, 0, 64, 0, 0, 0, 0, 0, 1.5, store_load_bytes=3 * MIB, store_load_s=0.25,
                      store_transport="shm")
    assert rpc.decode(rpc.encode(stats)) == stats
    heartbeat_frame = rpc.Heartbeat(rpc.KVEvents("w0", ()), stats)
    assert rpc.decode(rpc.encode(heartbeat_frame)) == heartbeat_frame
    old = rpc.to_wire(stats)[:-5]  # a worker from before the store counters
    decoded = rpc.from_wire(old)
    assert isinstance(decoded, rpc.Stats)
    assert (decoded.store_load_bytes, decoded.store_load_s, decoded.store_transport) == (0, 0.0, "")
    counted = rpc.Stats("w0", 0, 0, 0, 0, 64, 0, 0, 0, 0, 0, 1.5, store_load_bytes=3 * MIB, store_load_s=0.25,
                        store_transport="shm", store_load_count=2, store_load_round_trip_s=0.002)
    assert rpc.decode(rpc.encode(counted)) == counted
    no_round_trips = rpc.from_wire(rpc.to_wire(counted)[:-2])  # a worker from before the round-trip counters
    assert (no_round_trips.store_load_bytes, no_round_trips.store_load_count,
            no_round_trips.store_load_round_trip_s) == (3 * MIB, 0, 0.0)
    wrong = rpc.to_wire(stats)
    wrong[-5] = "many"
    with pytest.raises(rpc.ProtocolError, match="store_load_bytes must be int"):
        rpc.from_wire(wrong)
    with pytest.raises(rpc.ProtocolError, match="fields"):
        rpc.from_wire(rpc.to_wire(stats)[:-6])  # an older field missing is still a malformed frame


def test_the_router_pool_replaces_the_store_prices_from_its_workers_heartbeats() -> None:
    config = ClusterConfig(model_name="tiny-random", block_size=4, kv_store_address="tcp://127.0.0.1:1",
                           kv_store_block_bytes=8192)
    cluster = ClusterManager(config, clock=lambda: 0.0)  # not started: the pool's bookkeeping alone
    nominal = cluster.state.store_prices
    assert nominal is not None and nominal.host_bytes_per_s == config.kv_store_host_bytes_per_s

    def beat(worker_id: str, num_bytes: int, seconds: float, transport: str = "shm") -> None:
        cluster.pool.handle(worker_id, rpc.Stats(worker_id, 0, 0, 0, 0, 64, 0, 0, 0, 0, 0, 0.0,
                                                 store_load_bytes=num_bytes, store_load_s=seconds,
                                                 store_transport=transport))

    cluster.pool.handle("w0", register("w0"))
    beat("w0", 0, 0.0)
    beat("w0", MIB // 4, 0.001)  # a small load: still nominal
    assert cluster.state.store_prices == nominal
    assert cluster.cluster_info()["kv_store"]["host_speed"] == "nominal"
    beat("w0", 8 * MIB, 0.004)
    measured = cluster.state.store_prices
    assert measured.host_bytes_per_s == pytest.approx(8 * MIB / 0.004)
    assert (measured.block_bytes, measured.disk_bytes_per_s) == (8192, nominal.disk_bytes_per_s)
    kv_store = cluster.cluster_info()["kv_store"]
    assert kv_store["host_speed"] == "measured" and kv_store["host_bytes_per_s"] == measured.host_bytes_per_s
    assert kv_store["num_blocks"] == 0 and kv_store["address"] == "tcp://127.0.0.1:1"


def test_without_a_store_the_router_measures_nothing() -> None:
    cluster = ClusterManager(ClusterConfig(model_name="tiny-random", block_size=4), clock=lambda: 0.0)
    cluster.pool.handle("w0", register("w0"))
    cluster.pool.handle("w0", rpc.Stats("w0", 0, 0, 0, 0, 64, 0, 0, 0, 0, 0, 0.0, store_load_bytes=8 * MIB,
                                        store_load_s=0.01, store_transport="shm"))
    assert cluster.state.store_prices is None and cluster.cluster_info()["kv_store"] is None
    assert MIN_MEASURED_BYTES == MIB


def test_the_store_node_s_disk_reads_price_its_disk() -> None:
    config = ClusterConfig(model_name="tiny-random", block_size=4, kv_store_address="tcp://127.0.0.1:1",
                           kv_store_block_bytes=8192)
    cluster = ClusterManager(config, clock=lambda: 0.0)
    cluster._on_store_disk_reads(config.kv_store_address, MIB // 2, 0.01)  # the feed hands it on from the node
    assert cluster.cluster_info()["kv_store"]["disk_speed"] == "nominal"
    cluster._on_store_disk_reads(config.kv_store_address, 4 * MIB, 0.02)
    prices = cluster.state.store_prices
    assert prices.disk_bytes_per_s == pytest.approx(4 * MIB / 0.02)
    assert prices.host_bytes_per_s == config.kv_store_host_bytes_per_s  # the DRAM link not measured yet
    info = cluster.cluster_info()["kv_store"]
    assert info["disk_speed"] == "measured" and info["host_speed"] == "nominal"


def test_the_round_trip_is_measured_apart_from_the_bytes_speed() -> None:
    """A source that counts its loads' round trips: the speed is the bytes over the time left after them, the
    latency their time per load, so small loads measured do not price a big one slow."""
    meter = LinkMeter(alpha=1.0)
    # ten small loads: 2 MiB in 30 ms, 20 ms of it round trips (2 ms each)
    assert meter.observe("w0", 2 * MIB, 0.030, now=1.0, num_loads=10, round_trip_s=0.020)
    assert meter.bytes_per_s == pytest.approx(2 * MIB / 0.010) and meter.latency_s == pytest.approx(0.002)
    assert meter.num_loads == 10
    prices = MeasuredStorePrices(StorePrices(block_bytes=MIB), alpha=1.0)
    assert prices.prices().load_latency_s == 0.0 and prices.info()["load_latency"] == "nominal"
    prices.observe("shm", "w0", 2 * MIB, 0.030, 1.0, 10, 0.020)
    measured = prices.prices()
    assert measured.load_latency_s == pytest.approx(0.002) and prices.info()["load_latency"] == "measured"
    # a 64-block (64 MiB) load: one round trip and its bytes, not 64 MiB at the small loads' 67 MB/s
    big = measured.load_s([("local", "dram")] * 64, "local")
    assert big == pytest.approx(0.002 + measured.latency_s + 64 * MIB / (2 * MIB / 0.010))
    assert measured.load_s([], "local") == 0.0
    # a source that counts no round trips: bytes over all its seconds, latency untouched
    assert meter.observe("w1", 4 * MIB, 0.004, now=2.0)
    assert meter.bytes_per_s == pytest.approx(MIB / 0.001) and meter.latency_s == pytest.approx(0.002)


@pytest.mark.parametrize(("num_loads", "round_trip_s"), [(-1, 0.0), (1, -0.001), (1, 2.0), (1, math.nan)])
def test_round_trip_counters_that_are_not_counters_never_reach_the_figures(num_loads: int,
                                                                          round_trip_s: float) -> None:
    meter = LinkMeter()
    assert not meter.observe("w0", 4 * MIB, 1.0, now=0.0, num_loads=num_loads, round_trip_s=round_trip_s)
    assert meter.bytes_per_s is None and meter.latency_s is None


def test_the_simulator_s_prices_are_unchanged_without_a_round_trip() -> None:
    """`load_latency_s` 0 (the nominal): a load costs its paths alone, as before the field existed."""
    prices = StorePrices(block_bytes=MIB)
    sources = [("n0", "dram")] * 3 + [("n1", "disk")] * 2
    assert prices.load_s(sources, "n0") == pytest.approx(prices.path_s(3, False, False) + prices.path_s(2, True, True))
    priced = StorePrices(block_bytes=MIB, load_latency_s=0.001)
    assert priced.load_s(sources, "n0") == pytest.approx(prices.load_s(sources, "n0") + 0.001)
