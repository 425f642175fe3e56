"""Live SLO admission and adaptive pools: the router's tally of routed calls, 429s from an overloaded 1P+1D
cluster, and a prefill worker lent to mixed duty while decode queues.

The pure policy's decisions are tested in tests/router/test_admission.py; here the router feeds it from
what it routed and refuses at arrival, before any worker sees the call, and nothing is left held.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from kvbaton.core.errors import KvbatonError
from kvbaton.model.registry import LoadedModel, load_model
from kvbaton.router.admission import (AdmissionPolicy, AdmissionRequest, AdmissionSLO, CalibratedTimeModel, DecodeSlot,
                                      PrefillLoad)
from kvbaton.router.pools import PoolBalancer, PoolConfig
from kvbaton.server.base import GenerateCall, RejectedError
from kvbaton.server.cluster import ClusterManager
from kvbaton.router.call_tally import CallTally
from kvbaton.server.launcher import ServeConfig, admission_policy, pool_balancer
from kvbaton.sim.costs.linear import LinearCoefficients, LinearCostModel, save_linear_model
from tests.server.pd_helpers import BLOCK_SIZE, collect, colocated, greedy, run_pd, tokens_of, wait_clean
from tests.server.test_worker_cluster import WorkerThread

# 1 ms per prompt token, 10 ms per decode step plus 1 ms per sequence: easy arithmetic, not the host's speed.
COST = LinearCostModel({1: LinearCoefficients((0.0, 1e-3, 0.0, 0.0), (0.01, 0.0, 1e-3), (0.01, 0.0, 1e-3))}, 0)


def policy(name: str, ttft_s: float = 0.25, tpot_s: float = 0.05) -> AdmissionPolicy:
    return AdmissionPolicy(name, AdmissionSLO(ttft_s, tpot_s), {}, default_model=COST)


def gate(name: str = "early", capacity_tokens: int = 10_000) -> CallTally:
    return CallTally(policy(name), BLOCK_SIZE, lambda worker: capacity_tokens)


def test_tally_prices_waiting_prompts_on_their_prefill_worker_and_decodes_on_their_decode_worker() -> None:
    g = gate()
    g.on_routed("a", "p0", "d0", 100, 32, 10)  # 68 tokens to compute on p0, decodes on d0
    g.on_routed("b", "p0", "d0", 50, 0, 5)
    g.on_routed("c", "w0", "w0", 40, 0, 8)  # served whole by one worker
    assert g.prefill_load("p0").num_queued_tokens == 68 + 50
    assert g.prefill_load("p0").queue == ((68, 32), (50, 0))  # prompt by prompt, in routing order
    # Each reaches decode once p0 has computed the uncached prompts routed before it and its own (1 ms/token).
    assert g.decode_load("d0").incoming == (DecodeSlot(100, 10, pytest.approx(0.068)),
                                            DecodeSlot(50, 5, pytest.approx(0.118)))
    assert not g.decode_load("d0").decoding
    g.on_tokens("a", 3)  # first tokens streamed: a left the prefill queue and decodes now
    assert g.prefill_load("p0").num_queued_tokens == 50
    assert g.decode_load("d0").decoding == (DecodeSlot(103, 7),)
    assert g.decode_load("d0").incoming == (DecodeSlot(50, 5, pytest.approx(0.050)),)  # a is out of p0's queue
    assert g.prefill_load("w0").num_queued_tokens == 40 and len(g.decode_load("w0").incoming) == 1
    for request_id in ("a", "b", "c", "never-routed"):
        g.on_ended(request_id)
    assert g.num_tracked == 0 and g.prefill_load("p0").num_queued_tokens == 0 and g.decode_load("d0").incoming == ()


def test_check_admits_on_the_best_option_and_counts_refusals_by_stage() -> None:
    g = gate("baseline")
    g.on_routed("busy", "p0", "d0", 240, 0, 4)  # p0: 240 ms of prefill queued
    # 40 new tokens: p0 would answer in 0.28 s > 0.25 s, p1 in 0.04 s.
    assert g.check("x", 40, 4, {}, [("p0", "d0"), ("p1", "d0")], 0.0).admitted
    refused = g.check("x", 40, 4, {}, [("p0", "d0")], 0.0)
    assert not refused.admitted and refused.reason.startswith("prefill over capacity")
    # The prompt's blocks cached on p0 shorten its prefill under the SLO.
    assert g.check("x", 40, 4, {"p0": 2}, [("p0", "d0")], 0.0).admitted
    assert g.num_rejected_by_stage == {"prefill": 1, "decode": 0}


def test_decode_stage_refuses_when_kv_reservations_exceed_the_decode_worker() -> None:
    g = gate("early", capacity_tokens=1000)
    g.on_routed("long", "p0", "d0", 500, 0, 400)
    g.on_tokens("long", 1)
    decision = g.check("x", 40, 100, {}, [("p0", "d0")], 0.0)  # 901 + 140 reserved > 1000
    assert not decision.admitted and decision.reason.startswith("decode over capacity")
    assert gate("baseline", capacity_tokens=1000).check("x", 40, 100, {}, [("p0", "d0")], 0.0).admitted


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random")


def test_overloaded_pd_cluster_answers_429_at_once_and_serves_what_it_admitted(tiny: LoadedModel) -> None:
    def prompt(i: int) -> tuple[int, ...]:  # 80 unrelated tokens each: 80 ms priced; a 0.25 s TTFT holds three
        return tuple((j * 7 + i * 13) % 380 + 3 for j in range(80))

    async def body(cluster: ClusterManager, workers: dict[str, WorkerThread]) -> None:
        async def one(i: int) -> tuple[str, float]:
            started = time.monotonic()
            try:
                deltas = await collect(cluster, GenerateCall(f"r-{i}", prompt(i), greedy(4), 0.0))
            except RejectedError as exc:
                assert exc.status_code == 429 and "cannot meet its SLO (baseline admission)" in str(exc)
                assert "prefill over capacity" in str(exc)
                return "rejected", time.monotonic() - started
            assert deltas[-1].finish_reason == "length"
            return "served", time.monotonic() - started

        outcomes = await asyncio.gather(*(one(i) for i in range(8)))  # routed in one loop turn: one burst
        assert [kind for kind, _ in outcomes] == ["served"] * 3 + ["rejected"] * 5
        # Refused at arrival, before placement: no worker ever saw them (and no second-long wait on a loaded host).
        assert cluster.router_decisions.get("slo_reject_prefill") == 5 and cluster.router_decisions.get("pair") == 3
        assert max(s for kind, s in outcomes if kind == "rejected") < 1.0
        await wait_clean(cluster, ["p0", "d0"])
        assert cluster.tally is not None and cluster.tally.num_tracked == 0
        # The burst drained: the same prompt is admitted again.
        assert (await one(100))[0] == "served"

    run_pd(tiny, {"p0": "prefill", "d0": "decode"}, body, admission=policy("baseline"))


def test_the_decode_stage_gate_refuses_a_prefilled_call_and_frees_both_workers(tiny: LoadedModel) -> None:
    # Baseline admission passes the prompt at arrival (80 ms of prefill under a 0.25 s TTFT); a decode step is priced
    # at 11 ms against a 5 ms TPOT SLO, so the decode stage refuses it once its KV reached d0, as the simulator's
    # gate does (`ClusterPlacement.check_decode`).
    async def body(cluster: ClusterManager, workers: dict[str, WorkerThread]) -> None:
        prompt = tuple((j * 7) % 380 + 3 for j in range(80))
        deltas = await collect(cluster, GenerateCall("gated", prompt, greedy(4), 0.0))
        assert [(d.finish_reason, d.new_token_ids) for d in deltas] == [("rejected", ())]
        assert "at decode" in deltas[0].error and "decode over capacity" in deltas[0].error
        assert cluster.router_decisions == {"pair": 1, "slo_reject_at_decode": 1} and cluster.num_rejected == 1
        await wait_clean(cluster, ["p0", "d0"])  # the decode worker was told to abort: no block is left held
        assert cluster.tally is not None and cluster.tally.num_tracked == 0 and cluster.num_in_flight == 0

    run_pd(tiny, {"p0": "prefill", "d0": "decode"}, body, admission=policy("baseline", tpot_s=0.005))


def test_serve_builds_the_admission_policy_from_a_profile_and_refuses_an_incomplete_setup(tmp_path: Path) -> None:
    assert admission_policy(ServeConfig()) is None
    with pytest.raises(KvbatonError, match="needs --ttft-slo, --tpot-slo and --cost-profile"):
        admission_policy(ServeConfig(admission="predicted", ttft_slo_s=1.0, tpot_slo_s=0.1))
    profile = tmp_path / "profile.json"
    save_linear_model(profile, "smollm2-135m", COST.coefficients(1), 0, "test")
    built = admission_policy(ServeConfig(admission="predicted", ttft_slo_s=1.0, tpot_slo_s=0.1,
                                         cost_profile=str(profile)))
    assert built is not None and built.name == "predicted" and built.slo == AdmissionSLO(1.0, 0.1)
    assert built.predict_ttft_s(AdmissionRequest("r", 100, 1), PrefillLoad("any-worker", 400)) == pytest.approx(0.5)


def test_adaptive_pools_lend_the_idle_prefill_worker_when_decode_queues_and_its_outputs_stay_exact(
        tiny: LoadedModel) -> None:
    # Decode-heavy traffic: short prompts, long outputs. A 12 ms TPOT SLO holds two decoding sequences on d0
    # (10 ms + 1 ms each), so a third pushes the decode pool over while the prefill pool idles.
    balancer = PoolBalancer(AdmissionSLO(ttft_s=1.0, tpot_s=0.012), {}, COST,
                            PoolConfig(sustain_s=0.0, cooldown_s=0.0))

    def prompt(i: int) -> list[int]:
        return [(j * 5 + i * 11) % 380 + 3 for j in range(20)]

    async def body(cluster: ClusterManager, workers: dict[str, WorkerThread]) -> None:
        calls = [GenerateCall(f"r-{i}", tuple(prompt(i)), greedy(24), 0.0) for i in range(6)]
        results = await asyncio.gather(*(collect(cluster, call) for call in calls))
        assert balancer.lent == {"p0": "prefill"} and balancer.switches[0].worker_id == "p0"
        assert cluster.router_decisions.get("pool_lent", 0) >= 1 and cluster.router_decisions.get("pair", 0) >= 2
        for i, deltas in enumerate(results):  # whole on p0 or handed off to d0: the same greedy tokens
            assert tokens_of(deltas) == colocated(tiny, prompt(i), greedy(24))
        await wait_clean(cluster, ["p0", "d0"])
        assert cluster.tally is not None and cluster.tally.num_tracked == 0
        assert cluster.cluster_info()["lent_workers"] == {"p0": "prefill"}

    run_pd(tiny, {"p0": "prefill", "d0": "decode"}, body, pools=balancer)


def test_serve_builds_adaptive_pools_only_for_disaggregated_pools_with_slos_and_a_profile(tmp_path: Path) -> None:
    profile = tmp_path / "profile.json"
    save_linear_model(profile, "smollm2-135m", COST.coefficients(1), 0, "test")
    full = dict(ttft_slo_s=1.0, tpot_slo_s=0.1, cost_profile=str(profile))
    assert pool_balancer(ServeConfig(num_prefill=1, num_decode=1, **full)) is None  # not asked for
    with pytest.raises(KvbatonError, match="needs disaggregated pools"):
        pool_balancer(ServeConfig(adaptive_pools=True, **full))
    with pytest.raises(KvbatonError, match="needs --ttft-slo"):
        pool_balancer(ServeConfig(num_prefill=1, num_decode=1, adaptive_pools=True))
    built = pool_balancer(ServeConfig(num_prefill=1, num_decode=1, adaptive_pools=True, **full))
    assert built is not None and built.admission.slo == AdmissionSLO(1.0, 0.1) and built.lent == {}


def test_the_gate_feeds_measured_ttft_and_tpot_back_into_a_calibrated_model() -> None:
    calibrated = CalibratedTimeModel(COST, smoothing=1.0)  # the last observation is the scale
    g = CallTally(AdmissionPolicy("baseline", AdmissionSLO(1.0, 0.05), {}, default_model=calibrated),
                      BLOCK_SIZE, lambda worker: 10_000, calibrated)
    g.on_routed("a", "p0", "d0", 100, 0, 5, now=10.0)  # uncorrected: 0.1 s TTFT, a 0.011 s decode step
    g.on_tokens("a", 1, now=10.3)  # 3x the predicted TTFT
    assert calibrated.prefill_scale == pytest.approx(3.0)
    g.on_tokens("a", 4, now=10.3 + 4 * 0.022)  # 4 more tokens at 2x the predicted step
    g.on_ended("a")
    assert calibrated.decode_scale == pytest.approx(2.0)
    # Admission now prices with the corrected model: 100 tokens behind 240 queued -> 3 x 0.34 s > 1 s.
    g.on_routed("busy", "p0", "d0", 240, 0, 4)
    assert not g.check("x", 100, 4, {}, [("p0", "d0")], 11.0).admitted
