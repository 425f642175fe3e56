"""Each simulated worker's step times with its parallelism bound: the `StageTimeModel`s admission and adaptive pools
price with (`stage_time_models`). What they price — each worker's prefill queue and decode load — is the placement's
own tally of routed calls (`kvbaton.router.call_tally`), as live."""

from __future__ import annotations

from collections.abc import Mapping

from kvbaton.sim.costs.base import CostModel, Parallelism
from kvbaton.sim.spec import ClusterSpec


class BoundCost:
    """A cost model with one worker's parallelism bound: the `StageTimeModel` admission prices with."""

    __slots__ = ("cost_model", "parallel")

    def __init__(self, cost_model: CostModel, parallel: Parallelism) -> None:
        self.cost_model = cost_model
        self.parallel = parallel

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        return self.cost_model.prefill_s(new_tokens, cached_tokens, self.parallel)

    def decode_s(self, num_seqs: int, context_tokens: int) -> float:
        return self.cost_model.decode_s(num_seqs, context_tokens, self.parallel)


def stage_time_models(spec: ClusterSpec, cost_model: CostModel,
                      own: Mapping[str, CostModel] | None = None) -> dict[str, BoundCost]:
    """Per worker id, the step-time model an admission policy for this cluster prices with: its own cost model
    (`own`, per worker id, where its pool's GPU differs) or `cost_model`."""
    own = own or {}
    return {w.worker_id: BoundCost(own.get(w.worker_id, cost_model), w.parallel) for w in spec.workers}
