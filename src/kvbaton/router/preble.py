"""Preble's E2 placement: exploit a long cached prefix, else explore the worker minimising C_i = L_i + M_i + P_i.

- Exploit when the longest match covers more of the prompt than it misses: among the workers whose
  match qualifies (or the workers a rebalance/replication allocated that prefix to), the least C_i.
- Explore otherwise: every live worker, least C_i, where L_i is the predicted work routed to it in
  the sliding window, M_i the expected recompute cost of the cached blocks it would evict to admit
  the request (deficit of free blocks x reuse counts of its coldest blocks from the index), and P_i
  the prefill time of the tokens it does not hold.
- Rebalance (after warm-up): when the heaviest worker's L is >= `rebalance_ratio` x the lightest's,
  move the cheapest prefix groups (a group is the deepest block an exploit matched) from heaviest
  to lightest while that narrows the gap, re-attributing their window work; when no group can move
  without overshooting and the heaviest group's TTFT keeps rising there, replicate it onto the
  lightest worker instead (half its window work follows).
- With the cluster KV store (`RouterState.store`), P_i prices loading the store's blocks past the worker's
  device match where that beats computing them (`kvbaton.router.conductor.with_store_load`), and the blocks
  loaded count as cached when the choice is committed.
Ties within a relative 1e-9 go to a seeded random pick so identical workers do not herd.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_left
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from operator import itemgetter

from kvbaton.core.errors import CapacityError, InvalidRequestError
from kvbaton.router.base import (
    CostTerms,
    RouteDecision,
    RouteRequest,
    WorkerId,
)
from kvbaton.router.conductor import store_tiers, with_store_load
from kvbaton.router.policies import BasePolicy
from kvbaton.router.state import RouterState


@dataclass(frozen=True, slots=True)
class PrebleConfig:
    rebalance_ratio: float = 1.5  # heaviest L >= ratio x lightest L triggers a rebalance
    warmup_decisions: int = 64  # no rebalancing before this many decisions
    rebalance_every: int = 8  # check the trigger every this many decisions
    ttft_window_s: float = 180.0  # TTFT history per (prefix group, worker)
    ttft_rise_ratio: float = 2.0  # "keeps rising": mean TTFT of the window's second half >= ratio x first half (Preble: 2)
    min_ttft_samples: int = 3  # per half-window, before a trend counts
    max_sampled_victims: int = 64  # coldest blocks read from the index to price an eviction
    eviction_refresh_mutations: int = 64  # reuse a worker's per-block eviction price for this many index changes

    def __post_init__(self) -> None:
        if self.rebalance_ratio < 1.0 or self.ttft_rise_ratio <= 0.0 or self.ttft_window_s <= 0.0:
            raise InvalidRequestError("rebalance_ratio must be >= 1, ttft_rise_ratio and ttft_window_s > 0")
        if self.warmup_decisions < 0 or self.rebalance_every <= 0 or self.max_sampled_victims <= 0 or (
            self.eviction_refresh_mutations <= 0
        ):
            raise InvalidRequestError(
                "warmup_decisions must be >= 0; rebalance_every, max_sampled_victims, eviction_refresh_mutations > 0"
            )


_SWEEP_EVERY = 1024  # decisions between sweeps of stale per-group state
_NO_RECORD = (0.0, None)  # (window load, free blocks) of a worker the load tracker has not seen
_NEVER_PRICED = (-math.inf, 0.0)  # (mutation count, price) of a worker never priced: always stale
_AT, _TTFT = itemgetter(0), itemgetter(1)  # of a TTFT sample (at, ttft_s)


class TtftTrend:
    """Recent TTFT samples per (prefix group, worker); detects a rising trend over a sliding window."""

    def __init__(self, window_s: float, rise_ratio: float, min_samples: int) -> None:
        self.window_s = window_s
        self.rise_ratio = rise_ratio
        self.min_samples = min_samples
        self._samples: dict[tuple[int, WorkerId], deque[tuple[float, float]]] = {}

    def add(self, group: int, worker: WorkerId, now: float, ttft_s: float) -> None:
        samples = self._samples.setdefault((group, worker), deque())
        samples.append((now, ttft_s))
        self._prune(samples, now)

    def is_rising(self, group: int, worker: WorkerId, now: float) -> bool:
        samples = self._samples.get((group, worker))
        if not samples:
            return False
        self._prune(samples, now)
        # Samples are in time order (`now` never goes backwards), so the halves split at one index;
        # each half is summed in that order, as a list of it would be.
        num_first = bisect_left(samples, now - self.window_s / 2, key=_AT)
        num_second = len(samples) - num_first
        if num_first < self.min_samples or num_second < self.min_samples:
            return False
        first_s = sum(map(_TTFT, islice(samples, num_first)))
        second_s = sum(map(_TTFT, islice(samples, num_first, None)))
        return second_s / num_second >= self.rise_ratio * (first_s / num_first)

    def prune_all(self, now: float) -> None:
        """Drop expired samples and empty histories (keeps memory bounded by the groups seen in the window)."""
        for key in list(self._samples):
            samples = self._samples[key]
            self._prune(samples, now)
            if not samples:
                del self._samples[key]

    def forget(self, group: int, worker: WorkerId) -> None:
        self._samples.pop((group, worker), None)

    def forget_worker(self, worker: WorkerId) -> None:
        for key in [k for k in self._samples if k[1] == worker]:
            del self._samples[key]

    def _prune(self, samples: deque[tuple[float, float]], now: float) -> None:
        horizon = now - self.window_s
        while samples and samples[0][0] < horizon:
            samples.popleft()


class PrebleE2Policy(BasePolicy):
    name = "preble"

    def __init__(self, state: RouterState, rng: random.Random, config: PrebleConfig | None = None) -> None:
        super().__init__(state, rng)
        self.config = config or PrebleConfig()
        self.ttft = TtftTrend(self.config.ttft_window_s, self.config.ttft_rise_ratio, self.config.min_ttft_samples)
        # Prefix group -> (workers its exploit traffic goes to, "rebalanced" | "replicated"). Dropped
        # once the group has no work left in the load window (Preble resets allocations then too).
        self._allocations: dict[int, tuple[frozenset[WorkerId], str]] = {}
        # Per-worker (index mutation count, eviction price in s per evicted block computed then).
        self._eviction_prices: dict[WorkerId, tuple[float, float]] = {}
        self._live_key: tuple[WorkerId, ...] = ()
        self._live: frozenset[WorkerId] = frozenset()
        self.num_decisions = 0
        self.num_moved_groups = 0
        self.num_replications = 0

    # ---- decision ------------------------------------------------------------------------------
    def choose(self, request: RouteRequest, workers: Sequence[WorkerId], now: float,
               matched: Mapping[WorkerId, int] | None = None) -> RouteDecision:
        if not workers:
            raise CapacityError("no live worker to route to")
        state = self.state
        state.load.prune(now)
        self.num_decisions += 1
        cfg = self.config
        if self.num_decisions > cfg.warmup_decisions and self.num_decisions % cfg.rebalance_every == 0:
            self.rebalance(workers, now)
        if self.num_decisions % _SWEEP_EVERY == 0:
            self.sweep(now)

        matched = self._matched(request, matched)
        num_prompt = request.num_prompt_tokens
        longest = self._longest_live(matched, workers)
        longest_tokens = state.matched_tokens(request, longest)
        group: int | None = None
        candidates: Sequence[WorkerId]
        if longest_tokens > num_prompt - longest_tokens:
            group = request.block_hashes[longest - 1]
            allocated = self._allocation(request, longest, workers)
            if allocated is not None:
                candidates, reason = allocated
            else:
                live = self._live_set(workers)
                min_blocks = num_prompt // (2 * state.block_size) + 1  # fewest blocks with cached > missed
                candidates = [w for w, n in matched.items() if n >= min_blocks and w in live]
                reason = "exploit"
        else:
            candidates, reason = workers, "explore"

        worker, costs = self._least_cost(request, candidates, matched)
        num_blocks = matched.get(worker, 0)
        if costs.store_load_s:  # with the KV store: the blocks it loads count as cached
            num_blocks += with_store_load(state, request, worker, num_blocks, math.inf)[2]
        state.commit(request, worker, num_blocks, now, group, costs.prefill_s + costs.store_load_s)
        return RouteDecision(worker, state.matched_tokens(request, num_blocks), reason,
                                   state.load.load_tokens(worker), costs)

    def _live_set(self, workers: Sequence[WorkerId]) -> frozenset[WorkerId]:
        """`workers` as a set, rebuilt only when the live list changes (callers pass the same list per call)."""
        key = tuple(workers)
        if key != self._live_key:
            self._live_key, self._live = key, frozenset(key)
        return self._live

    def _longest_live(self, matched: Mapping[WorkerId, int], workers: Sequence[WorkerId]) -> int:
        """Longest match among live workers; scans `workers` only if some holder is not live."""
        if not matched:
            return 0
        if matched.keys() <= self._live_set(workers):  # the usual case, checked in C
            return max(matched.values())
        return max((matched.get(w, 0) for w in workers), default=0)

    def _least_cost(
        self, request: RouteRequest, candidates: Sequence[WorkerId], matched: Mapping[WorkerId, int]
    ) -> tuple[WorkerId, CostTerms]:
        """The candidate with the least C_i = L_i + M_i + P_i (seeded pick among ties within 1e-9 relative)."""
        state = self.state
        predict = state.prefill_model.predict
        num_prompt = request.num_prompt_tokens
        block_size = state.block_size
        cold_prefill_s = predict(num_prompt, 0)
        total_blocks = state.num_blocks_needed(request, 0)
        cost_inputs = state.load.cost_lookup()
        matched_blocks = matched.get
        priced = self._eviction_prices.get
        # A cached eviction price computed after this mutation count is still fresh.
        stale_at = state.index.num_mutations - self.config.eviction_refresh_mutations
        prefill_by_blocks: dict[int, float] = {}  # many holders share a match length: predict once each
        store = state.store
        low = high = math.inf  # the band of totals that tie with the best so far
        tied: list[WorkerId] = []
        # Hot loop (all live workers when exploring): one pass, dict reads only, no per-worker calls
        # except a prediction per distinct match length and a refresh of a stale eviction price.
        for worker in candidates:
            load_s, free = cost_inputs(worker, _NO_RECORD)
            num_blocks = matched_blocks(worker, 0)
            if num_blocks:
                prefill_s = prefill_by_blocks.get(num_blocks)
                if prefill_s is None:
                    cached = min(num_blocks * block_size, num_prompt)
                    prefill_s = prefill_by_blocks[num_blocks] = predict(num_prompt - cached, cached)
                total = load_s + prefill_s
            else:
                total = load_s + cold_prefill_s
            if store is not None:  # P_i: the store's blocks loaded where that beats computing them
                prefill_s, store_s, _ = with_store_load(state, request, worker, num_blocks, total - load_s)
                total = load_s + prefill_s + store_s
            if free is not None and total_blocks - num_blocks > free:
                at, price_s = priced(worker, _NEVER_PRICED)
                if at <= stale_at:
                    price_s = self._eviction_s_per_block(worker)
                total += (total_blocks - num_blocks - free) * price_s
            if total <= high:  # low < high: most totals fail this one test
                if total < low:
                    tolerance = 1e-9 * (total if total > 1.0 else 1.0)
                    low, high, tied = total - tolerance, total + tolerance, [worker]
                else:
                    tied.append(worker)
        worker = self._break_tie(tied)
        num_blocks = matched_blocks(worker, 0)
        load_s, free = cost_inputs(worker, _NO_RECORD)
        deficit = 0 if free is None else total_blocks - num_blocks - free
        eviction_s = deficit * self._eviction_s_per_block(worker) if deficit > 0 else 0.0
        prefill_s = prefill_by_blocks[num_blocks] if num_blocks else cold_prefill_s
        if store is not None:
            prefill_s, store_s, num_loaded = with_store_load(state, request, worker, num_blocks, prefill_s)
            return worker, CostTerms(load_s, eviction_s, prefill_s, store_s,
                                     **store_tiers(state, request, worker, num_blocks, num_loaded))
        return worker, CostTerms(load_s, eviction_s, prefill_s)

    def _eviction_s_per_block(self, worker: WorkerId) -> float:
        """M_i per evicted block: expected recompute of the worker's coldest cached blocks.

        Each of the `max_sampled_victims` least recently routed blocks costs one block's prefill per
        reuse beyond its first use (blocks nobody shared cost nothing to lose). Cached per worker
        and refreshed after `eviction_refresh_mutations` index changes: an estimate, not a ledger.
        """
        index = self.state.index
        at, price_s = self._eviction_prices.get(worker, _NEVER_PRICED)
        if index.num_mutations - at < self.config.eviction_refresh_mutations:
            return price_s
        victims = index.coldest(worker, self.config.max_sampled_victims)
        num_sampled = sum(num_blocks for num_blocks, _ in victims)
        per_block_s = 0.0
        if num_sampled:
            block_s = self.state.prefill_model.marginal_s(self.state.block_size, 0)
            reuses = sum(num_blocks * max(0, num_routed - 1) for num_blocks, num_routed in victims)
            per_block_s = block_s * reuses / num_sampled
        self._eviction_prices[worker] = (index.num_mutations, per_block_s)
        return per_block_s

    def _allocation(
        self, request: RouteRequest, num_matched_blocks: int, workers: Sequence[WorkerId]
    ) -> tuple[list[WorkerId], str] | None:
        """The allocation of the deepest matched prefix that has one, restricted to live workers."""
        allocations = self._allocations
        if not allocations:
            return None
        path = request.block_hashes[:num_matched_blocks]
        for group in filter(allocations.__contains__, reversed(path)):  # deepest first, scanned in C
            if not self.state.load.group_is_active(group):
                del allocations[group]  # its work left the window: Preble forgets the allocation too
                continue
            allowed, reason = allocations[group]
            live = [w for w in workers if w in allowed]
            if live:
                return live, reason
        return None

    def sweep(self, now: float) -> None:
        """Forget allocations and TTFT histories of groups with no work left in the window."""
        self.ttft.prune_all(now)
        active = self.state.load.group_is_active
        for group in [g for g in self._allocations if not active(g)]:
            del self._allocations[group]

    # ---- feedback ------------------------------------------------------------------------------
    def on_first_token(self, request_id: str, ttft_s: float, now: float) -> None:
        assignment = self.state.load.assignment(request_id)
        if assignment is not None and assignment[1] is not None:
            self.ttft.add(assignment[1], assignment[0], now, ttft_s)

    def on_worker_removed(self, worker_id: WorkerId) -> None:
        super().on_worker_removed(worker_id)
        self.ttft.forget_worker(worker_id)
        self._eviction_prices.pop(worker_id, None)
        for group, (allowed, reason) in list(self._allocations.items()):
            if worker_id in allowed:
                rest = allowed - {worker_id}
                if rest:
                    self._allocations[group] = (rest, reason)
                else:
                    del self._allocations[group]

    # ---- rebalancing ---------------------------------------------------------------------------
    def rebalance(self, workers: Sequence[WorkerId], now: float) -> bool:
        """One rebalancing pass; True if it moved or replicated a group.

        As in Preble, the heaviest worker is paired with the lightest; then the heaviest drops out
        and the next heaviest is paired with whichever worker is lightest now, while the pair is
        still >= `rebalance_ratio` apart.
        """
        cost_inputs = self.state.load.cost_lookup()  # (window load, free): the same L as `window_load_s`
        loads = sorted((cost_inputs(w, _NO_RECORD)[0], w) for w in workers)
        changed = False
        while len(loads) >= 2:
            light_s, light = loads[0]
            heavy_s, heavy = loads[-1]
            if heavy_s <= 0.0 or heavy_s < self.config.rebalance_ratio * light_s:
                break
            light_s = self._unload(heavy, heavy_s, light, light_s, now)
            changed = changed or light_s != loads[0][0]
            loads = sorted([(light_s, light)] + loads[1:-1])
        return changed

    def _unload(self, heavy: WorkerId, heavy_s: float, light: WorkerId, light_s: float, now: float) -> float:
        """Move the cheapest groups heavy -> light while that narrows the gap, else split a rising hot group.

        Returns the light worker's window load afterwards.
        """
        load = self.state.load
        groups = sorted((work_s, group) for group, work_s in load.group_loads_s(heavy).items())
        moved = False
        for work_s, group in groups:  # cheapest first, as in Preble
            if heavy_s - work_s < light_s + work_s:
                break
            self._reallocate(group, heavy, light, replicate=False)
            load.move_group(group, heavy, light)
            heavy_s -= work_s
            light_s += work_s
            self.num_moved_groups += 1
            moved = True
        if not moved and groups:
            _, group = groups[-1]  # too big to move whole: split it if it is overloading its worker
            if self.ttft.is_rising(group, heavy, now):
                self._reallocate(group, heavy, light, replicate=True)
                light_s += load.move_group(group, heavy, light, fraction=0.5)
                self.ttft.forget(group, heavy)
                self.num_replications += 1
        return light_s

    def _reallocate(self, group: int, src: WorkerId, dst: WorkerId, replicate: bool) -> None:
        allowed, _ = self._allocations.get(group, (frozenset({src}), ""))
        if replicate:
            self._allocations[group] = (allowed | {src, dst}, "replicated")
        else:
            self._allocations[group] = ((allowed - {src}) | {dst}, "rebalanced")

    def allocation_of(self, group: int) -> frozenset[WorkerId]:
        entry = self._allocations.get(group)
        return frozenset() if entry is None else entry[0]
