"""Waiting-queue policies: the order in which a worker's local scheduler tries to admit requests.

A policy only orders; the scheduler admits from the front of that order until the token budget,
`max_num_seqs` or the KV blocks run out, and stops at the first request that does not fit (so a
policy's order is also its fairness guarantee), telling the policy of each fresh admission
(`on_admitted`). Every policy is deterministic: ties fall back to the order of the `waiting`
sequence the scheduler passes in, which is FCFS — preempted requests at the front (they already
waited and were admitted once), then arrival order. Only `preble` keeps state between steps (the
shares its groups have had), and only from what it is told.

All policies keep preempted requests first, in the order given: they hold output the user has
already seen, and letting fresh cache hits jump ahead of them can starve them indefinitely.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Protocol

from kvbaton.core.errors import InvalidRequestError
from kvbaton.core.request import Request, RequestStatus

# Callable giving the prefix-cache hit a request would get if admitted now, in tokens.
# The scheduler implements it with `match_prefix(..., touch=False)` so ordering never refreshes LRU.
CachedTokensFn = Callable[[Request], int]

NUM_PREBLE_GROUPS = 10


class QueuePolicy(Protocol):
    """Orders waiting requests for admission.

    Contract: returns a permutation of `waiting` (every request exactly once); must not modify
    the requests; may call `cached_tokens` (a read-only cache probe) any number of times.
    """

    name: str

    def order(self, waiting: Sequence[Request], cached_tokens: CachedTokensFn) -> list[Request]: ...

    def on_admitted(self, request: Request, num_cached_tokens: int) -> None:
        """A waiting request that was never running was admitted, with that prefix-cache hit."""


def _split_preempted(waiting: Sequence[Request]) -> tuple[list[Request], list[Request]]:
    preempted = [r for r in waiting if r.status is RequestStatus.PREEMPTED]
    fresh = [r for r in waiting if r.status is not RequestStatus.PREEMPTED]
    return preempted, fresh


class _StatelessPolicy:
    """A policy whose order depends on the waiting requests alone: admissions teach it nothing."""

    def on_admitted(self, request: Request, num_cached_tokens: int) -> None:
        return None


class FcfsPolicy(_StatelessPolicy):
    """First come, first served: preempted requests first, then arrival order."""

    name = "fcfs"

    def order(self, waiting: Sequence[Request], cached_tokens: CachedTokensFn) -> list[Request]:
        preempted, fresh = _split_preempted(waiting)
        return preempted + fresh


class LongestPrefixPolicy(_StatelessPolicy):
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
    """Preble's local scheduler: priority groups by cached-token ratio, each with a share of admissions
    proportional to its priority, kept across steps (stride scheduling), so every class's wait is bounded.

    Exact rule:
      1. Preempted requests first, in the order given.
      2. Every other request goes to group g = min(9, floor(10 * cached_tokens / prompt_tokens)),
         keeping FCFS order inside the group.
      3. Group g has weight g + 1 and a pass value; each admission of one of its requests advances its pass by
         1 / (g + 1). The order interleaves the non-empty groups by smallest pass after their next admission
         (ties: the higher group), advancing a copy of the passes as it goes: high-hit requests first (group 9's
         first request at 0.1, group 0's at 1.0), group 9 getting ten admissions for each of group 0's while
         both wait. A group passed over in earlier steps keeps its pass and comes first once the others' have
         grown past it: a low-hit request waits at most about (sum of the weights of the groups waiting) / its
         weight admissions, however few a step admits and however many cache hits keep arriving.
      4. A group that was empty joins at the current virtual time (the pass its last admission left), so it
         cannot bank shares while idle.
    """

    name = "preble"

    def __init__(self) -> None:
        self._pass = [0.0] * NUM_PREBLE_GROUPS
        self._virtual_time = 0.0
        self._was_empty = [True] * NUM_PREBLE_GROUPS

    def order(self, waiting: Sequence[Request], cached_tokens: CachedTokensFn) -> list[Request]:
        preempted, fresh = _split_preempted(waiting)
        groups: list[list[Request]] = [[] for _ in range(NUM_PREBLE_GROUPS)]
        for r in fresh:
            groups[preble_group(cached_tokens(r), r.num_prompt_tokens)].append(r)
        passes = self._pass
        for g, group in enumerate(groups):
            if group and self._was_empty[g]:
                passes[g] = max(passes[g], self._virtual_time)
            self._was_empty[g] = not group
        ordered = list(preempted)
        heap = [(passes[g] + 1.0 / (g + 1), -g) for g in range(NUM_PREBLE_GROUPS) if groups[g]]
        heapq.heapify(heap)
        heads = [0] * NUM_PREBLE_GROUPS
        while heap:
            at, minus_g = heapq.heappop(heap)
            g = -minus_g
            group = groups[g]
            ordered.append(group[heads[g]])
            heads[g] += 1
            if heads[g] < len(group):
                heapq.heappush(heap, (at + 1.0 / (g + 1), minus_g))
        return ordered

    def on_admitted(self, request: Request, num_cached_tokens: int) -> None:
        g = preble_group(num_cached_tokens, request.num_prompt_tokens)
        self._virtual_time = max(self._virtual_time, self._pass[g])
        self._pass[g] += 1.0 / (g + 1)


class PriorityPolicy(_StatelessPolicy):
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
