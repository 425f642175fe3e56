"""Transfer-aware placement (Mooncake's conductor, FAST'25 Algorithm 1): the worker with the least predicted TTFT.

For each candidate worker, with the prompt's blocks matched in the router's prefix index (what the
worker's device holds) and in the store directory (`RouterState.store`, what the cluster KV store holds
after that, and on which node and tier):

    TTFT = queue + min(prefill of what the device misses,
                       load of the store's run from where it lives + prefill of what is left)

`queue` is the predicted prefill of the tokens already queued on the worker (its heartbeat plus what was
routed since), plus, on a mixed worker, what its running requests add to each step until the first token:
every step reads their KV (`RouterState.kv_read_s_per_token` x KV tokens in use, one step per
`step_tokens` of queued and new tokens), so sessions that stay on one worker make it slower to reach, and
new ones go elsewhere; the load is priced per block by its path (`StorePrices`: this node's DRAM over the host
link, another node's over the NIC, a disk at the disk's speed), and loading is chosen only when it beats
recomputing those blocks. A conversation's next turn thus lands where its last turn's KV is (no load at
all) unless that worker's queue costs more than fetching the KV elsewhere: no hot spot, since every worker
can reach every block. Without a store the policy prices the device match alone (cache-aware least TTFT).
The choice commits the blocks it will load as cached, so the load tracker books only the prefill left.
Ties within a relative 1e-9 go to a seeded random pick. Time is passed in; nothing is read from a clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvbaton.cache.kv_store import DISK
from kvbaton.router.base import RouteDecision, RouteRequest, CostTerms, WorkerId
from kvbaton.router.policies import BasePolicy, _require_workers
from kvbaton.router.state import RouterState


def with_store_load(state: RouterState, request: RouteRequest, worker: WorkerId, num_device_blocks: int,
                    prefill_s: float) -> tuple[float, float, int]:
    """(prefill_s, store_load_s, num_loaded_blocks) for `request` on `worker`, whose device holds its first
    `num_device_blocks` and would prefill the rest in `prefill_s`: the store's run after them is loaded (from
    where the directory says it is) only when that plus the prefill left beats `prefill_s`. Without a store, or
    when recomputing is cheaper: (prefill_s, 0.0, 0)."""
    store, prices = state.store, state.store_prices
    block_size = state.block_size
    num_prompt = request.num_prompt_tokens
    max_hit = max(0, (num_prompt - 1) // block_size)  # the last prompt token is always computed
    if store is None or prices is None or num_device_blocks >= max_hit:
        return prefill_s, 0.0, 0
    reader = state.store_reader(worker)
    sources = store.sources(request.block_hashes[num_device_blocks:max_hit], reader)
    if not sources:
        return prefill_s, 0.0, 0
    cached = (num_device_blocks + len(sources)) * block_size
    load_s = prices.load_s(sources, reader)
    rest_s = state.prefill_model.predict(num_prompt - cached, cached)
    if load_s + rest_s >= prefill_s:
        return prefill_s, 0.0, 0
    return rest_s, load_s, len(sources)


def store_tiers(state: RouterState, request: RouteRequest, worker: WorkerId, first_block: int,
                num_blocks: int) -> dict[str, int]:
    """CostTerms' tier counts of the `num_blocks` store blocks from `first_block` a load on `worker` reads: from its
    own node's DRAM, its disk, or another node."""
    if not num_blocks or state.store is None:
        return {}
    reader = state.store_reader(worker)
    sources = state.store.sources(request.block_hashes[first_block : first_block + num_blocks], reader)
    remote = sum(node != reader for node, _ in sources)
    disk = sum(node == reader and tier == DISK for node, tier in sources)
    return {"num_store_dram_blocks": len(sources) - remote - disk, "num_store_disk_blocks": disk,
            "num_store_remote_blocks": remote}


class ConductorPolicy(BasePolicy):
    name = "conductor"

    def choose(self, request: RouteRequest, workers: Sequence[WorkerId], now: float,
               matched: Mapping[WorkerId, int] | None = None) -> RouteDecision:
        _require_workers(workers)
        state = self.state
        state.load.prune(now)
        matched = self._matched(request, matched)
        predict = state.prefill_model.predict
        block_size = state.block_size
        num_prompt = request.num_prompt_tokens
        max_hit = max(0, (num_prompt - 1) // block_size)
        queued = state.load.queued_prefill_tokens
        kv_in_use = state.load.kv_tokens_in_use
        kv_read_s = state.kv_read_s_per_token
        step_tokens = max(1, state.step_tokens)
        low = high = float("inf")
        tied: list[tuple[WorkerId, int, float, float, float, int]] = []
        for worker in workers:
            num_device = min(matched.get(worker, 0), max_hit)
            num_queued = queued(worker)
            queue_s = predict(num_queued)
            prefill_s = predict(num_prompt - num_device * block_size, num_device * block_size)
            prefill_s, load_s, num_loaded = with_store_load(state, request, worker, num_device, prefill_s)
            if kv_read_s:  # the steps until its first token each read the running batch's KV
                num_new = num_prompt - (num_device + num_loaded) * block_size
                queue_s += kv_read_s * kv_in_use(worker) * (1 + (num_queued + num_new) // step_tokens)
            total = queue_s + load_s + prefill_s
            if total <= high:
                if total < low:
                    tolerance = 1e-9 * max(total, 1.0)
                    low, high, tied = total - tolerance, total + tolerance, []
                tied.append((worker, num_device + num_loaded, queue_s, load_s, prefill_s, num_loaded))
        chosen = self._break_tie([option[0] for option in tied])
        worker, num_blocks, queue_s, load_s, prefill_s, num_loaded = next(option for option in tied
                                                                          if option[0] == chosen)
        state.commit(request, worker, num_blocks, now, prefill_s=load_s + prefill_s)
        tiers = store_tiers(state, request, worker, num_blocks - num_loaded, num_loaded)
        return RouteDecision(worker, state.matched_tokens(request, num_blocks), self.name,
                             state.load.load_tokens(worker), CostTerms(queue_s, 0.0, prefill_s, load_s, **tiers))
