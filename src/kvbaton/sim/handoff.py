"""Simulated KV handoffs that run the real protocol legs (`kvbaton.transfer`) over simulated links.

Each prefill worker owns a `HandoffSource` over its BlockPool, each decode worker a
`HandoffDestination` over its own; the simulator plays the transport. In seed 001 order:
`start` sends the ReserveRequest (the decode worker reserves blocks or refuses: backpressure); on
the grant the cluster admits the prefill; after every executed prefill step the newly computed
positions are streamed as one LayerChunk (before the scheduler may free the blocks: the leg holds
references, as on the live prefill worker); the first token goes out in SourceDone; the decode
worker acks when everything has arrived, and the cluster adopts the blocks into the decode
scheduler. Messages from a prefill worker travel on its egress `Link` in FIFO order, so a chunk
waits behind earlier transfers (contention) and SourceDone never overtakes a chunk; replies take
the link latency. One protocol layer carries all model layers' bytes (`kv_bytes_per_token` from
the cost model): the simulator prices bytes, not per-layer overlap with compute.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from kvbaton.core.errors import InvalidRequestError
from kvbaton.core.request import Request
from kvbaton.core.step import StepPlan
from kvbaton.sim.costs.base import CostModel
from kvbaton.sim.links import Link, LinkSpec
from kvbaton.sim.worker import SimWorker
from kvbaton.transfer import (Ack, AdoptedKV, DestinationState, FirstToken, HandoffDestination, HandoffSource, KVLayout,
                              Message, Outgoing, ReserveGranted, ReserveRefused, SourceState, TransferId)


class Delivery(NamedTuple):
    """A protocol message arriving at `to_worker` from `from_worker`. A NamedTuple, not a frozen dataclass:
    the simulator builds one per protocol message (five or more per handed-off request), and a NamedTuple
    is built in C."""

    from_worker: str
    to_worker: str
    message: Message


class HandoffEvent(NamedTuple):
    """What the cluster must act on: granted (start the prefill), refused, complete (adopt `transfer_id`'s blocks,
    `SimHandoffs.adopt`), ended (failed)."""

    kind: str  # "granted" | "refused" | "complete" | "ended"
    request_id: str
    reason: str = ""
    transfer_id: TransferId | None = None


def layout_identity(cost_model: CostModel) -> tuple[str, int]:
    """What two workers' KV must agree on, besides the block size every simulated worker shares: the model and
    its KV bytes per token (layers x KV heads x head dim x dtype bytes). A GPU or a power cap changes neither."""
    return cost_model.model_name, cost_model.kv_bytes_per_token


def check_same_layout(cost_models: dict[str, CostModel]) -> None:
    """Refuses a cluster whose workers would hand off KV of different layouts (per worker id, its cost model)."""
    identities = {wid: layout_identity(cost) for wid, cost in cost_models.items()}
    first_id, first = next(iter(identities.items()))
    for wid, identity in identities.items():
        if identity != first:
            raise InvalidRequestError(f"workers {first_id} and {wid} do not share a KV layout (model, KV bytes per "
                                      f"token): {first} vs {identity}; KV cannot move between them")


def sim_layout(block_size: int) -> KVLayout:
    """The layout identity every simulated worker shares (one protocol layer: bytes come from the cost model)."""
    return KVLayout("sim-model", "float16", block_size, 1, 1, 1)


class SimHandoffs:
    def __init__(self, prefill: dict[str, SimWorker], decode: dict[str, SimWorker], link: LinkSpec,
                 kv_bytes_per_token: int, lease_s: float, push: Callable[[float, Delivery], None]) -> None:
        layout = sim_layout(next(iter(prefill.values())).block_size)
        self.layout = layout
        self.sources = {wid: HandoffSource(layout, w.pool, lease_s) for wid, w in prefill.items()}
        self.destinations = {wid: HandoffDestination(layout, w.pool, lease_s) for wid, w in decode.items()}
        self.links = {wid: Link(link) for wid in prefill}
        self.kv_bytes_per_token = kv_bytes_per_token
        self._push = push
        self._legs: dict[str, tuple[TransferId, str, str]] = {}  # request id -> (transfer id, prefill, decode)
        self._streamed: dict[str, int] = {}  # request id -> positions streamed so far
        self.bytes_of: dict[str, int] = {}  # request id -> KV bytes sent

    def start(self, request_id: str, attempt: int, prefill: str, decode: str, num_tokens: int, now: float) -> None:
        transfer_id = TransferId(request_id if attempt == 0 else f"{request_id}/retry{attempt}")
        self._legs[request_id] = (transfer_id, prefill, decode)
        self._streamed[request_id] = 0
        self._send(prefill, self.sources[prefill].start(transfer_id, decode, num_tokens, now), now, 0)

    def on_executed(self, worker: SimWorker, plan: StepPlan, now: float) -> None:
        """Stream what a prefill step computed, while the scheduler still holds the blocks."""
        source = self.sources[worker.worker_id]
        for chunk in plan.chunks:
            leg = self._legs.get(chunk.request_id)
            first = self._streamed.get(chunk.request_id, 0)
            if leg is None or chunk.end_pos <= first or source.state(leg[0]) is not SourceState.STREAMING:
                continue
            num = chunk.end_pos - first  # a prefix-cache hit is streamed with the first computed chunk
            blocks = self.layout.block_range(first, num)
            out = source.stream(leg[0], 0, first, num, chunk.block_ids[blocks.start:blocks.stop], now)
            num_bytes = num * self.kv_bytes_per_token
            self.bytes_of[chunk.request_id] = self.bytes_of.get(chunk.request_id, 0) + num_bytes
            self._streamed[chunk.request_id] = chunk.end_pos
            self._send(worker.worker_id, out, now, num_bytes)

    def on_preempted(self, request: Request) -> None:
        """A prefill worker preempted a request mid-handoff: its leg lets go of the blocks it streamed from, as live
        (`PrefillHandoffs._on_preempted`); the recompute streams only the positions not sent yet."""
        leg = self._legs.get(request.request_id)
        if leg is not None:
            self.sources[leg[1]].release_held(leg[0])

    def on_first_token(self, request_id: str, token_id: int, now: float) -> bool:
        """The prefill sampled its token: send SourceDone. False when the leg has already ended."""
        transfer_id, prefill, _ = self._legs[request_id]
        source = self.sources[prefill]
        if source.state(transfer_id) is not SourceState.STREAMING:
            return False
        self._send(prefill, source.finish(transfer_id, FirstToken(token_id, 0.0), now), now, 0)
        return True

    def cancel(self, request_id: str, now: float) -> None:
        leg = self._legs.pop(request_id, None)
        if leg is not None:
            for out in self.sources[leg[1]].cancel(leg[0], now):
                self._send(leg[1], out, now, 0)

    def deliver(self, delivery: Delivery, now: float) -> list[HandoffEvent]:
        """Apply an arriving message to the receiving leg; returns what the cluster must do."""
        from_worker, to_worker, message = delivery
        destination = self.destinations.get(to_worker)
        if destination is not None:
            replies = destination.on_message(from_worker, message, now)
            if not replies:
                return []
            reply_at = now + self.links[from_worker].spec.latency_s
            acked = False
            for out in replies:
                self._push(reply_at, Delivery(to_worker, out.peer, out.message))
                acked = acked or isinstance(out.message, Ack)
            # A destination-side failure reaches the cluster when its Abort reaches the source.
            if acked:
                return [HandoffEvent("complete", self._request_of(message.transfer_id),
                                     transfer_id=message.transfer_id)]
            return []
        request_id = self._request_of(message.transfer_id)
        source = self.sources[to_worker]
        for out in source.on_message(message, now):  # its answer to an abort lifts the destination's fence
            self._send(to_worker, out, now, 0)
        if self._legs.get(request_id, (None,))[0] != message.transfer_id:
            return []  # a late message of an earlier attempt
        state = source.state(message.transfer_id)
        if isinstance(message, ReserveGranted) and state is SourceState.STREAMING:
            return [HandoffEvent("granted", request_id)]
        if isinstance(message, ReserveRefused):
            return [HandoffEvent("refused", request_id, source.reason(message.transfer_id))]
        if state in (SourceState.FAILED, SourceState.EXPIRED, SourceState.CANCELLED):
            return [HandoffEvent("ended", request_id, source.reason(message.transfer_id))]
        return []

    def adopt(self, decode_worker: str, transfer_id: TransferId, now: float) -> AdoptedKV | None:
        """The decode worker takes a complete leg's blocks (their references become its scheduler's); None when
        the leg is no longer complete (its lease ran out first: the destination freed the blocks)."""
        destination = self.destinations[decode_worker]
        if destination.state_or_none(transfer_id) is not DestinationState.COMPLETE:
            return None
        return destination.adopt(transfer_id, now)

    def expire(self, now: float) -> list[HandoffEvent]:
        """Lease expiry on every leg; the requests whose legs ended this way."""
        events = []
        for wid, source in self.sources.items():
            for out in source.expire(now):
                events.append(HandoffEvent("ended", self._request_of(out.message.transfer_id), "lease expired"))
                self._send(wid, out, now, 0)
        for wid, destination in self.destinations.items():
            for out in destination.expire(now):
                self._push(now, Delivery(wid, out.peer, out.message))
        return events

    def forget(self, request_id: str) -> None:
        self._legs.pop(request_id, None)
        self._streamed.pop(request_id, None)

    def _send(self, from_worker: str, out: Outgoing, now: float, num_bytes: int) -> None:
        # Chunks and control messages share the prefill worker's egress link in FIFO order.
        self._push(self.links[from_worker].offer(num_bytes, now), Delivery(from_worker, out.peer, out.message))

    @staticmethod
    def _request_of(transfer_id: TransferId) -> str:
        return transfer_id.request_id.split("/retry")[0]

