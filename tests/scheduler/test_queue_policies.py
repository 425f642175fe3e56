"""Orders produced by the waiting-queue policies, alone and inside the scheduler."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvbaton.core.errors import InvalidRequestError
from kvbaton.core.request import Request, RequestStatus
from kvbaton.scheduler.queue_policies import (
    FcfsPolicy,
    LongestPrefixPolicy,
    PreblePriorityPolicy,
    PriorityPolicy,
    create_queue_policy,
    preble_group,
)
from tests.scheduler.helpers import make_request, make_scheduler, step


def _ids(requests: list[Request]) -> list[str]:
    return [r.request_id for r in requests]


def _waiting(hits: dict[str, int], prompt_tokens: int = 10, preempted: tuple[str, ...] = ()) -> list[Request]:
    requests = [make_request(rid, prompt_tokens) for rid in hits]
    for r in requests:
        if r.request_id in preempted:
            r.status = RequestStatus.PREEMPTED
    return requests


def test_fcfs_keeps_order_with_preempted_first() -> None:
    waiting = _waiting({"a": 0, "p": 0, "b": 9}, preempted=("p",))
    assert _ids(FcfsPolicy().order(waiting, lambda r: 0)) == ["p", "a", "b"]


def test_lpm_orders_by_hit_ties_fcfs() -> None:
    hits = {"a": 4, "b": 8, "c": 0, "d": 8, "p": 0}
    waiting = _waiting(hits, preempted=("p",))
    order = LongestPrefixPolicy(fallback_waiting=5).order(waiting, lambda r: hits[r.request_id])
    assert _ids(order) == ["p", "b", "d", "a", "c"]


def test_lpm_falls_back_to_fcfs_above_threshold() -> None:
    hits = {"a": 0, "b": 8, "c": 4}
    probed: list[str] = []

    def cached(r: Request) -> int:
        probed.append(r.request_id)
        return hits[r.request_id]

    assert _ids(LongestPrefixPolicy(fallback_waiting=2).order(_waiting(hits), cached)) == ["a", "b", "c"]
    assert probed == []  # no cache probes once it falls back


@pytest.mark.parametrize(
    ("cached", "prompt", "group"), [(0, 10, 0), (9, 10, 9), (10, 10, 9), (12, 10, 9), (5, 10, 5), (4, 9, 4), (1, 11, 0)]
)
def test_preble_group(cached: int, prompt: int, group: int) -> None:
    assert preble_group(cached, prompt) == group


def test_preble_interleaves_groups_by_weight() -> None:
    hits = {f"g0_{i}": 0 for i in range(15)} | {f"g9_{i}": 100 for i in range(2)}
    hits |= {f"g1_{i}": 15 for i in range(25)}
    waiting = _waiting(hits, prompt_tokens=100, preempted=("g1_3",))
    order = _ids(PreblePriorityPolicy().order(waiting, lambda r: hits[r.request_id]))
    g1 = [f"g1_{i}" for i in range(25) if i != 3]
    g0 = [f"g0_{i}" for i in range(15)]
    # Each group's k-th request is at pass k / (g + 1): group 9 at 0.1, 0.2; group 1 (weight 2) at 0.5, 1.0, 1.5,
    # ...; group 0 at 1.0, 2.0, ... (ties: the higher group). The preempted request stays first.
    assert order[:9] == ["g1_3", "g9_0", "g9_1", g1[0], g1[1], g0[0], g1[2], g1[3], g0[1]]
    assert sorted(order) == sorted(hits) and order[-3:] == g0[-3:]  # group 1 runs out first; group 0's tail last


def test_preble_bounds_a_low_hit_requests_wait_behind_a_stream_of_hits() -> None:
    """Was a bug: the old quotas (group 9 took the first 100 places of every step's order) meant strict priority
    whenever a step admits fewer than 100 requests: a cold request waiting behind a steady stream of cache hits
    was never admitted (as under lpm). Now the shares carry across steps: it waits ~10 admissions of group 9."""
    waits = {}
    for policy in ("preble", "lpm", "fcfs"):
        sched = make_scheduler(num_blocks=4096, prefix_cache=True, max_num_batched_tokens=8, max_num_seqs=64,
                               queue_policy=policy)
        shared = list(range(1, 41))
        sched.add_request(make_request("warm", shared + [99], max_tokens=1))
        for _ in range(10):
            step(sched)
        sched.add_request(make_request("cold", [500 + i for i in range(8)], max_tokens=1))
        for t in range(100):
            for k in range(3):  # three ~93 %-cached arrivals a step, more than the budget admits
                sched.add_request(make_request(f"hit{t}_{k}", shared + [1000 + 3 * t + k, 7, 7], max_tokens=1))
            step(sched, float(t))
            cold = sched.get_request("cold")
            if cold is None or cold.num_computed_tokens > 0:
                waits[policy] = t
                break
    assert waits.get("lpm") is None  # lpm starves it: the case Preble's groups are for
    assert waits["fcfs"] == 0 and waits["preble"] <= 10, waits


def test_create_queue_policy() -> None:
    assert create_queue_policy("fcfs").name == "fcfs"
    lpm = create_queue_policy("lpm", lpm_fallback_waiting=7)
    assert isinstance(lpm, LongestPrefixPolicy) and lpm.fallback_waiting == 7
    assert create_queue_policy("preble").name == "preble"
    with pytest.raises(InvalidRequestError):
        create_queue_policy("random")


@pytest.mark.parametrize(("policy", "expected"), [("fcfs", ["cold", "warm"]), ("lpm", ["warm", "cold"]),
                                                  ("preble", ["warm", "cold"])])
def test_scheduler_admits_in_policy_order(policy: str, expected: list[str]) -> None:
    sched = make_scheduler(prefix_cache=True, queue_policy=policy, max_num_seqs=1, max_num_batched_tokens=32)
    shared = list(range(300, 316))
    sched.add_request(make_request("seed", shared + [1], max_tokens=1))
    step(sched)
    sched.add_request(make_request("cold", list(range(600, 617)), max_tokens=1))
    sched.add_request(make_request("warm", shared + [2], max_tokens=1))
    admitted = [step(sched)[0].chunks[0].request_id for _ in range(2)]
    assert admitted == expected


def _prioritized(priorities: dict[str, int], preempted: tuple[str, ...] = ()) -> list[Request]:
    requests = _waiting(dict.fromkeys(priorities, 0), preempted=preempted)
    return [replace(r, sampling=replace(r.sampling, priority=priorities[r.request_id])) for r in requests]


def test_priority_orders_lowest_value_first_then_preempted_then_arrival() -> None:
    waiting = _prioritized({"a": 1, "b": 0, "c": 1, "p": 1, "d": -5}, preempted=("p",))
    assert _ids(PriorityPolicy().order(waiting, lambda r: 0)) == ["d", "b", "p", "a", "c"]
    assert create_queue_policy("priority").name == "priority"


def test_priority_scheduler_admits_by_priority_and_preempts_the_least_important() -> None:
    """max_num_seqs 1: the waiting request of priority -1 goes before the earlier one of priority 0. Then, with a
    pool too small for both running requests to grow, the one of the higher priority value is preempted, though
    it was admitted first (fcfs would preempt the last admitted)."""
    sched = make_scheduler(queue_policy="priority", max_num_seqs=1)
    for rid, priority in (("low", 0), ("high", -1)):
        request = make_request(rid, 4, max_tokens=1)
        sched.add_request(replace(request, sampling=replace(request.sampling, priority=priority)))
    plan, _ = step(sched)
    assert [c.request_id for c in plan.chunks] == ["high"]

    sched = make_scheduler(5, queue_policy="priority", max_num_batched_tokens=64)
    for rid, priority, arrival in (("first", 2, 0.0), ("second", 0, 1.0)):
        request = make_request(rid, 8, max_tokens=8, arrival_at=arrival)
        sched.add_request(replace(request, sampling=replace(request.sampling, priority=priority)))
    step(sched)  # both prefill 2 blocks each (4 of 5 blocks)
    preempted = []
    for _ in range(8):
        plan, _ = step(sched)
        preempted += plan.preempted_ids
    assert preempted and set(preempted) == {"first"}
    while sched.has_unfinished_requests():
        step(sched)
    assert sched.blocks.pool.num_used_blocks == 0
