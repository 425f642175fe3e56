"""Per-pool hardware: pools of different GPUs and power caps simulate deterministically, price each pool's steps
with its own GPU (under the cap model), size its KV from its own memory; bad specs are one-line errors."""

from __future__ import annotations

import math
import re

import pytest

from kvbaton.bench.workloads import create_workload
from kvbaton.cli import main
from kvbaton.core.errors import InvalidRequestError
from kvbaton.sim.catalog import GPUS, get_gpu, get_model
from kvbaton.sim.cluster import ClusterSim
from kvbaton.sim.config import SimConfig, WorkerHardware
from kvbaton.sim.costs import ConstantCostModel, RooflineCostModel, create_cost_model
from kvbaton.sim.hardware import DECODE_POWER_FRACTION, capped, load_prices
from kvbaton.sim.run import SimSetup, build_sim, simulate
from kvbaton.sim.spec import parse_cluster_spec

HETERO = "2P3D:gpu_p=h100,gpu_d=l40s,cap_d=0.7"


def _setup(cluster: str, **kwargs: object) -> SimSetup:
    return SimSetup(model="llama-3-8b", gpu="h100", cluster=cluster, enable_prefix_cache=False,
                    local_prefill_threshold_tokens=0, **kwargs)  # type: ignore[arg-type]


def _fingerprint(records: list) -> list[tuple]:
    return [(r.request_id, r.status, r.worker_ids, tuple(r.token_times_s), r.transfer_bytes) for r in records]


def test_heterogeneous_cluster_is_deterministic_and_frees_every_block() -> None:
    requests = create_workload("sharegpt-like", num_requests=150, seed=3, rate=30.0)
    runs = []
    for _ in range(2):
        sim, spec, _ = build_sim(_setup(HETERO, seed=5))
        runs.append(_fingerprint(sim.run(requests)))
        assert {w: sim.workers[w].cost_model.name for w in ("p0", "d0")} == {
            "p0": "roofline:llama-3-8b@h100", "d0": "roofline:llama-3-8b@l40s cap 0.7"}
        # Each pool's KV is sized from its own GPU's memory: 80 GB prefill workers, 48 GB decode workers.
        model = get_model("llama-3-8b")
        for wid, gpu in (("p0", "h100"), ("d2", "l40s")):
            expected = int((GPUS[gpu].mem_bytes * 0.9 - model.weight_bytes) // (model.kv_bytes_per_token * 16))
            assert sim.workers[wid].pool.num_blocks == expected
        for worker in sim.workers.values():
            worker.scheduler.check_invariants()
            assert worker.pool.num_used_blocks == 0 and not worker.has_work()
        for source in sim.handoffs.sources.values():
            assert source.num_live_transfers == 0 and source.num_held_blocks == 0
        for destination in sim.handoffs.destinations.values():
            assert destination.num_live_transfers == 0 and destination.num_reserved_blocks == 0
    assert runs[0] == runs[1]
    assert all(status == "completed" for _, status, *_ in runs[0])
    assert {ids[0][0] + ids[1][0] for _, _, ids, *_ in runs[0]} == {"pd"}  # every request handed off


def test_each_pool_steps_at_its_own_gpus_price() -> None:
    """One request on h100 prefill / a100 decode: the prefill worker is busy exactly the h100 prefill, the decode
    worker exactly the a100 decode steps, and the KV crosses the named link."""
    prompt, output = 700, 6
    requests = create_workload("sharegpt-like", num_requests=1, seed=0, rate=1.0, prompt_mean_tokens=prompt,
                               prompt_std_tokens=0.001, output_mean_tokens=output, output_std_tokens=0.001)
    n = requests[0].num_prompt_tokens
    result = simulate(requests, _setup("1P1D:gpu_d=a100,link=ethernet"))
    busy = {w.worker_id: w.busy_s for w in result.workers}
    h100 = create_cost_model("roofline", "llama-3-8b", "h100")
    a100 = create_cost_model("roofline", "llama-3-8b", "a100")
    assert busy["p0"] == pytest.approx(h100.prefill_s(n), rel=1e-12)
    k = requests[0].output_tokens
    assert busy["d0"] == pytest.approx(sum(a100.decode_s(1, n + 1 + j) for j in range(k - 1)), rel=1e-12)
    assert busy["d0"] > sum(h100.decode_s(1, n + 1 + j) for j in range(k - 1)) * 1.5  # a100: 1.64x less bandwidth
    record = result.records[0]
    assert record.transfer_bytes == n * h100.kv_bytes_per_token
    assert record.token_times_s[0] >= h100.prefill_s(n) + record.transfer_bytes / 12.5e9


def test_a_cap_scales_compute_by_its_cube_root_and_bandwidth_below_the_decode_fraction() -> None:
    model, h100 = get_model("llama-2-70b"), get_gpu("h100")
    full = RooflineCostModel(model, h100)
    overhead = full.efficiency.step_overhead_s
    for cap in (0.3, 0.5, 0.7):
        c = RooflineCostModel(model, capped(h100, cap))
        # A 4k-token prefill is compute-bound: its time grows as 1 / cap^(1/3).
        assert (c.prefill_s(4096) - overhead) / (full.prefill_s(4096) - overhead) == pytest.approx(cap ** (-1 / 3))
        # A small decode batch is memory-bound: unchanged down to the decode fraction, then 1 / (cap / fraction).
        ratio = (c.decode_s(8, 8 * 1024) - overhead) / (full.decode_s(8, 8 * 1024) - overhead)
        assert ratio == pytest.approx(max(1.0, DECODE_POWER_FRACTION / cap))
        assert c.gpu.power_w == pytest.approx(700 * cap) and c.gpu.price_per_hour == h100.price_per_hour
    # ... and the simulated decode pool pays it: cap_d=0.25 halves its bandwidth, so its busy time grows (by less
    # than 2x: each step's fixed overhead does not scale).
    requests = create_workload("sharegpt-like", num_requests=40, seed=1, rate=10.0)
    plain = {w.worker_id: w.busy_s for w in simulate(requests, _setup("1P1D")).workers}
    cap = {w.worker_id: w.busy_s for w in simulate(requests, _setup("1P1D:cap_d=0.25")).workers}
    assert cap["p0"] == plain["p0"] and 1.5 * plain["d0"] < cap["d0"] < 2 * plain["d0"]


def test_spec_prices_and_powers_each_pool() -> None:
    spec = parse_cluster_spec("2P3D:tp_p=2,gpu_p=h100,gpu_d=a100,cap_d=0.7", "h100")
    assert [(w.worker_id, w.gpu, w.power_cap) for w in spec.workers] == [
        ("p0", "h100", 1.0), ("p1", "h100", 1.0), ("d0", "a100", 0.7), ("d1", "a100", 0.7), ("d2", "a100", 0.7)]
    prices = load_prices(None)
    assert spec.price_per_hour(prices) == pytest.approx(4 * 4.76 + 3 * 2.21)
    assert spec.power_kw == pytest.approx((4 * 700 + 3 * 400 * 0.7) / 1e3)
    assert spec.hardware == (("h100", 1.0), ("a100", 0.7))
    mixed = parse_cluster_spec("2xmixed+1P1D:gpu=a100,gpu_d=l40s", "h100")
    assert [w.gpu for w in mixed.workers] == ["a100", "a100", "a100", "l40s"]


def test_prices_file_overrides_the_defaults(tmp_path) -> None:
    path = tmp_path / "prices.json"
    path.write_text('{"source": "my quote", "prices_per_gpu_hour": {"h100": 3.0}}')
    prices = load_prices(path)
    assert prices["h100"] == 3.0 and prices["a100"] == 2.21
    for bad in ('{"prices_per_gpu_hour": {"h1000": 3.0}}', '{"prices_per_gpu_hour": {"h100": -1}}', "[1]"):
        path.write_text(bad)
        with pytest.raises(InvalidRequestError):
            load_prices(path)


@pytest.mark.parametrize(("cluster", "message"), [
    ("2P3D:gpu_p=h100,gpu_d=b300", "unknown GPU 'b300'"),
    ("2P3D:cap_d=1.5", "outside (0, 1]"),
    ("2P3D:cap_d=0", "outside (0, 1]"),
    ("2P3D:cap=-0.2", "outside (0, 1]"),
    ("2P3D:cap_p=nan", "outside (0, 1]"),
    ("2P3D:cap_p=fast", "needs a number in (0, 1]"),
    ("2P3D:gpu_p=h100,gpu_d=", "names no GPU"),
    ("2P3D:gpu_p=h100,gpu_d=a100,link=nvlink", "share no nvlink"),
    ("4xmixed:gpu_d=a100", "applies to a <P>P<D>D cluster only"),
])
def test_bad_specs_are_one_line_errors(cluster: str, message: str, capsys) -> None:
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        parse_cluster_spec(cluster, "h100")
    assert main(["sim", "--workload", "sharegpt-like", "--num-requests", "2", "--cluster", cluster,
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvbaton: error: ") and message in err


def test_a_pool_with_no_gpu_is_an_error() -> None:
    with pytest.raises(InvalidRequestError, match="the decode pool has no GPU"):
        parse_cluster_spec("2P3D:gpu_p=h100")  # no default GPU for the decode pool
    assert [w.gpu for w in parse_cluster_spec("2P3D").workers] == [""] * 5  # none named: the cost model's own
    with pytest.raises(InvalidRequestError, match="no price for worker p0's GPU ''"):
        parse_cluster_spec("2P3D").price_per_hour(load_prices(None))


def test_caps_need_the_roofline_model_and_layouts_must_match() -> None:
    with pytest.raises(InvalidRequestError, match="power cap needs the roofline"):
        simulate([], SimSetup(model="opt-13b", gpu="a100", cost_model="distserve", cluster="1P1D:cap_d=0.7"))
    with pytest.raises(InvalidRequestError, match="published coefficients are for a100, not h100"):
        simulate([], SimSetup(model="opt-13b", gpu="a100", cost_model="distserve", cluster="1P1D:gpu_p=h100"))
    spec = parse_cluster_spec("1P1D")
    other = create_cost_model("roofline", "llama-2-70b", "a100")
    with pytest.raises(InvalidRequestError, match="do not share a KV layout"):
        ClusterSim(spec, create_cost_model("roofline", "llama-3-8b", "h100"), SimConfig(),
                   hardware={"d0": WorkerHardware(other, 1000)})
    # A GPU or a cap changes no layout: the same model on two GPUs hands off.
    ClusterSim(spec, ConstantCostModel(0.01, 10), SimConfig(), hardware={"d0": WorkerHardware(
        ConstantCostModel(0.02, 10), 1000)})
    assert math.isclose(capped(get_gpu("a100"), 1.0).flops_per_s, 312e12)
