"""The decode worker's side of handoffs: reserve or refuse, adopt completed KV into the engine, or fall back.

The router tells this worker what to expect (`expect`: prompt, sampling, prefill worker, failure
policy) and the prefill worker drives the transfer over the transport; the two arrive in either
order. Once the destination leg is COMPLETE (every layer and the first token in place) the engine
adopts the reserved blocks as they are — no second copy — and decodes from the first token. A leg
that fails, expires or is cut (or never starts within a lease) ends the request by
`kv_load_failure_policy`: `recompute` prefills the prompt here, `fail` ends it with a clean error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvbaton.core.errors import KvbatonError
from kvbaton.core.request import FinishReason
from kvbaton.core.sampling import SamplingParams
from kvbaton.core.step import SampledToken, TokenDelta
from kvbaton.engine.engine import Engine
from kvbaton.engine.handoff import TransferCounters, transfer_id_of
from kvbaton.engine.kv_staging import KVStaging
from kvbaton.transfer.base import KVTransport
from kvbaton.transfer.destination import HandoffDestination
from kvbaton.transfer.driver import pump_destination, send_all
from kvbaton.transfer.layout import KVLayout
from kvbaton.transfer.states import KV_LOAD_FAILURE_POLICIES, DestinationState


@dataclass(slots=True)
class _Expected:
    request_id: str
    prefill_worker: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tenant: str
    slo_class: str
    kv_load_failure_policy: str
    expected_at: float


class DecodeHandoffs:
    """Every incoming handoff of one decode worker (single-threaded: the worker loop calls everything)."""

    def __init__(self, engine: Engine, layout: KVLayout, transport: KVTransport, lease_s: float,
                 clock: Callable[[], float], staging: KVStaging | None = None) -> None:
        """`staging`: where the transport lands KV when that is not the engine's storage (a device's: the landing
        buffer is host memory, copied to the device as each leg is adopted)."""
        self.engine = engine
        self.staging = staging
        self.transport = transport
        self.lease_s = lease_s
        self._clock = clock
        # A reservation may evict what this worker's prefix cache holds unused, as any allocation here may, when
        # that makes room: one that cannot fit even so (more than the pool) is refused without flushing the cache.
        cache = engine.prefix_cache
        self.destination = HandoffDestination(layout, engine.pool, lease_s,
                                              make_room=cache.make_room if cache is not None else None,
                                              peer_lost_fence_s=transport.peer_lost_write_grace_s)
        self.counters = TransferCounters()
        self._expected: dict[str, _Expected] = {}
        self._cancelled_at: dict[str, float] = {}  # cancelled before their reservation arrived
        self._peer_cancelled_at: dict[str, float] = {}  # legs the prefill worker cancelled: awaiting the router

    @property
    def num_live(self) -> int:
        return len(self._expected)

    def owns(self, request_id: str) -> bool:
        return request_id in self._expected

    def expect(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, prefill_worker: str,
               kv_load_failure_policy: str = "recompute", tenant: str = "", slo_class: str = "default") -> None:
        if kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise KvbatonError(f"kv_load_failure_policy must be one of {KV_LOAD_FAILURE_POLICIES}")
        self._expected[request_id] = _Expected(request_id, prefill_worker, list(prompt_token_ids), params, tenant,
                                               slo_class, kv_load_failure_policy, self._clock())

    def abort(self, request_id: str) -> TokenDelta | None:
        """Cancel a handoff not yet adopted (releasing its reservation); its final output, or None if unknown."""
        entry = self._expected.pop(request_id, None)
        self._peer_cancelled_at.pop(request_id, None)
        if entry is None:
            return None
        now = self._clock()
        send_all(self.transport, self.destination.cancel(transfer_id_of(request_id), now, "cancelled by the router"))
        self._cancelled_at[request_id] = now
        self.counters.num_cancelled += 1
        return _final(entry, self.engine.worker_id, FinishReason.ABORT, "")

    def on_prefill_failed(self, request_id: str, reason: str, refused: bool) -> list[TokenDelta]:
        """The router relays that the prefill leg ended without the KV (refused: backpressure, so recompute)."""
        entry = self._expected.get(request_id)
        if entry is None or self._state(request_id) is DestinationState.COMPLETE:
            return []  # already resolved, or the KV is here anyway
        send_all(self.transport, self.destination.fail(transfer_id_of(request_id), self._clock(), reason))
        return self._fall_back(entry, f"prefill worker {entry.prefill_worker}: {reason}", force_recompute=refused)

    def pump(self, timeout_s: float = 0.0) -> None:
        """Apply transfer messages and expire leases: grant or refuse reservations, take KV as it arrives, ack
        complete legs. It touches the handoff legs, the transport and the engine's BlockPool (reserved blocks are
        allocated or freed), never the scheduler, so the worker also calls it between two layers of a step: a
        prefill worker's reservation is granted within a layer's time instead of after the step in flight.
        Adopting what completed waits for `poll`, between steps."""
        pump_destination(self.transport, self.destination, self._clock(), timeout_s)
        self.counters.num_started = self.destination.num_grants
        self.counters.num_refused = self.destination.num_refusals

    def poll(self, timeout_s: float = 0.0) -> list[TokenDelta]:
        """`pump`, then settle cancelled legs and adopt completed transfers; returns outputs to stream."""
        self.pump(timeout_s)
        now = self._clock()
        for request_id, at in sorted(self._cancelled_at.items()):
            if self._state(request_id) is not None:  # a reservation that arrived after the cancel
                send_all(self.transport, self.destination.cancel(transfer_id_of(request_id), now))
            if now - at > self.lease_s:
                del self._cancelled_at[request_id]
        outputs: list[TokenDelta] = []
        for request_id in sorted(self._expected):
            outputs += self._advance(self._expected[request_id], now)
        return outputs

    # -- internals ------------------------------------------------------------------------------

    def _state(self, request_id: str) -> DestinationState | None:
        """The live state of the request's leg; None when there is none (or it ended and was forgotten)."""
        return self.destination.state_or_none(transfer_id_of(request_id))  # type: ignore[return-value]

    def _advance(self, entry: _Expected, now: float) -> list[TokenDelta]:
        state = self._state(entry.request_id)
        if state is None:
            if now - entry.expected_at > self.lease_s:
                return self._fall_back(entry, f"no transfer from {entry.prefill_worker} within the lease")
            return []
        if state is DestinationState.COMPLETE:
            if self.engine.scheduler.num_running >= self.engine.config.scheduler.max_num_seqs:
                return []  # the lease bounds this wait
            return self._adopt(entry, now)
        if state is DestinationState.CANCELLED:
            # Only the prefill worker cancels a leg this worker still expects (our own cancels forget the request).
            # It does so when the router aborted the call, whose Abort to us is on its way, or when it stops, which
            # the router relays as HandoffFailed (`on_prefill_failed`): wait for whichever comes, up to a lease,
            # rather than recompute a prompt nobody may want.
            cancelled_at = self._peer_cancelled_at.setdefault(entry.request_id, now)
            if now - cancelled_at <= self.lease_s:
                return []
        if state in (DestinationState.FAILED, DestinationState.EXPIRED, DestinationState.CANCELLED):
            self.counters.num_failed += 1
            return self._fall_back(entry, self.destination.reason(transfer_id_of(entry.request_id)))
        return []  # RESERVED / RECEIVING

    def _adopt(self, entry: _Expected, now: float) -> list[TokenDelta]:
        adopted = self.destination.adopt(transfer_id_of(entry.request_id), now)
        first = adopted.first_token
        if self.staging is not None:
            self.staging.to_device(adopted.block_ids)
        try:
            output = self.engine.adopt_request(entry.prompt_token_ids, entry.params, entry.request_id,
                                               SampledToken(first.token_id, first.logprob, first.top_logprobs),
                                               adopted.block_ids, entry.tenant, entry.slo_class,
                                               num_cached_tokens=first.num_cached_tokens)
        except KvbatonError as exc:
            output, error = None, str(exc)
        else:
            error = "the engine could not admit the handoff"
        if output is None:
            self.engine.pool.release(list(adopted.block_ids))  # the references are ours until adopted
            return self._fall_back(entry, error)
        del self._expected[entry.request_id]
        self.counters.num_completed += 1
        return [output]

    def _fall_back(self, entry: _Expected, reason: str, force_recompute: bool = False) -> list[TokenDelta]:
        del self._expected[entry.request_id]
        self._peer_cancelled_at.pop(entry.request_id, None)
        if entry.kv_load_failure_policy == "fail" and not force_recompute:
            return [_final(entry, self.engine.worker_id, FinishReason.ERROR, f"KV transfer failed: {reason}")]
        try:
            self.engine.add_request(entry.prompt_token_ids, entry.params, request_id=entry.request_id,
                                    tenant=entry.tenant, slo_class=entry.slo_class)
        except KvbatonError as exc:
            return [_final(entry, self.engine.worker_id, FinishReason.ERROR, str(exc))]
        self.counters.num_recomputed += 1
        return []

    def check_invariants(self) -> None:
        self.destination.check_invariants()


def _final(entry: _Expected, worker_id: str, reason: FinishReason, error: str) -> TokenDelta:
    return TokenDelta(entry.request_id, (), "", True, reason.value, len(entry.prompt_token_ids), error=error,
                      worker_id=worker_id)
