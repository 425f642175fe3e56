"""Prefill -> decode KV handoff: the pure protocol state machines and the transports that move the bytes.

Importing this package loads only the pure protocol (no numpy, torch or zmq); the transports live in
`transport_*` modules and are imported explicitly by the worker and the benchmark.
"""

from kvbaton.transfer.destination import AdoptedKV, HandoffDestination
from kvbaton.transfer.layout import KVLayout
from kvbaton.transfer.messages import (
    Abort,
    AbortCause,
    Ack,
    FirstToken,
    LayerChunk,
    Message,
    Outgoing,
    ReserveGranted,
    ReserveRefused,
    ReserveRequest,
    SourceDone,
    TransferId,
)
from kvbaton.transfer.source import HandoffSource
from kvbaton.transfer.states import (
    DestinationState,
    FailureAction,
    Outcome,
    ProtocolError,
    SourceState,
    action_for,
)

__all__ = [
    "Abort", "AbortCause", "Ack", "AdoptedKV", "DestinationState", "FailureAction", "FirstToken",
    "HandoffDestination", "HandoffSource", "KVLayout", "LayerChunk", "Message", "Outcome", "Outgoing",
    "ProtocolError", "ReserveGranted", "ReserveRefused", "ReserveRequest", "SourceDone", "SourceState",
    "TransferId", "action_for",
]
