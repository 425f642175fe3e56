"""Waiting-queue policies: the order in which a worker's local scheduler tries to admit requests.

A policy only orders; the scheduler admits from the front of that order until the token budget,
`max_num_seqs` or the KV blocks run out, and stops at the first request that does not fit (so a
policy's order is also its fairness guarantee). Every policy is stateless and deterministic: ties
fall back to the order of the `waiting` sequence the scheduler passes in, which is FCFS — preempted
requests at the front (they already waited and were admitted once), then arrival order.

All policies keep preempted requests first, in the order given: they hold output the user has
already seen, and letting fresh cache hits jump ahead of them can starve them indefinitely.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from kvbaton.core.errors import InvalidRequestError
from kvbaton.core.request import Request, RequestStatus

# Callable giving the prefix-cache hit a request would get if admitted now, in tokens.
# The scheduler implements it with `match_prefix(..., touch=False)` so ordering never refreshes LRU.
CachedTokensFn = Callable[[Request], int]

NUM_PREBLE_GROUPS = 10
PREBLE_QUOTA_PER_LEVEL = 10  # group g may admit (g + 1) * 10 requests per round


class QueuePolicy(Protocol):
    """Orders waiting requests for admission.

    Contract: returns a permutation of `waiting` (every request exactly once); must not modify
    the requests; may call `cached_tokens` (a read-only cache probe) any number of times.
    """

    name: str

    def order(self, waiting: Sequence[Request], cached_tokens: CachedTokensFn) -> list[Request]: ...


def _split_preempted(waiting: Sequence[Request]) -> tuple[list[Request], list[Request]]:
    preempted = [r for r in waiting if r.status is RequestStatus.PREEMPTED]
    fresh = [r for r in waiting if r.status is not RequestStatus.PREEMPTED]
    return preempted, fresh


class FcfsPolicy:
    """First come, first served: preempted requests first, then arrival order."""

    name = "fcfs"

    def order(self, waiting: Sequence[Request], cached_tokens: CachedTokensFn) -> list[Request]:
        preempted, fresh = _split_preempted(waiting)
        return preempted + fresh


class LongestPrefixPolicy:
    """Longest prefix match first (SGLang's `lpm`): most cached tokens first, ties FCFS.

    Probing the cache for every waiting request costs O(waiting * prompt); above
    `fallback_waiting` waiting requests the policy degrades to FCFS, as SGLang does.
    """

    name = "lpm"

    def __init__(self, fallback_waiting: int = 128) -> None:
        self.fallback_waiting = fallback_waiting

    def order(self, waiting: Sequence[Request], cached_tokens: CachedTokensFn) -> list[Request]:
        preempted, fresh = _split_preempted(waiting)
        if len(waiting) > self.fallback_waiting:
            return preempted + fresh
        hits = [cached_tokens(r) for r in fresh]
        ranked = sorted(range(len(fresh)), key=lambda i: (-hits[i], i))
        return preempted + [fresh[i] for i in ranked]


def preble_group(num_cached_tokens: int, num_prompt_tokens: int) -> int:
    """Priority group 0..9 of a request: tenths of its prompt that are cached (9 = 90% or more)."""
    if num_prompt_tokens <= 0:
        return 0
    return min(NUM_PREBLE_GROUPS - 1, (NUM_PREBLE_GROUPS * num_cached_tokens) // num_prompt_tokens)


class PreblePriorityPolicy:
    """Preble's local scheduler: priority groups by cached-token ratio with per-round quotas.

    Exact rule:
      1. Preempted requests first, in the order given.
      2. Every other request goes to group g = min(9, floor(10 * cached_tokens / prompt_tokens)),
         keeping FCFS order inside the group.
      3. Rounds: in each round visit groups 9, 8, ..., 0 and take up to (g + 1) * 10 requests from
         the head of group g. Repeat rounds until every group is empty.
    High-hit requests are favoured (group 9 gets 100 slots a round, group 0 gets 10), but every
    non-empty group gets slots in every round, so low-hit requests cannot starve behind a stream
    of cache hits the way they can under `lpm`.
    """

    name = "preble"

    def order(self, waiting: Sequence[Request], cached_tokens: CachedTokensFn) -> list[Request]:
        preempted, fresh = _split_preempted(waiting)
        groups: list[list[Request]] = [[] for _ in range(NUM_PREBLE_GROUPS)]
        for r in fresh:
            groups[preble_group(cached_tokens(r), r.num_prompt_tokens)].append(r)
        ordered = list(preempted)
        heads = [0] * NUM_PREBLE_GROUPS
        remaining = len(fresh)
        while remaining:
            for g in reversed(range(NUM_PREBLE_GROUPS)):
                quota = (g + 1) * PREBLE_QUOTA_PER_LEVEL
                taken = groups[g][heads[g] : heads[g] + quota]
                ordered.extend(taken)
                heads[g] += len(taken)
                remaining -= len(taken)
        return ordered


class PriorityPolicy:
    """vLLM's priority scheduling: the lowest `SamplingParams.priority` first; among equals, preempted requests
    first, then arrival order. The scheduler also preempts the running request of the highest priority value (the
    latest arrival among equals) first (`StepPlanning._preemption_victim`)."""

    name = "priority"

    def order(self, waiting: Sequence[Request], cached_tokens: CachedTokensFn) -> list[Request]:
        preempted = RequestStatus.PREEMPTED
        ranked = sorted(range(len(waiting)), key=lambda i: (waiting[i].sampling.priority,
                                                             waiting[i].status is not preempted, i))
        return [waiting[i] for i in ranked]


def create_queue_policy(name: str, *, lpm_fallback_waiting: int = 128) -> QueuePolicy:
    """The policy named by `SchedulerConfig.queue_policy`."""
    if name == "fcfs":
        return FcfsPolicy()
    if name == "lpm":
        return LongestPrefixPolicy(lpm_fallback_waiting)
    if name == "preble":
        return PreblePriorityPolicy()
    if name == "priority":
        return PriorityPolicy()
    raise InvalidRequestError(f"unknown queue policy {name!r}; expected fcfs, lpm, preble or priority")
