"""Placement enumeration: DistServe's Algorithm 1 (high affinity) and 2 (node-constrained), memory and degrees."""

from __future__ import annotations

import pytest

from kvbaton.core.errors import InvalidRequestError
from kvbaton.plan.placements import (Hardware, Placement, PoolConfig, colocated_placements, disaggregated_placements,
                                     fits_memory, possible_pps, possible_tps)
from kvbaton.sim.catalog import get_gpu, get_model
from kvbaton.sim.costs import create_cost_model
from kvbaton.sim.spec import parse_cluster_spec

A100 = get_gpu("a100")
OPT13 = get_model("opt-13b")
DISTSERVE = create_cost_model("distserve", "opt-13b", "a100")


def _pairs(placements: list[Placement]) -> list[tuple[int, int, int, int]]:
    return [(p.prefill.tp, p.prefill.pp, p.decode.tp, p.decode.pp) for p in placements]  # type: ignore[union-attr]


def test_degrees_follow_the_cost_model_and_the_layers() -> None:
    assert possible_tps(OPT13, DISTSERVE, 8) == [1, 2, 4]  # published coefficient sets only
    roofline = create_cost_model("roofline", "llama-3-8b", "a100")
    assert possible_tps(get_model("llama-3-8b"), roofline, 8) == [1, 2, 4, 8]  # divides 8 KV heads
    assert possible_pps(OPT13, 8) == [1, 2, 4, 5, 8]  # divides 40 layers


def test_distserve_readme_case_one_node_of_four() -> None:
    hw = Hardware(A100, num_gpus=4, gpus_per_node=4)
    low = disaggregated_placements(OPT13, DISTSERVE, hw, "low", 2048)
    assert _pairs(low) == [(1, 1, 1, 1), (1, 1, 2, 1), (2, 1, 1, 1), (2, 1, 2, 1)]
    assert {p.link for p in low} == {"nvlink-a100"}
    with_pp = disaggregated_placements(OPT13, DISTSERVE, hw, "low", 2048, max_pp=2)
    assert (1, 2, 1, 1) in _pairs(with_pp) and (1, 2, 1, 2) in _pairs(with_pp)
    assert all(p.num_gpus <= 4 for p in with_pp)
    colocated = colocated_placements(OPT13, DISTSERVE, hw, 2048)
    assert [(p.colocated.tp, p.colocated.pp) for p in colocated] == [(1, 1), (2, 1), (4, 1)]  # type: ignore[union-attr]


def test_node_constrained_keeps_each_pair_segment_in_a_node_high_affinity_may_span() -> None:
    hw = Hardware(A100, num_gpus=8, gpus_per_node=4)
    low = disaggregated_placements(OPT13, DISTSERVE, hw, "low", 2048, max_pp=2)
    high = disaggregated_placements(OPT13, DISTSERVE, hw, "high", 2048, max_pp=2)
    assert (4, 1, 4, 1) not in _pairs(low)  # 8 GPUs do not fit one 4-GPU node
    assert (4, 1, 4, 1) in _pairs(high)
    spanning = [p for p in high if p.num_gpus > 4]
    assert spanning and {p.link for p in spanning} == {"infiniband"}
    # Algorithm 2 with pp_cross = 2: both instances split over the two nodes, KV still on NVLink.
    crossing = [p for p in low if p.prefill.pp == 2 and p.decode.pp == 2]  # type: ignore[union-attr]
    assert crossing and all(p.link == "nvlink-a100" for p in crossing)


def test_memory_filter_drops_instances_that_cannot_hold_the_weights() -> None:
    opt66 = get_model("opt-66b")
    assert not fits_memory(opt66, A100, 1, 2048)
    assert fits_memory(opt66, A100, 2, 2048)
    cost = create_cost_model("distserve", "opt-66b", "a100")
    hw = Hardware(A100, num_gpus=8, gpus_per_node=8)
    placements = disaggregated_placements(opt66, cost, hw, "low", 2048) + colocated_placements(opt66, cost, hw, 2048)
    assert placements and all(min(c.tp for c in (p.prefill, p.decode, p.colocated) if c) >= 2 for p in placements)


def test_cluster_spec_round_trips_through_the_simulator_parser() -> None:
    disagg = Placement("node-constrained", PoolConfig(2, 1), PoolConfig(1, 2), link="nvlink-a100")
    spec = parse_cluster_spec(disagg.cluster_spec)
    assert spec.num_gpus == disagg.num_gpus == 4
    assert [(w.role, w.parallel.tp, w.parallel.pp) for w in spec.workers] == [("prefill", 2, 1), ("decode", 1, 2)]
    assert disagg.to_json() == {"prefill": {"tp": 2, "pp": 1, "replicas": 1},
                                "decode": {"tp": 1, "pp": 2, "replicas": 1}}
    colocated = Placement("colocated", colocated=PoolConfig(4, 1))
    assert parse_cluster_spec(colocated.cluster_spec).num_gpus == 4
    assert colocated.to_json() == {"colocated": {"tp": 4, "pp": 1, "replicas": 1}}
    with pytest.raises(InvalidRequestError):
        Placement("colocated", PoolConfig(1, 1), PoolConfig(1, 1), colocated=PoolConfig(1, 1))
    with pytest.raises(InvalidRequestError):
        disaggregated_placements(OPT13, DISTSERVE, Hardware(A100, 4, 4), "medium", 2048)
