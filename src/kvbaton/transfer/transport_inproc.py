"""In-process transport for tests and single-process setups: two ends sharing queues and the destination storage."""

from __future__ import annotations

from collections import deque

import numpy as np

from kvbaton.transfer.base import Delivery, KVTransport, PeerLost, TransportError, copy_chunk
from kvbaton.transfer.messages import LayerChunk, Message


class InprocTransport(KVTransport):
    """One end of an in-process link; build a connected pair with `create_inproc_pair`."""

    def __init__(self, name: str, kv: np.ndarray | None) -> None:
        self.name = name
        self.kv = kv  # this end's KV storage; chunks sent TO this end land in it
        self._peers: dict[str, InprocTransport] = {}
        self._inbox: deque[Delivery | PeerLost] = deque()
        self.num_bytes_sent = 0

    def send(self, peer: str, message: Message, source_kv: np.ndarray | None = None) -> None:
        other = self._peers.get(peer)
        if other is None:
            raise TransportError(f"{self.name}: no link to {peer}")
        if isinstance(message, LayerChunk):
            if source_kv is None or other.kv is None:
                raise TransportError("a layer chunk needs source KV on the sender and storage on the receiver")
            copy_chunk(message, source_kv, other.kv)
            self.num_bytes_sent += message.layout.chunk_bytes(message.num_valid_tokens)
        other._inbox.append(Delivery(self.name, message))

    def poll(self, timeout_s: float) -> list[Delivery | PeerLost]:
        items = list(self._inbox)
        self._inbox.clear()
        return items

    def disconnect(self, peer: str) -> None:
        other = self._peers.pop(peer, None)
        if other is None:
            return
        other._peers.pop(self.name, None)
        other._inbox.append(PeerLost(self.name, "link dropped"))
        self._inbox.append(PeerLost(peer, "link dropped"))

    def close(self) -> None:
        for peer in sorted(self._peers):
            self.disconnect(peer)


def create_inproc_pair(source_name: str, destination_name: str,
                       destination_kv: np.ndarray) -> tuple[InprocTransport, InprocTransport]:
    """A linked (prefill end, decode end); chunks sent by the prefill end land in `destination_kv`."""
    source, destination = InprocTransport(source_name, None), InprocTransport(destination_name, destination_kv)
    source._peers[destination_name] = destination
    destination._peers[source_name] = source
    return source, destination
