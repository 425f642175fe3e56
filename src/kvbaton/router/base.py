"""Contracts of the router's policy layer: what a request looks like to the router, what a decision is, and the policy seam.

Lifecycle (live router and simulator alike, time always passed in as `now`, seconds):

1. The caller hashes the prompt once (`RouteRequest.from_tokens`, chained block hashes under the
   worker's cache key namespaced by tenant) and calls `policy.choose(request, workers, now)` with
   the live, eligible worker ids.
2. `choose` commits its decision to the shared `RouterState`: the prefix index learns that the
   chosen worker will hold the prompt's blocks (optimistically, corrected later by KV events) and
   the load tracker records the predicted work. The caller must therefore call `choose` exactly
   once per request it actually sends, and `on_finished` when it ends (also when it is cancelled
   or rejected after the choice).
3. Workers report `WorkerStats` heartbeats (`state.load.on_stats`) and KV events
   (`state.index.on_kv_events`; on False the caller fetches a snapshot and calls
   `state.index.apply_snapshot`).
4. When a request's first token arrives the caller reports `on_first_token(request_id, ttft_s, now)`
   (Preble watches per-prefix TTFT to replicate hot prefixes).

Policies never read a clock or a global RNG; ties are broken with the seeded `random.Random`
they were built with, so a run is reproducible from its seed. Nothing here is thread-safe: the
router calls policy and state from one thread (its event loop); `now` must never go backwards.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvbaton.cache.hashing import CacheKey, hash_block_tokens

WorkerId = str


@dataclass(frozen=True, slots=True)
class RouteRequest:
    request_id: str
    block_hashes: tuple[int, ...]  # chained hashes of the prompt's full blocks, in prefix order
    num_prompt_tokens: int  # including a trailing partial block the hashes do not cover
    num_output_tokens: int = 16  # expected decode length (max_tokens), prices decode work

    @staticmethod
    def from_tokens(
        request_id: str,
        prompt_token_ids: Sequence[int],
        cache_key: CacheKey,
        block_size: int,
        num_output_tokens: int = 16,
        tenant: str = "",
    ) -> RouteRequest:
        """Hash the prompt the way the workers' prefix caches do (tenant is the cache salt)."""
        hashes = hash_block_tokens(cache_key.with_tenant(tenant), prompt_token_ids, block_size)
        return RouteRequest(request_id, tuple(hashes), len(prompt_token_ids), num_output_tokens)


@dataclass(frozen=True, slots=True)
class CostTerms:
    """Preble's C_i = L_i + M_i + P_i for the chosen worker, all in predicted seconds."""

    load_s: float  # L_i: prefill+decode work assigned to the worker within the sliding window
    eviction_s: float  # M_i: expected recompute cost of the cached blocks admitting this request evicts
    prefill_s: float  # P_i: prefill time of this request's tokens not cached on the worker
    store_load_s: float = 0.0  # loading blocks from the cluster KV store (the conductor policy), when it does
    # Where the blocks that load comes from: the reader's own node's DRAM, its disk, and another node (either tier).
    num_store_dram_blocks: int = 0
    num_store_disk_blocks: int = 0
    num_store_remote_blocks: int = 0

    @property
    def total_s(self) -> float:
        return self.load_s + self.eviction_s + self.prefill_s + self.store_load_s


@dataclass(frozen=True, slots=True)
class RouteDecision:
    worker_id: WorkerId
    num_matched_tokens: int  # prompt tokens the index believes are cached on worker_id
    reason: str  # round_robin | least_load | longest_prefix | exploit | explore | rebalanced | replicated
    load_tokens: int = 0  # worker_id's queued prefill + KV tokens in use, this request included
    costs: CostTerms | None = None  # set by cost-based policies (preble)


class PlacementPolicy(Protocol):
    """Chooses a worker for each request; owns no I/O and no clock."""

    name: str

    def choose(self, request: RouteRequest, workers: Sequence[WorkerId], now: float,
               matched: Mapping[WorkerId, int] | None = None) -> RouteDecision:
        """Pick one of `workers` (non-empty, live, eligible) and commit the choice to the router state.

        `matched`: the prompt's cached blocks per worker, as the prefix index matched them for this request (the
        placement matches once per request); None matches here. Raises CapacityError when `workers` is empty.
        Deterministic given the seed and the call sequence.
        """
        ...

    def on_first_token(self, request_id: str, ttft_s: float, now: float) -> None:
        """The request's first token arrived `ttft_s` after its arrival (unknown ids are ignored)."""
        ...

    def on_finished(self, request_id: str, now: float) -> None:
        """The request ended (finished, cancelled or rejected); idempotent."""
        ...

    def on_worker_removed(self, worker_id: WorkerId) -> None:
        """Forget a worker that left: its index entries, load history and prefix allocations."""
        ...
