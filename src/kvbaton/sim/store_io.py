"""A simulated worker's link to the cluster KV store: the store tier's `StoreIO`, which moves no bytes but prices them.

Loads (`kvbaton.cache.store_tier.StoreTier.load`, inside the scheduler's admission) are priced by the
shared `StorePrices` (host link per GPU, the NIC when the block is on another node, the disk when it is
on disk) and charged to the worker's next step, serial with its compute, as the host tier's copies are
(`kvbaton.sim.host_link`): conservative, where a live worker overlaps loads with other requests' steps.
Saves (write-through) are counted, not charged: they are asynchronous and never delay a step.
`router_prefill_model` fits the router's prefill-time model to the cost model, so a placement that weighs
a load against a prefill (the `conductor` policy) compares seconds of the same GPU, as a live router
calibrated by `kvbaton profile` would; `kv_read_s_per_token` gives it what a running batch adds to each step.
"""

from __future__ import annotations

from kvbaton.cache.kv_store import NodeId
from kvbaton.cache.store_prices import StorePrices
from kvbaton.router.prefill_model import PrefillSample, PrefillTimeModel
from kvbaton.sim.costs.base import CostModel, Parallelism


class SimStoreIO:
    __slots__ = ("prices", "node_id", "num_gpus", "_pending_s", "num_loaded_blocks", "num_saved_blocks", "copy_s")

    def __init__(self, prices: StorePrices, node_id: NodeId, num_gpus: int = 1) -> None:
        self.prices = prices
        self.node_id = node_id
        self.num_gpus = num_gpus
        self._pending_s = 0.0  # loads since the last `take_copy_s`
        self.num_loaded_blocks = 0
        self.num_saved_blocks = 0
        self.copy_s = 0.0  # seconds charged to steps, in all

    def load(self, block_hashes: list[int], sources: list[tuple[NodeId, str]], device_block_ids: list[int]) -> None:
        self._pending_s += self.prices.load_s(sources, self.node_id, self.num_gpus)
        self.num_loaded_blocks += len(sources)

    def save(self, block_hashes: list[int], device_block_ids: list[int]) -> None:
        self.num_saved_blocks += len(block_hashes)

    def take_copy_s(self) -> float:
        """Seconds the loads made since the last call take; they count as charged."""
        copy_s, self._pending_s = self._pending_s, 0.0
        self.copy_s += copy_s
        return copy_s


def router_prefill_model(cost_model: CostModel, parallel: Parallelism, max_tokens: int) -> PrefillTimeModel:
    """The router's prefill model fitted to `cost_model`'s prefill on `parallel`, over prompts up to `max_tokens`."""
    sizes = sorted({max(1, max_tokens >> shift) for shift in range(0, 12, 2)})
    samples = [PrefillSample(new, cached, cost_model.prefill_s(new, cached, parallel))
               for new in sizes for cached in (0, *sizes) if new + cached <= max_tokens]
    return PrefillTimeModel.fit(samples)


def kv_read_s_per_token(cost_model: CostModel, parallel: Parallelism, context_tokens: int = 65536) -> float:
    """Seconds one decode step spends per KV token of its batch's context on `parallel` (the slope of
    `decode_s` in context tokens: KV bytes per token over the memory bandwidth, for the roofline)."""
    return max(0.0, (cost_model.decode_s(1, 2 * context_tokens, parallel) - cost_model.decode_s(1, context_tokens,
                                                                                                 parallel))
               / context_tokens)
