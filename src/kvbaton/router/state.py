"""What the router knows, shared by every placement policy: prefix index, load tracker, prefill-time model.

The server and the simulator own one `RouterState`, feed it heartbeats and KV events, and hand
it to `create_policy`; the policy reads it to decide and writes each decision back (`commit`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbaton.cache.store_directory import StoreDirectory
from kvbaton.cache.store_prices import StorePrices
from kvbaton.router.base import RouteRequest, WorkerId
from kvbaton.router.load import LoadTracker
from kvbaton.router.prefill_model import PrefillTimeModel
from kvbaton.router.prefix_index import GlobalPrefixIndex


@dataclass(slots=True)
class RouterState:
    block_size: int = 16  # tokens per KV block; must equal the workers' block size
    index: GlobalPrefixIndex = field(default_factory=GlobalPrefixIndex)
    load: LoadTracker = field(default_factory=LoadTracker)
    prefill_model: PrefillTimeModel = field(default_factory=PrefillTimeModel)
    decode_s_per_token: float = 0.02  # prices decode work in the load window (one token of one request)
    # The cluster KV store, when there is one: which node holds which block (fed by the store's events) and what
    # loading a block costs. A worker reads from the store node named by its own id (the simulator's: one node per
    # worker) unless `store_node_of` names the node of its host (live: one node per host, shared by its workers;
    # each worker says which at registration) or, for a worker that named none, `store_node` does.
    store: StoreDirectory | None = None
    store_prices: StorePrices | None = None
    store_node: str = ""
    store_node_of: dict[str, str] = field(default_factory=dict)

    def store_reader(self, worker: str) -> str:
        """The store node a load on `worker` reads from as its own (its host's): the others are across the NIC."""
        return self.store_node_of.get(worker) or self.store_node or worker
    # What a mixed worker's running requests add to each step a prefill takes (the conductor's TTFT): every step
    # reads their KV, this many seconds per KV token in use (KV bytes per token / memory bandwidth; 0: unpriced),
    # and a prefill takes one step per `step_tokens` (the workers' token budget) of what is queued and its own.
    kv_read_s_per_token: float = 0.0
    step_tokens: int = 2048

    def matched_tokens(self, request: RouteRequest, num_matched_blocks: int) -> int:
        return min(num_matched_blocks * self.block_size, request.num_prompt_tokens)

    def num_blocks_needed(self, request: RouteRequest, num_matched_blocks: int) -> int:
        """New KV blocks the request allocates on a worker where `num_matched_blocks` are cached."""
        total_tokens = request.num_prompt_tokens + request.num_output_tokens
        return max(0, -(-total_tokens // self.block_size) - num_matched_blocks)

    def predicted_work_s(self, request: RouteRequest, num_matched_blocks: int, prefill_s: float | None = None) -> float:
        """Prefill of the uncached tokens plus the decode work, in predicted seconds.

        `prefill_s`, when the caller already predicted the prefill for this match, must equal
        that prediction; it only saves predicting it again.
        """
        if prefill_s is None:
            cached = self.matched_tokens(request, num_matched_blocks)
            prefill_s = self.prefill_model.predict(request.num_prompt_tokens - cached, cached)
        return prefill_s + request.num_output_tokens * self.decode_s_per_token

    def commit(
        self,
        request: RouteRequest,
        worker: WorkerId,
        num_matched_blocks: int,
        now: float,
        group: int | None = None,
        prefill_s: float | None = None,
    ) -> None:
        """Record a routing decision in the index and the load tracker (which also expires old window work).

        `prefill_s`: the predicted prefill of this request on `worker` if the caller has it (see `predicted_work_s`).
        """
        self.index.on_routed(worker, request.block_hashes)
        self.load.prune(now)
        cached = self.matched_tokens(request, num_matched_blocks)
        self.load.on_assigned(
            worker,
            request.request_id,
            now,
            num_prefill_tokens=request.num_prompt_tokens - cached,
            num_blocks=self.num_blocks_needed(request, num_matched_blocks),
            work_s=self.predicted_work_s(request, num_matched_blocks, prefill_s),
            group=group,
        )

    def remove_worker(self, worker: WorkerId) -> None:
        self.index.remove_worker(worker)
        self.load.remove_worker(worker)
