"""Placement policies and their factory: round_robin, least_load, longest_prefix here; preble in `preble.py`,
conductor (transfer-aware, with the KV store) in `conductor.py`.

All policies share `RouterState`, commit every decision to it, and break ties with the seeded
`random.Random` they were given (over the sorted tied ids, so the input order does not matter).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from kvbaton.core.errors import CapacityError, InvalidRequestError
from kvbaton.router.base import PlacementPolicy, RouteDecision, RouteRequest, WorkerId
from kvbaton.router.state import RouterState

POLICY_NAMES = ("round_robin", "least_load", "longest_prefix", "preble", "conductor")


class BasePolicy:
    """Shared hooks; subclasses implement `choose`."""

    name = "base"

    def __init__(self, state: RouterState, rng: random.Random) -> None:
        self.state = state
        self.rng = rng

    def on_first_token(self, request_id: str, ttft_s: float, now: float) -> None:
        return None

    def on_finished(self, request_id: str, now: float) -> None:
        self.state.load.on_finished(request_id)

    def on_worker_removed(self, worker_id: WorkerId) -> None:
        self.state.remove_worker(worker_id)

    def _matched(self, request: RouteRequest, matched: Mapping[WorkerId, int] | None) -> Mapping[WorkerId, int]:
        """The caller's match of this request (the placement matches once), else the index's now."""
        return self.state.index.match(request.block_hashes) if matched is None else matched

    def _break_tie(self, tied: list[WorkerId]) -> WorkerId:
        return tied[0] if len(tied) == 1 else self.rng.choice(sorted(tied))

    def _least_loaded(self, candidates: Sequence[WorkerId]) -> tuple[WorkerId, int]:
        load_tokens = self.state.load.load_tokens
        loads = [load_tokens(w) for w in candidates]
        lowest = min(loads)
        return self._break_tie([w for w, x in zip(candidates, loads) if x == lowest]), lowest

    def _decide(
        self, request: RouteRequest, worker: WorkerId, matched: Mapping[WorkerId, int], reason: str, now: float
    ) -> RouteDecision:
        num_blocks = matched.get(worker, 0)
        state = self.state
        state.commit(request, worker, num_blocks, now)
        return RouteDecision(
            worker, state.matched_tokens(request, num_blocks), reason, state.load.load_tokens(worker), None
        )


def _require_workers(workers: Sequence[WorkerId]) -> None:
    if not workers:
        raise CapacityError("no live worker to route to")


class RoundRobinPolicy(BasePolicy):
    name = "round_robin"

    def __init__(self, state: RouterState, rng: random.Random) -> None:
        super().__init__(state, rng)
        self._num_routed = 0

    def choose(self, request: RouteRequest, workers: Sequence[WorkerId], now: float,
               matched: Mapping[WorkerId, int] | None = None) -> RouteDecision:
        _require_workers(workers)
        worker = workers[self._num_routed % len(workers)]
        self._num_routed += 1
        return self._decide(request, worker, self._matched(request, matched), self.name, now)


class LeastLoadPolicy(BasePolicy):
    """Least queued prefill tokens + KV tokens in use (not request counts)."""

    name = "least_load"

    def choose(self, request: RouteRequest, workers: Sequence[WorkerId], now: float,
               matched: Mapping[WorkerId, int] | None = None) -> RouteDecision:
        _require_workers(workers)
        worker, _ = self._least_loaded(workers)
        return self._decide(request, worker, self._matched(request, matched), self.name, now)


class LongestPrefixPolicy(BasePolicy):
    """Locality only: the longest cached prefix wins, ties by load; no match anywhere means least load."""

    name = "longest_prefix"

    def choose(self, request: RouteRequest, workers: Sequence[WorkerId], now: float,
               matched: Mapping[WorkerId, int] | None = None) -> RouteDecision:
        _require_workers(workers)
        matched = self._matched(request, matched)
        longest = max((matched.get(w, 0) for w in workers), default=0)
        candidates = [w for w in workers if matched.get(w, 0) == longest]
        worker, _ = self._least_loaded(candidates)
        return self._decide(request, worker, matched, self.name, now)


def create_policy(
    name: str, state: RouterState, rng: random.Random, config: object | None = None
) -> PlacementPolicy:
    """Build a placement policy by name; `config` is a `PrebleConfig` for `preble` (None: defaults)."""
    if name == "round_robin":
        return RoundRobinPolicy(state, rng)
    if name == "least_load":
        return LeastLoadPolicy(state, rng)
    if name == "longest_prefix":
        return LongestPrefixPolicy(state, rng)
    if name == "preble":
        from kvbaton.router.preble import PrebleConfig, PrebleE2Policy

        if config is not None and not isinstance(config, PrebleConfig):
            raise InvalidRequestError(f"preble expects a PrebleConfig, got {type(config).__name__}")
        return PrebleE2Policy(state, rng, config or PrebleConfig())
    if name == "conductor":
        from kvbaton.router.conductor import ConductorPolicy

        return ConductorPolicy(state, rng)
    raise InvalidRequestError(f"unknown placement policy {name!r}; choose one of {POLICY_NAMES}")


def local_queue_policy(policy_name: str) -> str:
    """The waiting-queue policy each worker's local scheduler runs under a router policy (Preble pairs with its fairness queue)."""
    return "preble" if policy_name == "preble" else "fcfs"
