"""A simulated worker's link to the cluster KV store: the store tier's `StoreIO`, which moves no bytes but prices them.

Loads (`kvbaton.cache.store_tier.StoreTier.load`, inside the scheduler's admission) are priced by the
shared `StorePrices` (host link per GPU, the NIC when the block is on another node, the disk when it is
on disk) and charged to the worker's next step, serial with its compute: conservative, where a live worker
overlaps loads with other requests' steps.
Saves (write-through) are counted, not charged: they are asynchronous and never delay a step.

The links a load shares with other workers' loads are `StoreLinks`: each node's NIC, one way out and one
way in (full duplex), and its disk. A load's paths (its blocks grouped by remote or local, DRAM or disk,
as `StorePrices.load_s` prices them) run one after another from the step's start, each as soon as every
shared link it crosses is free, and occupy those links until they end: first come, first served, in
simulated time. A load that meets no busy link costs exactly `StorePrices.load_s`; one that waits is
charged the wait too (`SimStoreIO.wait_s`). Saves and a node's own DRAM-to-disk moves occupy no link.

`router_prefill_model` fits the router's prefill-time model to the cost model, so a placement that weighs
a load against a prefill (the `conductor` policy) compares seconds of the same GPU, as a live router
calibrated by `kvbaton profile` would; `kv_read_s_per_token` gives it what a running batch adds to each step.
"""

from __future__ import annotations

from kvbaton.cache.kv_store import DISK, NodeId
from kvbaton.cache.store_prices import StorePrices
from kvbaton.router.prefill_model import PrefillSample, PrefillTimeModel
from kvbaton.sim.costs.base import CostModel, Parallelism


class StoreLinks:
    """The store's shared links in simulated time: each node's NIC (out and in) and disk, busy until when."""

    __slots__ = ("prices", "_busy_until", "num_waits", "wait_s")

    def __init__(self, prices: StorePrices) -> None:
        self.prices = prices
        self._busy_until: dict[tuple[str, NodeId], float] = {}  # ("out" | "in" | "disk", node) -> time
        self.num_waits = 0  # paths that found a link busy
        self.wait_s = 0.0  # and how long they waited, in all

    def transfer(self, start: float, num_blocks: int, sources: frozenset[NodeId], reader: NodeId, remote: bool,
                 on_disk: bool, num_gpus: int) -> tuple[float, float]:
        """One path of `num_blocks` from `sources` (remote: other nodes than `reader`) from `start` on: (its
        wait for busy links, its end). It occupies the sources' NICs out and the reader's in (remote), and the
        sources' disks (on disk), until it ends."""
        links: list[tuple[str, NodeId]] = []
        if remote:
            links.append(("in", reader))
            links.extend(("out", node_id) for node_id in sources)
        if on_disk:
            links.extend(("disk", node_id) for node_id in sources)
        busy_until = self._busy_until
        begin = start
        for link in links:
            until = busy_until.get(link)
            if until is not None and until > begin:
                begin = until
        end = begin + self.prices.path_s(num_blocks, remote, on_disk, num_gpus)
        for link in links:
            busy_until[link] = end
        wait_s = begin - start
        if wait_s > 0:
            self.num_waits += 1
            self.wait_s += wait_s
        return wait_s, end


class SimStoreIO:
    __slots__ = ("prices", "node_id", "num_gpus", "links", "_pending_s", "_pending_paths", "num_loaded_blocks",
                 "num_saved_blocks", "copy_s", "wait_s")

    def __init__(self, prices: StorePrices, node_id: NodeId, num_gpus: int = 1, links: StoreLinks | None = None
                 ) -> None:
        self.prices = prices
        self.node_id = node_id
        self.num_gpus = num_gpus
        self.links = links  # the links shared with other workers' loads; None: no contention
        self._pending_s = 0.0  # loads since the last `take_copy_s`, priced on idle links
        # and their paths, in order: (blocks, source nodes, remote, on disk)
        self._pending_paths: list[tuple[int, frozenset[NodeId], bool, bool]] = []
        self.num_loaded_blocks = 0
        self.num_saved_blocks = 0
        self.copy_s = 0.0  # seconds charged to steps, in all
        self.wait_s = 0.0  # of which waiting for links other workers' loads held

    def load(self, block_hashes: list[int], sources: list[tuple[NodeId, str]], device_block_ids: list[int]) -> None:
        self._pending_s += self.prices.load_s(sources, self.node_id, self.num_gpus)
        self.num_loaded_blocks += len(sources)
        if self.links is not None:
            self._pending_paths.extend(self._paths(sources))

    def _paths(self, sources: list[tuple[NodeId, str]]) -> list[tuple[int, frozenset[NodeId], bool, bool]]:
        """`StorePrices.load_s`'s paths of one load, in its order: (remote, on disk) as bits."""
        nodes: list[set[NodeId]] = [set(), set(), set(), set()]
        counts = [0, 0, 0, 0]
        reader = self.node_id
        for node_id, tier in sources:
            path = (node_id != reader) * 2 + (tier == DISK)
            counts[path] += 1
            nodes[path].add(node_id)
        return [(n, frozenset(nodes[i]), bool(i & 2), bool(i & 1)) for i, n in enumerate(counts) if n]

    def save(self, block_hashes: list[int], device_block_ids: list[int]) -> None:
        self.num_saved_blocks += len(block_hashes)

    def take_copy_s(self, now: float) -> float:
        """Seconds the loads made since the last call take from `now` on, waits for busy links included; they
        count as charged."""
        copy_s, self._pending_s = self._pending_s, 0.0
        paths = self._pending_paths
        if paths:
            self._pending_paths = []
            links = self.links
            assert links is not None
            wait_s = 0.0
            at = now
            for num_blocks, sources, remote, on_disk in paths:
                waited, at = links.transfer(at, num_blocks, sources, self.node_id, remote, on_disk, self.num_gpus)
                wait_s += waited
            if wait_s > 0:
                copy_s += wait_s
                self.wait_s += wait_s
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
