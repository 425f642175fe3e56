"""The prefill worker's side of handoffs: reserve on the decode worker, prefill, stream the KV, finish on the ack.

Per request (seed 001 order): `submit` sends the ReserveRequest and nothing is computed yet
(backpressure: KV never has nowhere to land) -> the grant adds the request to the engine with
`max_tokens=1` -> after every executed step the positions computed since the last one are streamed,
every layer as its own `LayerChunk`, while the engine still holds the blocks -> the sampled first
token goes out in `SourceDone` -> the decode worker's ack ends the leg, releasing the leg's block
references; full blocks stay in this worker's prefix cache. Every other ending (refused, failed,
expired, cancelled) aborts the engine request and is reported, so the router can act on it.

With `reserve_ahead_tokens` set, `submit` does not reserve at once: the leg waits in a FIFO here
and asks for its blocks once the engine has at most that many prompt tokens to compute ahead of
it (about a step's budget, so the grant lands before the engine gets to it). The decode worker's
KV then holds the prompts about to be prefilled, not every prompt queued here: under overload a
long prefill queue cannot fill the decode worker with reservations that sit idle. A leg that has
not reserved within the lease fails like any other.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kvbaton.core.errors import KvbatonError
from kvbaton.core.request import Request
from kvbaton.core.sampling import SamplingParams
from kvbaton.core.step import SampledToken, StepPlan, TokenDelta
from kvbaton.engine.engine import Engine
from kvbaton.engine.handoff import TransferCounters, transfer_id_of
from kvbaton.engine.kv_staging import KVStaging
from kvbaton.transfer.base import KVTransport, TransportError
from kvbaton.transfer.driver import pump_source, send_all
from kvbaton.transfer.layout import KVLayout
from kvbaton.transfer.messages import FirstToken
from kvbaton.transfer.source import HandoffSource, num_due_to_reserve
from kvbaton.transfer.states import SourceState


@dataclass(frozen=True, slots=True)
class HandoffReport:
    """A prefill-side leg that ended without its KV reaching the decode worker."""

    request_id: str
    decode_worker: str
    outcome: str  # refused | failed | expired | cancelled
    reason: str


def prefill_leg_params(params: SamplingParams) -> SamplingParams:
    """The prefill worker's own sampling for a handoff: one token, whatever the caller asked; the decode worker
    applies max_tokens, stop strings, stop tokens and EOS from the second token on. A request with min_tokens
    keeps its stop tokens and EOS banned for that first token (min_tokens 1: nothing stops a one-token leg early)."""
    keeps_bans = params.min_tokens > 0
    return replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1), stop=(),
                   stop_token_ids=params.stop_token_ids if keeps_bans else (), n=1)


@dataclass(slots=True)
class _Outgoing:
    request_id: str
    decode_worker: str
    prompt_token_ids: list[int]
    params: SamplingParams  # the prefill's own: one token
    tenant: str
    slo_class: str
    started_at: float
    granted_at: float = -1.0
    first_chunk_at: float = -1.0
    num_streamed_tokens: int = 0  # positions [0, this) of every layer have been sent
    in_engine: bool = False
    reserving: bool = False  # the ReserveRequest went out (the source tracks the leg from then on)


class PrefillHandoffs:
    """Every outgoing handoff of one prefill worker (single-threaded: the worker loop calls everything)."""

    def __init__(self, engine: Engine, layout: KVLayout, transport: KVTransport,
                 connect: Callable[[str, str], None], lease_s: float, clock: Callable[[], float],
                 reserve_ahead_tokens: int | None = None) -> None:
        if reserve_ahead_tokens is not None and reserve_ahead_tokens < 0:
            raise KvbatonError(f"reserve_ahead_tokens must be >= 0, got {reserve_ahead_tokens}")
        self.engine = engine
        self.layout = layout
        self.transport = transport
        self._connect = connect  # (decode worker id, its kv address) -> opens the link once; raises TransportError
        self._clock = clock
        self.source = HandoffSource(layout, engine.pool, lease_s)
        self.counters = TransferCounters()
        self._legs: dict[str, _Outgoing] = {}
        self.lease_s = lease_s
        self.reserve_ahead_tokens = reserve_ahead_tokens  # None: reserve at submit
        self._unreserved: deque[_Outgoing] = deque()  # legs waiting for their turn to reserve, FIFO
        self._reports: list[HandoffReport] = []
        self._swallow: set[str] = set()  # aborted here: the engine's final ABORT output is not the client's
        # What the transports read: the storage itself on the CPU, a pinned host copy of a device's (kv_staging).
        self.staging = KVStaging(engine.storage.kv_cache)
        self._source_kv = self.staging.host_numpy
        engine.on_executed = self._on_executed
        engine.scheduler.on_preempted = self._on_preempted

    @property
    def num_live(self) -> int:
        return len(self._legs)

    def owns(self, request_id: str) -> bool:
        return request_id in self._legs

    def live_request_ids(self) -> list[str]:
        return sorted(self._legs)

    # -- requests in ----------------------------------------------------------------------------

    def submit(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, decode_worker: str,
               decode_address: str, tenant: str = "", slo_class: str = "default") -> None:
        """Start a handoff: ask `decode_worker` for blocks. Failures show up in `take_reports`."""
        now = self._clock()
        transfer_id = transfer_id_of(request_id)
        if request_id in self._legs or self.source.state_or_none(transfer_id) is not None:
            # The id of a leg still live, or ended and kept as a tombstone (as on the decode worker) so that its
            # late messages stay ignored: this handoff cannot have the id, and the decode worker runs the request.
            self._reports.append(HandoffReport(request_id, decode_worker, "refused",
                                               f"request id {request_id!r} was handed off from here within "
                                               f"{self.source.tombstone_s:g} s"))
            return
        try:
            leg = _Outgoing(request_id, decode_worker, list(prompt_token_ids), prefill_leg_params(params), tenant,
                            slo_class, now)
            self.engine.validate_prompt(leg.prompt_token_ids)
            self._connect(decode_worker, decode_address)
        except (KvbatonError, TransportError) as exc:
            self._reports.append(HandoffReport(request_id, decode_worker, "failed", str(exc)))
            return
        self._legs[request_id] = leg
        self.counters.num_started += 1
        if self.reserve_ahead_tokens is None:
            self._reserve(leg, now)
        else:
            self._unreserved.append(leg)
            self._reserve_in_turn(now)

    def abort(self, request_id: str, reason: str = "cancelled by the router") -> None:
        """Cancel in any state (queued for the grant, prefilling, awaiting the ack); idempotent."""
        leg = self._legs.get(request_id)
        if leg is None:
            return
        if leg.reserving:
            send_all(self.transport, self.source.cancel(transfer_id_of(request_id), self._clock(), reason))
        else:
            self._unreserved.remove(leg)
        self.counters.num_cancelled += 1  # `_end` forgets the leg: no later `_advance` counts its ending
        self._end(leg)

    # -- the loop -------------------------------------------------------------------------------

    def poll(self, timeout_s: float = 0.0) -> None:
        """Apply grants, refusals, acks and aborts; expire leases; start granted prefills."""
        pump_source(self.transport, self.source, self._clock(), timeout_s)
        for request_id in sorted(self._legs):
            self._advance(self._legs[request_id])
        if self._unreserved:
            self._reserve_in_turn(self._clock())

    def take_reports(self) -> list[HandoffReport]:
        reports, self._reports = self._reports, []
        return reports

    def on_outputs(self, outputs: list[TokenDelta]) -> list[TokenDelta]:
        """Consume the engine outputs of handoff requests (their first token goes to the decode worker);
        returns the others untouched."""
        passed: list[TokenDelta] = []
        for out in outputs:
            leg = self._legs.get(out.request_id)
            if out.request_id in self._swallow:
                if out.finished:
                    self._swallow.discard(out.request_id)
            elif leg is None:
                passed.append(out)
            elif out.new_token_ids:
                token = out.logprobs[0] if out.logprobs else SampledToken(out.new_token_ids[0])
                first = FirstToken(token.token_id, token.logprob, token.top_logprobs, out.num_cached_tokens)
                leg.in_engine = not out.finished
                transfer_id = transfer_id_of(leg.request_id)
                if self.source.state(transfer_id) is SourceState.STREAMING:
                    send_all(self.transport, self.source.finish(transfer_id, first, self._clock()))
                self._advance(leg)
            elif out.finished:
                leg.in_engine = False
                self._fail(leg, out.error or f"prefill ended: {out.finish_reason}")
        return passed

    def _on_executed(self, plan: StepPlan) -> None:
        """Stream what this step computed, before the scheduler may free the blocks (the leg refs them)."""
        now = self._clock()
        for chunk in plan.chunks:
            leg = self._legs.get(chunk.request_id)
            if leg is None or chunk.end_pos <= leg.num_streamed_tokens:
                continue
            transfer_id = transfer_id_of(leg.request_id)
            if self.source.state(transfer_id) is not SourceState.STREAMING:
                continue
            # A prefix-cache hit means the first chunk starts past 0: the hit positions are streamed too.
            first, num = leg.num_streamed_tokens, chunk.end_pos - leg.num_streamed_tokens
            blocks = self.layout.block_range(first, num)
            src_block_ids = chunk.block_ids[blocks.start:blocks.stop]
            messages = [self.source.stream(transfer_id, layer, first, num, src_block_ids, now).message
                        for layer in range(self.layout.num_layers)]
            self.staging.to_host(src_block_ids)
            try:
                self.transport.send_many(leg.decode_worker, messages, self._source_kv)
            except TransportError as exc:
                self._fail(leg, f"streaming to {leg.decode_worker} failed: {exc}")
                continue
            if leg.first_chunk_at < 0:
                leg.first_chunk_at = now
            leg.num_streamed_tokens = chunk.end_pos
            self.counters.num_bytes += self.layout.num_layers * self.layout.chunk_bytes(num)

    def _on_preempted(self, request: Request) -> None:
        """A prefilling handoff request was preempted: its leg lets go of the blocks it streamed from, which the
        recompute may need (alone in a full pool it could otherwise never fit again, its own leg holding half of it,
        until the lease ran out). What was streamed stays streamed: the recompute sends only the positions after."""
        if request.request_id in self._legs:
            self.source.release_held(transfer_id_of(request.request_id))

    # -- internals ------------------------------------------------------------------------------

    def _reserve(self, leg: _Outgoing, now: float) -> None:
        leg.reserving = True
        transfer_id = transfer_id_of(leg.request_id)
        if send_all(self.transport, self.source.start(transfer_id, leg.decode_worker, len(leg.prompt_token_ids), now)):
            self._fail(leg, f"cannot reach {leg.decode_worker}")

    def _reserve_in_turn(self, now: float) -> None:
        """Late reservation: the FIFO's head reserves while the engine has at most `reserve_ahead_tokens` prompt
        tokens to compute ahead of it (queued in the engine, or of legs asking for their blocks now); a leg that
        waited a whole lease fails."""
        assert self.reserve_ahead_tokens is not None
        while self._unreserved and now - self._unreserved[0].started_at > self.lease_s:
            leg = self._unreserved.popleft()
            self.counters.num_failed += 1
            self._reports.append(HandoffReport(leg.request_id, leg.decode_worker, "expired",
                                               f"no turn to reserve KV on {leg.decode_worker} within the "
                                               f"{self.lease_s:g} s lease"))
            self._end(leg)
        if not self._unreserved:
            return
        ahead_tokens = self.engine.scheduler.num_queued_prefill_tokens() + sum(
            len(leg.prompt_token_ids) for leg in self._legs.values()
            if leg.reserving and self.source.state(transfer_id_of(leg.request_id)) is SourceState.RESERVING)
        num_due = num_due_to_reserve(ahead_tokens, (len(leg.prompt_token_ids) for leg in self._unreserved),
                                     self.reserve_ahead_tokens)
        for _ in range(num_due):
            self._reserve(self._unreserved.popleft(), now)

    def _advance(self, leg: _Outgoing) -> None:
        if not leg.reserving:
            return  # waiting for its turn to reserve: nothing to advance
        transfer_id = transfer_id_of(leg.request_id)
        state = self.source.state(transfer_id)
        now = self._clock()
        if state is SourceState.STREAMING and leg.granted_at < 0:
            leg.granted_at = now
            try:
                self.engine.add_request(leg.prompt_token_ids, leg.params, request_id=leg.request_id,
                                        tenant=leg.tenant, slo_class=leg.slo_class)
            except KvbatonError as exc:
                self._fail(leg, str(exc))
                return
            leg.in_engine = True
        elif state is SourceState.DONE:
            self.counters.num_completed += 1
            self.counters.transfer_time_s += now - (leg.first_chunk_at if leg.first_chunk_at >= 0 else now)
            self.counters.queue_time_s += leg.granted_at - leg.started_at
            self._end(leg)
        elif state not in (SourceState.RESERVING, SourceState.STREAMING, SourceState.AWAITING_ACK):
            self._count_ending(state)
            self._reports.append(HandoffReport(leg.request_id, leg.decode_worker, state.value,
                                               self.source.reason(transfer_id)))
            self._end(leg)

    def _fail(self, leg: _Outgoing, reason: str) -> None:
        send_all(self.transport, self.source.fail(transfer_id_of(leg.request_id), self._clock(), reason))
        self._advance(leg)

    def _count_ending(self, state: SourceState) -> None:
        if state is SourceState.REFUSED:
            self.counters.num_refused += 1
        elif state is SourceState.CANCELLED:
            self.counters.num_cancelled += 1
        else:
            self.counters.num_failed += 1

    def _end(self, leg: _Outgoing) -> None:
        self._legs.pop(leg.request_id, None)
        if leg.in_engine:
            leg.in_engine = False
            self._swallow.add(leg.request_id)
            self.engine.abort_request(leg.request_id)

    def check_invariants(self) -> None:
        self.source.check_invariants()
        for request_id, leg in self._legs.items():
            if leg.reserving:
                assert self.source.outcome(transfer_id_of(request_id)) is None, f"{request_id}: ended leg still tracked"
            else:
                assert not leg.in_engine and leg in self._unreserved, f"{request_id}: unreserved leg not queued"
        assert all(self._legs.get(leg.request_id) is leg for leg in self._unreserved), "a queued leg has ended"

