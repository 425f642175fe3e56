"""Cost models: DistServe's published form and numbers, the roofline's regimes, links, cluster specs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbaton.core.errors import InvalidRequestError
from kvbaton.sim.catalog import GPUS, MODELS, get_model
from kvbaton.sim.costs import (BatchShape, ConstantCostModel, LinearCoefficients, Parallelism, RooflineCostModel,
                               create_cost_model, load_linear_model)
from kvbaton.sim.costs.linear import DISTSERVE_A100_PATH, LinearCostModel, save_linear_model
from kvbaton.sim.links import Link, get_link
from kvbaton.sim.spec import parse_cluster_spec


def test_distserve_opt13b_prices_steps_as_its_simulator_does() -> None:
    model = create_cost_model("distserve", "opt-13b", "a100")
    # simdistserve (commit 82831f1): prefill a + b*sum(l) + c*sum(l^2) ms from the tp=1 row of
    # profiler-a100-80g.distserve.json (realigned x 1.1 in 4c68ed9), + 1 ms per pipeline stage (time_estimator.py)
    # + 2 ms + 1e-4 ms per context token (worker.py add_ray_overhead); decode the same without the 1 ms.
    a, b, c = 18.10254647486372, 0.1019122572698738, 7.122264314252114e-06
    lengths = (512, 100)
    expected_ms = a + b * sum(lengths) + c * sum(n * n for n in lengths) + 1.0 + 2.0 + 1e-4 * sum(lengths)
    assert model.step_s(BatchShape(lengths, (0, 0))) == pytest.approx(expected_ms / 1e3, rel=1e-12)
    small = (19.934702624895458, 0.0006269356524350583, 0.03850697740828398)
    large = (7.1661889468253595, 0.0005798000403396046, 0.15831096191764046)
    assert model.decode_s(10, 5000) == pytest.approx((small[0] + small[1] * 5000 + small[2] * 10 + 2.0 + 0.5) / 1e3)
    assert model.decode_s(95, 50000) == pytest.approx((large[0] + large[1] * 50000 + large[2] * 95 + 2.0 + 5.0) / 1e3)
    assert model.decode_s(10, 5000, Parallelism(tp=2)) < model.decode_s(10, 5000)
    # pp divides the forward, not the overheads (the prefill's 1 ms is paid per stage).
    forward_s = model.prefill_s(512) - (1.0 + 2.0 + 1e-4 * 512) / 1e3
    assert model.prefill_s(512, 0, Parallelism(tp=1, pp=2)) == pytest.approx(
        forward_s / 2 + (2.0 + 2.0 + 1e-4 * 512) / 1e3)
    assert model.kv_bytes_per_token == 2 * 40 * 5120 * 2
    assert model.gpu_name == "a100"
    with pytest.raises(InvalidRequestError):
        model.step_s(BatchShape((8,), (0,)), Parallelism(tp=8))
    with pytest.raises(InvalidRequestError):
        create_cost_model("distserve", "opt-13b", "h100")


def test_mixed_step_pays_one_fixed_overhead() -> None:
    model = create_cost_model("distserve", "opt-66b", "a100")
    tp2 = Parallelism(tp=2)
    prefill = model.prefill_s(300, 0, tp2)
    decode = model.decode_s(4, 2000, tp2)
    mixed = model.step_s(BatchShape((300,), (0,), 4, 2000), tp2)
    step_overhead_s = 2e-3
    fixed_s = min(1.1 * 0.03914437589353578, 0.048288015489286245)  # the smaller fitted intercept, once
    assert mixed == pytest.approx(prefill + decode - fixed_s - step_overhead_s)


def test_bad_step_overhead_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "costs.json"
    raw = json.loads(DISTSERVE_A100_PATH.read_text())
    raw["step_overhead"] = {"per_step": "two"}
    path.write_text(json.dumps(raw))
    with pytest.raises(InvalidRequestError, match="step_overhead"):
        load_linear_model(path, "opt-13b")


def test_profiled_coefficient_file_round_trips(tmp_path: Path) -> None:
    coeffs = LinearCoefficients((0.01, 2e-4, 1e-8, 3e-9), (0.005, 1e-6, 1e-4), (0.005, 1e-6, 1e-4), 64)
    path = tmp_path / "profile.json"
    save_linear_model(path, "smollm2-135m", coeffs, 23040, source="test")
    model = load_linear_model(path)
    assert model.coefficients(1) == coeffs
    assert model.prefill_s(100, 50) == pytest.approx(0.01 + 2e-4 * 100 + 1e-8 * 100**2 + 3e-9 * 100 * 50)
    assert create_cost_model(str(path), "ignored", "cpu").name == model.name
    assert json.loads(path.read_text())["time_unit"] == "s"


def test_roofline_regimes_and_parallelism() -> None:
    model = RooflineCostModel(get_model("llama-2-7b"), GPUS["a100"])
    spec = get_model("llama-2-7b")
    assert 6.5e9 < spec.num_params < 7.0e9 and spec.kv_bytes_per_token == 2 * 32 * 4096 * 2
    # A small decode is memory bound: about weights / (0.8 x 2.039 TB/s) + 1 ms overhead.
    assert model.decode_s(1, 100) == pytest.approx(spec.weight_bytes / (0.8 * 2.039e12) + 1e-3, rel=0.02)
    # A long prefill is compute bound and grows faster than linearly with length (attention).
    assert model.prefill_s(4000) > 2 * model.prefill_s(2000)
    # Cached context makes a prefill cheaper than computing it, but not free.
    assert model.prefill_s(100, 3900) < model.prefill_s(4000) and model.prefill_s(100, 3900) > model.prefill_s(100)
    tp2 = model.prefill_s(4000, 0, Parallelism(tp=2))
    assert model.prefill_s(4000) / 2 < tp2 < model.prefill_s(4000)  # all-reduce makes TP less than linear
    h100 = RooflineCostModel(get_model("llama-2-7b"), GPUS["h100"])
    assert h100.prefill_s(4000) < model.prefill_s(4000) and h100.decode_s(32, 32000) < model.decode_s(32, 32000)
    assert set(MODELS) >= {"llama-3-70b", "mistral-7b", "opt-175b", "qwen2-7b", "smollm2-135m"}
    assert set(GPUS) == {"a100", "a100-40gb", "h100", "h200", "l40s", "a6000"}


def test_batch_shape_of_plan_and_constant_model() -> None:
    from kvbaton.core.step import ScheduledChunk, StepPlan

    plan = StepPlan(1, (ScheduledChunk("a", 40, (7,), (0, 1, 2), True),
                        ScheduledChunk("b", 16, tuple(range(20)), (3, 4, 5), False)), 21)
    shape = BatchShape.of_plan(plan)
    assert shape == BatchShape((20,), (16,), 1, 41)
    assert ConstantCostModel(0.5).step_s(shape) == 0.5 and ConstantCostModel(0.5).step_s(BatchShape()) == 0.0


def test_link_contention_is_fifo() -> None:
    link = Link(get_link("infiniband"))
    first = link.offer(25_000_000_000, now=0.0)  # 1 s of bandwidth
    second = link.offer(25_000_000_000, now=0.5)  # waits for the first
    assert first == pytest.approx(1.0 + 5e-6) and second == pytest.approx(2.0 + 10e-6)
    assert link.offer(0, now=5.0) == 5.0 + 5e-6  # a control message still pays the latency


@pytest.mark.parametrize("text,roles,tps,link", [
    ("4xmixed", ["mixed"] * 4, [1] * 4, "infiniband"),
    ("2P2D", ["prefill", "prefill", "decode", "decode"], [1, 1, 1, 1], "infiniband"),
    ("2P1D:tp_p=2,link=nvlink", ["prefill", "prefill", "decode"], [2, 2, 1], "nvlink"),
    ("1P1D:tp=2,tp_d=4", ["prefill", "decode"], [2, 4], "infiniband"),
])
def test_cluster_specs(text: str, roles: list[str], tps: list[int], link: str) -> None:
    spec = parse_cluster_spec(text)
    assert [w.role for w in spec.workers] == roles and [w.parallel.tp for w in spec.workers] == tps
    assert spec.link == link and spec.num_gpus == sum(tps)


@pytest.mark.parametrize("text", ["4x", "mixed", "0P1D", "2P2D:tp=x", "2P2D:foo=1", "2P2D:link=carrier-pigeon"])
def test_bad_cluster_specs(text: str) -> None:
    with pytest.raises(InvalidRequestError):
        parse_cluster_spec(text)


def test_fidelity_rows_compare_percentiles() -> None:
    from kvbaton.bench.records import RequestRecord
    from kvbaton.sim.fidelity import compare_runs, render_fidelity

    def rec(i: int, ttft_s: float, gap_s: float) -> RequestRecord:
        times = (ttft_s, ttft_s + gap_s, ttft_s + 2 * gap_s)
        return RequestRecord(f"r{i}", 0.0, first_token_s=times[0], token_times_s=times, finish_s=times[-1],
                             output_tokens=3)

    live = [rec(i, 0.1, 0.02) for i in range(10)]
    sim = [rec(i, 0.105, 0.03) for i in range(10)]
    rows = compare_runs(live, sim)
    assert [r.metric for r in rows] == ["TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99"]
    assert rows[0].error == pytest.approx(0.05) and rows[0].within_target
    assert rows[2].error == pytest.approx(0.5) and rows[2].within_target is False
    assert "| TTFT p50 | 100.0 | 105.0 | +5.0 % | yes |" in render_fidelity(rows, "t")


def test_roofline_decode_s_is_its_general_price_to_the_last_bit() -> None:
    """decode_s repeats _price's arithmetic for one GPU (the simulator's steady decode steps); same floats."""
    import random

    from kvbaton.sim.catalog import MODELS

    rng = random.Random(0)
    for model_name in sorted(MODELS):
        model = RooflineCostModel(get_model(model_name), GPUS["h100"])
        assert model._flops_per_seq is not None  # catalog figures are ints: the grouped FLOPs path runs
        for _ in range(300):
            num_seqs, context_tokens = rng.randint(1, 4096), rng.randint(1, 2_000_000)
            for parallel in (Parallelism(), Parallelism(tp=2), Parallelism(pp=2)):
                assert model.decode_s(num_seqs, context_tokens, parallel) == model._price(
                    num_seqs, num_seqs, context_tokens, context_tokens, parallel)
    assert model.decode_s(0, 100) == 0.0


def test_roofline_decode_pricer_is_decode_s_to_the_last_bit() -> None:
    """The closure the simulator prices steady decode steps with gives decode_s's floats, bound parallelism included."""
    import random

    rng = random.Random(1)
    for model_name in sorted(MODELS):
        model = RooflineCostModel(get_model(model_name), GPUS["h100"])
        for parallel in (Parallelism(), Parallelism(tp=2), Parallelism(pp=2)):
            price = model.decode_pricer(parallel)
            for _ in range(200):
                num_seqs, context_tokens = rng.randint(1, 4096), rng.randint(1, 2_000_000)
                assert price(num_seqs, context_tokens) == model.decode_s(num_seqs, context_tokens, parallel)
            assert price(0, 100) == 0.0
    constant = ConstantCostModel(0.25)  # the base class's pricer: decode_s itself
    assert constant.decode_pricer(Parallelism(tp=2))(3, 10) == constant.decode_s(3, 10, Parallelism(tp=2)) == 0.25


def test_a_coefficient_file_naming_its_gpu_sizes_the_kv_pool_from_that_gpus_memory(tmp_path: Path) -> None:
    from kvbaton.sim.run import DEFAULT_NUM_BLOCKS, SimSetup, build_sim

    copy = tmp_path / "a100_costs.json"
    copy.write_text(DISTSERVE_A100_PATH.read_text())
    cluster = "1P1D:tp_p=2,pp_p=1,tp_d=1,pp_d=1"
    published = build_sim(SimSetup(model="opt-13b", gpu="a100", cluster=cluster, cost_model="distserve"))[2]
    from_file = build_sim(SimSetup(model="opt-13b", gpu="a100", cluster=cluster, cost_model=str(copy)))[2]
    # (80 GiB x 0.9 - 26 GB of weights) / (16 tokens x 800 KiB): ~63k tokens, as DistServe's 66k at TP1
    assert from_file == published == 3938
    with pytest.raises(InvalidRequestError, match="prices a100, not --gpu h100"):
        build_sim(SimSetup(model="opt-13b", gpu="h100", cluster=cluster, cost_model=str(copy)))
    profile = tmp_path / "cpu_profile.json"  # a CPU profile names no catalog GPU: the live engine's pool
    save_linear_model(profile, "smollm2-135m", LinearCoefficients((0.01, 0, 0, 0), (0.01, 0, 0), (0.01, 0, 0)), 1,
                      source="test")
    assert build_sim(SimSetup(model="smollm2-135m", cluster="2xmixed", cost_model=str(profile)))[2] == DEFAULT_NUM_BLOCKS


def test_a_log_with_few_prefill_only_steps_is_fitted_jointly_over_every_step() -> None:
    from kvbaton.sim.costs.fit import StepSample, fit_joint, fit_linear

    # A decode worker that prefills short prompts itself: mixed steps, and only two prefill-only ones.
    def step_s(shape: BatchShape) -> float:  # one forward: 20 ms + 0.1 ms/new token + 1e-6 s/context token + 1 ms/seq
        return 0.02 + 1e-4 * sum(shape.prefill_new_tokens) + 1e-6 * shape.decode_context_tokens + 1e-3 * shape.num_decodes

    shapes = [BatchShape((32,), (256,)), BatchShape((64,), (0,))]
    shapes += [BatchShape((), (), b, 300 * b) for b in (1, 2, 3, 4, 6)]
    shapes += [BatchShape((n,), (256,), b, 300 * b) for n, b in ((32, 1), (32, 3), (48, 2), (16, 5))]
    samples = [StepSample(shape, step_s(shape)) for shape in shapes]
    fitted = fit_linear(samples)
    assert fitted == fit_joint(samples)
    model = LinearCostModel({1: fitted}, 0)
    for shape in shapes:  # mixed steps included: prefill + decode - the shared intercept once
        assert model.step_s(shape) == pytest.approx(step_s(shape), rel=1e-6)
    with pytest.raises(InvalidRequestError, match="prefill and decode among them"):
        fit_joint([StepSample(BatchShape((), (), b, 10 * b), 0.01 * b) for b in range(1, 10)])
