"""What the simulated router knows of its workers' stages, as admission and adaptive pools read it.

The same views the live router builds from its heartbeats and routed calls (`server/cluster_admission.py`),
here from the simulator's own state: a prefill worker's queue prompt by prompt (`PrefillLoad`), a decode
worker's batch and the requests on their way to it with when their KV should arrive (`DecodeLoad`), and
each worker's step times with its parallelism bound (`stage_time_models`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvbaton.router.admission import DecodeLoad, DecodeSlot, PrefillLoad
from kvbaton.sim.costs.base import CostModel, Parallelism
from kvbaton.sim.flight import Flight
from kvbaton.sim.spec import ClusterSpec
from kvbaton.sim.worker import SimWorker


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


def stage_time_models(spec: ClusterSpec, cost_model: CostModel) -> dict[str, BoundCost]:
    """Per worker id, the step-time model an admission policy for this cluster prices with."""
    return {w.worker_id: BoundCost(cost_model, w.parallel) for w in spec.workers}


def prefill_load(worker: SimWorker, flights: Iterable[Flight]) -> PrefillLoad:
    """What the router knows of a worker's prefill queue: its uncomputed prompt tokens, prompt by prompt."""
    worker_id = worker.worker_id
    # Handoffs not yet granted (waiting for their turn to reserve, or for the grant) queue here too.
    queue = worker.scheduler.queued_prefills() + tuple(
        (f.workload.num_prompt_tokens, 0) for f in flights if f.front == worker_id and f.prefill_request is not None)
    return PrefillLoad(worker_id, sum(new_tokens for new_tokens, _ in queue), queue)


def decode_load(decode_id: str, flights: Iterable[Flight], workers: Mapping[str, SimWorker], cost_model: CostModel,
                reserves_on_arrival: bool, exclude: str = "") -> DecodeLoad:
    """What the router knows of a decode worker: the requests it streams and those it routed there, the latter
    with when their KV should arrive: their prefill worker drains, first come first served, the prompt tokens
    still to compute of everything routed to it before them, and theirs. `flights` in arrival order."""
    decoding: list[DecodeSlot] = []
    incoming: list[DecodeSlot] = []
    # Per prefill worker, the seconds of prefill up to and including this flight's: each prompt computed alone,
    # one after another (`admission.queue_drain_s`).
    queued_s: dict[str, float] = {}
    for flight in flights:
        wr = flight.workload
        if not flight.at_decode and not flight.whole:
            done_tokens = 0
            if flight.prefill_request is None:  # else waiting for its reservation: nothing computed yet
                request = workers[flight.front].scheduler.get_request(wr.request_id)
                done_tokens = wr.num_prompt_tokens if request is None else request.num_computed_tokens
            left_tokens = wr.num_prompt_tokens - done_tokens
            if left_tokens > 0:
                parallel = workers[flight.front].spec.parallel
                queued_s[flight.front] = (queued_s.get(flight.front, 0.0)
                                          + cost_model.prefill_s(left_tokens, done_tokens, parallel))
            else:
                queued_s.setdefault(flight.front, 0.0)
        if (flight.decode != decode_id and not (flight.whole and flight.front == decode_id)
                or wr.request_id == exclude):
            continue
        num_done = len(flight.token_times_s)
        if flight.at_decode:
            decoding.append(DecodeSlot(wr.num_prompt_tokens + num_done, wr.output_tokens - num_done))
        else:
            incoming.append(DecodeSlot(wr.num_prompt_tokens + num_done, wr.output_tokens - num_done,
                                       queued_s[flight.front], holds_kv=flight.reserving))
    worker = workers[decode_id]
    return DecodeLoad(decode_id, tuple(decoding), tuple(incoming), worker.pool.num_blocks * worker.block_size,
                      reserves_on_arrival=reserves_on_arrival)
