"""Glue between a transport and a protocol leg: deliver what arrived, send what the leg answers.

The worker loop (and the benchmark and tests) call these each iteration with the current time; a
link that dies turns into `on_peer_lost`, and a reply that cannot be sent is dropped because the
same dead link is reported by the next poll.
"""

from __future__ import annotations

import numpy as np

from kvbaton.transfer.base import Delivery, KVTransport, PeerLost, TransportError
from kvbaton.transfer.destination import HandoffDestination
from kvbaton.transfer.messages import Outgoing
from kvbaton.transfer.source import HandoffSource


def send_all(transport: KVTransport, outgoing: list[Outgoing] | Outgoing,
             source_kv: np.ndarray | None = None) -> list[str]:
    """Send each message; returns the peers a send failed for (their legs learn it from PeerLost)."""
    failed: list[str] = []
    for item in outgoing if isinstance(outgoing, list) else [outgoing]:
        try:
            transport.send(item.peer, item.message, source_kv)
        except TransportError:
            failed.append(item.peer)
    return failed


def pump_destination(transport: KVTransport, destination: HandoffDestination, now: float,
                     timeout_s: float = 0.0) -> int:
    """One round on a decode worker: apply arrivals, send replies, expire leases; returns #events."""
    events = transport.poll(timeout_s)
    for event in events:
        if isinstance(event, PeerLost):
            destination.on_peer_lost(event.peer, now)
        else:
            assert isinstance(event, Delivery)
            send_all(transport, destination.on_message(event.peer, event.message, now))
    send_all(transport, destination.expire(now))
    return len(events)


def pump_source(transport: KVTransport, source: HandoffSource, now: float, timeout_s: float = 0.0) -> int:
    """One round on a prefill worker: apply replies (grants, acks, aborts), expire leases; returns #events."""
    events = transport.poll(timeout_s)
    for event in events:
        if isinstance(event, PeerLost):
            source.on_peer_lost(event.peer, now)
        else:
            assert isinstance(event, Delivery)
            send_all(transport, source.on_message(event.message, now))
    send_all(transport, source.expire(now))
    return len(events)
