"""States and allowed transitions of both handoff legs, the outcomes they report, and what the caller does next.

Source (prefill) leg:   RESERVING -> STREAMING -> AWAITING_ACK -> DONE
Destination (decode):   RESERVED -> RECEIVING -> COMPLETE -> ADOPTED
Every non-terminal state may also end in CANCELLED, FAILED or EXPIRED (and RESERVING in REFUSED).
Terminal legs hold no blocks and ignore every later message (idempotent cleanup).
"""

from __future__ import annotations

from enum import Enum

from kvbaton.core.errors import KvbatonError


class ProtocolError(KvbatonError):
    """The caller drove a leg out of order (e.g. streamed before the reservation was granted)."""


class SourceState(Enum):
    RESERVING = "reserving"  # ReserveRequest sent; the prefill must not start yet (backpressure)
    STREAMING = "streaming"  # granted: the prefill runs and streams layer chunks
    AWAITING_ACK = "awaiting_ack"  # SourceDone sent; source blocks stay held until the ack
    DONE = "done"
    REFUSED = "refused"
    CANCELLED = "cancelled"
    FAILED = "failed"
    EXPIRED = "expired"


class DestinationState(Enum):
    RESERVED = "reserved"  # blocks allocated, nothing received yet
    RECEIVING = "receiving"
    COMPLETE = "complete"  # every layer complete and the first token known; Ack sent
    ADOPTED = "adopted"  # the decode engine took the blocks (and their references) over
    CANCELLED = "cancelled"
    FAILED = "failed"
    EXPIRED = "expired"


_ENDINGS = ("CANCELLED", "FAILED", "EXPIRED")
SOURCE_TRANSITIONS: dict[SourceState, frozenset[SourceState]] = {
    SourceState.RESERVING: frozenset({SourceState.STREAMING, SourceState.REFUSED}),
    SourceState.STREAMING: frozenset({SourceState.AWAITING_ACK}),
    SourceState.AWAITING_ACK: frozenset({SourceState.DONE}),
}
for _state in SOURCE_TRANSITIONS:
    SOURCE_TRANSITIONS[_state] |= {SourceState[name] for name in _ENDINGS}
DESTINATION_TRANSITIONS: dict[DestinationState, frozenset[DestinationState]] = {
    DestinationState.RESERVED: frozenset({DestinationState.RECEIVING, DestinationState.COMPLETE}),
    DestinationState.RECEIVING: frozenset({DestinationState.COMPLETE}),
    DestinationState.COMPLETE: frozenset({DestinationState.ADOPTED}),
}
for _state in DESTINATION_TRANSITIONS:
    DESTINATION_TRANSITIONS[_state] |= {DestinationState[name] for name in _ENDINGS}
SOURCE_LIVE = frozenset(SOURCE_TRANSITIONS)
DESTINATION_LIVE = frozenset(DESTINATION_TRANSITIONS)


class Outcome(Enum):
    COMPLETED = "completed"
    REFUSED = "refused"
    CANCELLED = "cancelled"
    FAILED = "failed"
    EXPIRED = "expired"


def source_outcome(state: SourceState) -> Outcome | None:
    """The outcome of a finished source leg; None while it is live."""
    if state in SOURCE_LIVE:
        return None
    return Outcome.COMPLETED if state is SourceState.DONE else Outcome(state.value)


def destination_outcome(state: DestinationState) -> Outcome | None:
    """The outcome of a destination leg: COMPLETED as soon as the KV is complete (adopted or not)."""
    if state in (DestinationState.COMPLETE, DestinationState.ADOPTED):
        return Outcome.COMPLETED
    if state in DESTINATION_LIVE:
        return None
    return Outcome(state.value)


KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


class FailureAction(Enum):
    DECODE = "decode"  # the KV is on the decode worker: decode from the first token
    RECOMPUTE = "recompute"  # the decode worker prefills the prompt itself
    ERROR = "error"  # end the request with a clean error
    REQUEUE = "requeue"  # refused by backpressure: the router picks another pair or waits
    DROP = "drop"  # cancelled: nobody wants the result


def action_for(outcome: Outcome, kv_load_failure_policy: str) -> FailureAction:
    """What the request does after a handoff ended with `outcome`, under `kv_load_failure_policy`."""
    if kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
        raise ValueError(f"kv_load_failure_policy must be one of {KV_LOAD_FAILURE_POLICIES}")
    if outcome is Outcome.COMPLETED:
        return FailureAction.DECODE
    if outcome is Outcome.CANCELLED:
        return FailureAction.DROP
    if outcome is Outcome.REFUSED:
        return FailureAction.REQUEUE
    return FailureAction.RECOMPUTE if kv_load_failure_policy == "recompute" else FailureAction.ERROR
