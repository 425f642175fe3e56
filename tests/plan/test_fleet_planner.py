"""The hardware search: fleets a budget buys, each priced and powered; the choice follows the prices; the CLI."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvbaton.bench.metrics import SLO
from kvbaton.cli import main
from kvbaton.core.errors import InvalidRequestError
from kvbaton.plan.fleet_planner import FleetPlanner, FleetRequest, fleet_plan_json, fleet_plan_text
from kvbaton.plan.fleets import Budget, Fleet, PoolHardware, enumerate_fleets
from kvbaton.plan.goodput import SearchSettings
from kvbaton.sim.catalog import get_model
from kvbaton.sim.costs import create_cost_model
from kvbaton.sim.hardware import load_prices

SETTINGS = SearchSettings(SLO(1.0, 0.1), 0.9, step_rps=0.5, max_per_gpu_rps=64.0, ceiling_rps=4.0)
SMALL = FleetRequest("llama-2-70b", ("h100", "a100"), Budget(per_hour=20.0), SETTINGS, max_tp=2, num_requests=200,
                     num_processes=1)


def _costs(*gpus: str) -> dict:
    return {g: create_cost_model("roofline", "llama-2-70b", g) for g in gpus}


def test_enumeration_lists_the_fleets_a_budget_fills() -> None:
    prices = load_prices(None)
    fleets = enumerate_fleets(get_model("llama-2-70b"), _costs("h100", "a100"), ("h100", "a100"), (1.0, 0.5),
                              Budget(per_hour=20.0), prices, 2, 4096)
    labels = [f.label for f in fleets]
    assert labels[:2] == ["colocated 2 x h100 tp2", "colocated 4 x a100 tp2"]  # tp1 holds no 70B model
    assert "P 1 x h100 tp2 + D 2 x a100 tp2" in labels and "P 1 x h100 tp2 + D 2 x a100 tp2 cap 0.5" in labels
    for fleet in fleets:
        price = fleet.price_per_hour(prices)
        assert price <= 20.0
        # no room for another worker of either pool
        for pool in fleet.pools:
            assert price + pool.tp * prices[pool.gpu] > 20.0
    # A power budget alone buys by watts: capped decode pools fit more workers.
    by_power = enumerate_fleets(get_model("llama-2-70b"), _costs("h100"), ("h100",), (1.0, 0.5),
                                Budget(power_kw=4.2), prices, 2, 4096)
    assert [f.label for f in by_power] == ["colocated 3 x h100 tp2", "P 1 x h100 tp2 + D 2 x h100 tp2",
                                           "P 2 x h100 tp2 + D 1 x h100 tp2", "P 1 x h100 tp2 + D 4 x h100 tp2 cap 0.5",
                                           "P 2 x h100 tp2 + D 2 x h100 tp2 cap 0.5"]
    assert by_power[3].power_kw == pytest.approx(2 * 0.7 + 4 * 2 * 0.35)


def test_fleet_spec_prices_power_and_homogeneity() -> None:
    fleet = Fleet(PoolHardware("h100", 2, 1), PoolHardware("a100", 4, 2, 0.7))
    assert fleet.cluster_spec == "1P2D:tp_p=2,tp_d=4,gpu_p=h100,gpu_d=a100,cap_d=0.7,link=infiniband"
    assert fleet.price_per_hour({"h100": 4.0, "a100": 2.0}) == pytest.approx(2 * 4.0 + 8 * 2.0)
    assert fleet.power_kw == pytest.approx((2 * 700 + 8 * 400 * 0.7) / 1e3)
    assert not fleet.homogeneous and Fleet(colocated=PoolHardware("a100", 2, 3)).homogeneous
    assert not Fleet(PoolHardware("h100", 2), PoolHardware("h100", 2, 1, 0.7)).homogeneous


@pytest.fixture(scope="module")
def default_plan():  # noqa: ANN201 - a FleetPlan
    return FleetPlanner(SMALL).run()


def test_the_choice_follows_the_prices(default_plan) -> None:  # noqa: ANN001
    """At list prices two H100 workers beat four A100 workers for $20/h; at $9 per H100-hour only one H100 worker
    fits, and the A100 fleet wins."""
    dear = FleetPlanner(replace(SMALL, prices=(("h100", 9.0),))).run()
    assert default_plan.best.fleet.label == "colocated 2 x h100 tp2"
    assert dear.best.fleet.label == "colocated 4 x a100 tp2"
    for plan in (default_plan, dear):
        assert not plan.best.result.capped and plan.best.goodput_rps > 0
        assert plan.best.goodput_rps == max(c.goodput_rps for c in plan.candidates)
        assert plan.best_homogeneous is plan.best
    # the A100 fleet measures the same either way: its price changed nothing of its goodput
    a100 = [c for c in default_plan.candidates if c.fleet.label == "colocated 4 x a100 tp2"]
    assert a100[0].goodput_rps == dear.best.goodput_rps


def test_plan_reports_goodput_per_gpu_dollar_and_kw(default_plan) -> None:  # noqa: ANN001
    payload = fleet_plan_json(default_plan)
    best = payload["best"]
    assert best["goodput_rps"] == pytest.approx(best["per_gpu_goodput_rps"] * best["num_gpus"])
    assert best["goodput_per_dollar_hour"] == pytest.approx(best["goodput_rps"] / best["price_per_hour"], rel=1e-5)
    assert best["goodput_per_kw"] == pytest.approx(best["goodput_rps"] / best["power_kw"], rel=1e-5)
    assert payload["best_homogeneous"] == best and len(payload["candidates"]) == len(default_plan.candidates)
    heterogeneous = [c for c in payload["candidates"] if not c["homogeneous"]]
    assert heterogeneous and all("gpu" in c["prefill"] and "cap" in c["decode"] for c in heterogeneous)
    text = fleet_plan_text(default_plan)
    assert text.splitlines()[1].startswith("best: colocated 2 x h100 tp2 (4 GPUs, $19.04/h, 2.80 kW)")
    json.dumps(payload)


def test_cli_hardware_search_is_byte_identical_for_one_and_two_processes(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "llama-2-70b", "--gpus", "h100,a100", "--budget-per-hour", "10", "--max-tp", "2",
            "--ttft-slo", "1", "--tpot-slo", "0.1", "--num-requests", "60", "--rate-step", "1", "--first-ceiling",
            "4", "--max-rate", "16", "--decode-caps", "1,0.6", "--min-probe-s", "3", "--json"]
    outputs = []
    for processes in ("1", "2"):
        assert main([*argv, "--processes", processes]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]
    settings = json.loads(outputs[0])["settings"]
    assert settings["budget_per_hour"] == 10.0 and settings["min_probe_s"] == 3.0


@pytest.mark.parametrize(("extra", "message"), [
    (["--gpus", "h100,b300", "--budget-per-hour", "10"], "unknown GPU 'b300'"),
    (["--gpus", "h100"], "needs a budget"),
    (["--gpus", "h100", "--budget-per-hour", "10", "--decode-caps", "1.2"], "outside (0, 1]"),
    (["--gpus", "h100", "--budget-per-hour", "-1"], "must be a positive finite number"),
    (["--gpus", "h100", "--budget-per-hour", "1"], "the budget buys no fleet"),
    (["--gpu", "h100", "--num-gpus", "2", "--budget-per-hour", "10"], "name the GPUs with --gpus"),
    ([], "give --gpu and --num-gpus"),
])
def test_bad_hardware_searches_are_one_line_errors(extra: list[str], message: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "llama-2-70b", "--ttft-slo", "1", "--tpot-slo", "0.1", "--num-requests", "10",
            "--processes", "1", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    with pytest.raises(InvalidRequestError):
        Budget()


def test_a_probe_lasts_long_enough_at_a_fleets_rate() -> None:
    """At 100 req/s, 50 requests arrive in half a second — one burst a fleet absorbs before its queues build; with
    min_probe_s the mix is repeated (new ids, later arrivals) until the arrivals span that long."""
    from kvbaton.plan.goodput import lasting
    from kvbaton.plan.planner import search_requests

    requests = search_requests("sharegpt-like", (), 50, 0, 4096)
    assert lasting(requests, 100.0, 0.0) is requests and lasting(requests, 0.5, 20.0) is requests
    long = lasting(requests, 100.0, 20.0)
    assert long[-1].arrival_s / 100.0 >= 20.0 and len(long) % 50 == 0
    assert len({r.request_id for r in long}) == len(long)
    assert [r.index for r in long] == list(range(len(long)))
    assert all(b.arrival_s > a.arrival_s for a, b in zip(long, long[1:]))
    assert [r.output_tokens for r in long[50:100]] == [r.output_tokens for r in requests]
    with pytest.raises(InvalidRequestError):
        SearchSettings(SLO(1.0, 0.1), min_probe_s=-1.0)
