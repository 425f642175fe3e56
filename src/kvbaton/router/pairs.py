"""The decode half of a prefill/decode placement: which decode worker takes a handoff, and whether a prompt is worth
handing off at all (conditional disaggregation).

Pure policy (no clock, no I/O; ties break by worker id), reading the router's shared `RouterState`:
- prefill worker p: minimise predicted queue + prefill of the prompt tokens p does not have cached
  (prefix-aware through the global index): `prefill_model(queued tokens) + prefill_model(unmatched)`;
- decode worker d: minimise predicted decode admission + transfer time: admission is the decode
  batch d already runs (each running request slows a step, and so does each handoff sent to d since
  its last heartbeat) plus a penalty when d's free blocks cannot take the prompt now (the reservation
  would be refused); transfer is prompt KV bytes over the link's bandwidth (shm or tcp, from d's KV
  address);
- conditional disaggregation: when the prompt tokens d does not have cached are fewer than
  `local_prefill_threshold_tokens`, the handoff costs more than it saves — d prefills them itself.
The placement (`kvbaton.router.placement`) asks in that order and commits what it decides.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvbaton.core.errors import CapacityError
from kvbaton.router.base import RouteRequest, WorkerId
from kvbaton.router.state import RouterState

# Measured (benchmarks/interference.py --sweep-threshold, SmolLM2 on CPU, one thread per worker): a lone prompt's
# TTFT with the handoff was 0.12-0.32 s against 0.10-0.16 s prefilled on the decode worker up to 128 tokens, and
# 0.36-0.64 s vs 0.45-0.48 s at 256-512 (noisy, 2 shared cores). Locally, 64 tokens cost about one decode step
# (ITL p50 0.04-0.07 s in the interference run): below that the handoff's fixed cost buys nothing; above it the
# stall every running decode on the worker pays grows with the prompt.
DEFAULT_LOCAL_PREFILL_THRESHOLD_TOKENS = 64
LINK_BYTES_PER_S = {"shm": 4e9, "tcp": 1e9}  # order of magnitude; the ratio matters when pools mix links
BLOCKS_SHORT_PENALTY_S = 1.0  # a decode worker without room would refuse: strongly prefer one with room


@dataclass(frozen=True, slots=True)
class PairChoiceConfig:
    local_prefill_threshold_tokens: int = DEFAULT_LOCAL_PREFILL_THRESHOLD_TOKENS
    kv_bytes_per_token: int = 0  # all layers, K and V; 0 prices transfers at nothing


class PairChooser:
    def __init__(self, state: RouterState, config: PairChoiceConfig) -> None:
        self.state = state
        self.config = config

    def choose_decode(self, request: RouteRequest, decode_workers: Mapping[WorkerId, str]) -> WorkerId:
        """The decode worker with the least predicted admission + transfer time; `decode_workers` maps each to its
        link kind ("shm" | "tcp"). Commits nothing (see `on_handed_off`)."""
        if not decode_workers:
            raise CapacityError("no decode worker is serving")
        costs = {d: self.decode_s(request, d, kind) for d, kind in decode_workers.items()}
        return min(sorted(costs), key=costs.__getitem__)

    def choose_prefill(self, request: RouteRequest, prefill_workers: Sequence[WorkerId],
                       matched: Mapping[WorkerId, int]) -> tuple[WorkerId, float]:
        """The prefill worker with the least predicted queue + prefill, and that prediction. Commits nothing."""
        if not prefill_workers:
            raise CapacityError("no prefill worker is serving")
        costs = {p: self.prefill_s(request, p, matched) for p in prefill_workers}
        worker = min(sorted(costs), key=costs.__getitem__)
        return worker, costs[worker]

    def prefill_s(self, request: RouteRequest, worker: WorkerId, matched: Mapping[WorkerId, int]) -> float:
        model = self.state.prefill_model
        cached = self.state.matched_tokens(request, matched.get(worker, 0))
        queue_s = model.marginal_s(self.state.load.queued_prefill_tokens(worker))  # not the KV it holds for handoffs
        return queue_s + model.predict(request.num_prompt_tokens - cached, cached)

    def worth_handing_off(self, request: RouteRequest, decode_worker: WorkerId,
                          matched: Mapping[WorkerId, int]) -> bool:
        """False when the prompt tokens `decode_worker` would still compute are too few to pay for a handoff."""
        cached = self.state.matched_tokens(request, matched.get(decode_worker, 0))
        return request.num_prompt_tokens - cached >= self.config.local_prefill_threshold_tokens

    def on_handed_off(self, request: RouteRequest, decode_worker: WorkerId, now: float) -> None:
        """Until d's next heartbeat, this handoff counts in its batch and blocks: a burst must not herd onto one d."""
        self.state.load.on_reserved(decode_worker, now, self._num_prompt_blocks(request))

    def _num_prompt_blocks(self, request: RouteRequest) -> int:
        """Blocks a decode worker reserves for the prompt's KV."""
        return -(-request.num_prompt_tokens // self.state.block_size)

    def decode_s(self, request: RouteRequest, worker: WorkerId, link_kind: str) -> float:
        load = self.state.load
        stats = load.stats(worker)
        # The batch as of the last heartbeat plus the requests sent there since (which it may not reflect yet).
        num_running = (stats.num_running if stats is not None else 0) + load.num_pending(worker)
        admission_s = num_running * self.state.decode_s_per_token
        free_blocks = load.free_blocks(worker)
        needed = self._num_prompt_blocks(request)
        if free_blocks is not None and free_blocks + (stats.num_cached_blocks if stats else 0) < needed:
            admission_s += BLOCKS_SHORT_PENALTY_S
        transfer_bytes = request.num_prompt_tokens * self.config.kv_bytes_per_token
        return admission_s + transfer_bytes / LINK_BYTES_PER_S.get(link_kind, LINK_BYTES_PER_S["tcp"])
