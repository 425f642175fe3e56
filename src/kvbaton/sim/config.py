"""What a simulated cluster run is configured with (`SimConfig`, per-pool `WorkerHardware`, store node losses
`StoreNodeLoss`) and reports (`WorkerReport` per worker, `StoreReport` for the cluster KV store)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvbaton.cache.hashing import CacheKey
from kvbaton.cache.store_prices import StorePrices
from kvbaton.core.config import CacheConfig, SchedulerConfig
from kvbaton.core.errors import InvalidRequestError
from kvbaton.router.pairs import DEFAULT_LOCAL_PREFILL_THRESHOLD_TOKENS
from kvbaton.sim.costs.base import CostModel


@dataclass(frozen=True, slots=True)
class StoreNodeLoss:
    """The store node of worker `node_id`'s host lost at `at_s` of simulated time with everything it holds, as a
    killed live store node is (the worker keeps serving, recomputing what it would have loaded); back, empty, at
    `back_at_s` (None: never)."""

    node_id: str
    at_s: float
    back_at_s: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.at_s) and self.at_s >= 0):
            raise InvalidRequestError(f"a store node loss needs a finite time >= 0, got {self.at_s}")
        if self.back_at_s is not None and not (math.isfinite(self.back_at_s) and self.back_at_s > self.at_s):
            raise InvalidRequestError(f"store node {self.node_id} must come back after it is lost at {self.at_s} s, "
                                      f"not at {self.back_at_s}")

    @classmethod
    def parse(cls, text: str) -> StoreNodeLoss:
        """`NODE@SECONDS` or `NODE@SECONDS:BACK_SECONDS` (the CLI's form)."""
        node_id, at, rest = text.partition("@")
        lost, _, back = rest.partition(":")
        try:
            at_s, back_at_s = float(lost), float(back) if back else None
        except ValueError:
            raise InvalidRequestError(f"a store node loss is NODE@SECONDS[:BACK_SECONDS], got {text!r}") from None
        return cls(node_id.strip(), at_s, back_at_s)


@dataclass(frozen=True, slots=True)
class SimConfig:
    policy: str = "round_robin"  # placement policy over the front (mixed or prefill) pool
    # The live router's placement settings (kvbaton.router.placement.PlacementConfig): prompts with fewer uncached
    # tokens than this prefill on their decode worker; calls waiting for a first token beyond max_num_waiting are
    # refused (0: no limit, where the live router's default is 256).
    local_prefill_threshold_tokens: int = DEFAULT_LOCAL_PREFILL_THRESHOLD_TOKENS
    max_num_waiting: int = 0
    seed: int = 0  # seeds the policies' tie-breaking RNGs
    cache: CacheConfig = CacheConfig()  # per worker
    scheduler: SchedulerConfig | None = None  # None: defaults, queue policy paired with `policy`
    heartbeat_s: float = 0.05  # simulated seconds between a busy worker's stats/KV-event reports
    max_model_len: int = 8192  # prompt + output may not exceed this (longer requests fail)
    handoff_lease_s: float = 60.0  # a handoff leg with no progress for this long expires (both sides)
    handoff_retry_s: float = 0.02  # wait after a refused reservation before asking again
    max_handoff_attempts: int = 500  # refusals after which the request fails
    # None: a handoff reserves on the decode worker as it arrives. A number: it waits in its prefill worker's
    # FIFO and reserves once that worker has at most this many prompt tokens left to compute ahead of it, as a
    # live prefill worker started with --reserve-ahead-tokens does (`engine.handoff_prefill`).
    reserve_ahead_tokens: int | None = None
    cache_key: CacheKey = CacheKey("sim-model", "sim-layout")
    # When a handed-off request's first token reaches the client: "decode" — the decode worker streams it once it
    # adopts the KV, between its steps (kvbaton's live path); "prefill" — as the prefill worker samples it
    # (DistServe's metric, which the planner reproduces).
    first_token_at: str = "decode"
    # The cluster KV store (kvbaton.cache.kv_store): with prices, every mixed or prefill worker's host is a store
    # node of this many DRAM and disk blocks, written through and read for prefix hits past the device.
    store_prices: StorePrices | None = None
    store_dram_blocks: int = 0
    store_disk_blocks: int = 0
    # One store over all the nodes (Mooncake's), or with `store_private` one per worker holding its own node only:
    # islands, each worker keeping and reading back only what it wrote, nothing across the NIC.
    store_private: bool = False
    store_node_losses: tuple[StoreNodeLoss, ...] = ()  # store nodes lost mid-run (and back, empty)
    # Apply runs of quiet decode steps at once (kvbaton.sim.worker; the same figures): False steps them one by one.
    decode_runs: bool = True

    def __post_init__(self) -> None:
        if self.first_token_at not in ("decode", "prefill"):
            raise InvalidRequestError(f"first_token_at must be 'decode' or 'prefill', got {self.first_token_at!r}")
        if self.reserve_ahead_tokens is not None and self.reserve_ahead_tokens < 0:
            raise InvalidRequestError(f"reserve_ahead_tokens must be >= 0, got {self.reserve_ahead_tokens}")


@dataclass(frozen=True, slots=True)
class WorkerHardware:
    """A worker whose GPU (or power cap) is not the cluster's: the cost model that prices its steps and the KV
    blocks its memory holds (`SimConfig.cache.num_blocks` is the others')."""

    cost_model: CostModel
    num_blocks: int


@dataclass(frozen=True, slots=True)
class WorkerReport:
    worker_id: str
    role: str
    num_steps: int
    busy_s: float
    num_preemptions: int
    prefix_cache_hits_tokens: int
    prefix_cache_queries_tokens: int
    store_loaded_blocks: int = 0  # KV store -> device loads (prefix hits past the device), in blocks
    store_saved_blocks: int = 0  # device -> KV store writes (write-through of new blocks), in blocks
    num_draft_tokens: int = 0  # speculative decoding: drafts proposed
    num_accepted_tokens: int = 0  # and accepted


@dataclass(frozen=True, slots=True)
class StoreReport:
    """The cluster KV store over a run: blocks loaded (of which from another node), written through, and puts no
    node had room for; load paths that queued for a NIC or disk another load held, and the seconds they waited;
    store nodes lost."""

    loaded_blocks: int
    remote_loaded_blocks: int
    saved_blocks: int
    dropped_puts: int
    link_waits: int
    link_wait_s: float
    nodes_lost: int
