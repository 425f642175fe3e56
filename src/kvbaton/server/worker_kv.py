"""A worker's KV links by role: the decode end (listening, storage in shared memory for shm) or the prefill end.

A decode worker creates its KV storage here, before its engine: with `shm` the storage is a
`/dev/shm` region that prefill workers map and write in place; with `tcp` it is ordinary memory
the receiver thread `recv_into`s. Its address ("shm://host:port" / "tcp://host:port") goes to the
router in `Register` and from there to prefill workers, which link lazily on their first handoff.
`close` removes everything (links, threads, the shared-memory file).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvbaton.core.cluster_secret import ClusterSecret
from kvbaton.engine.handoff import numpy_kv
from kvbaton.transfer.base import Delivery, KVTransport, PeerLost, TransportError
from kvbaton.transfer.faults import FaultRule, FaultyTransport
from kvbaton.transfer.layout import KVLayout
from kvbaton.transfer.messages import Message
from kvbaton.transfer.transport_shm import ShmKVReceiver, ShmKVRegion, ShmKVSender
from kvbaton.transfer.transport_socket import SocketKVSender
from kvbaton.transfer.transport_tcp import TcpKVReceiver, TcpKVSender

KV_TRANSPORTS = ("shm", "tcp")
_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_kv_address(address: str) -> tuple[str, tuple[str, int]]:
    """("shm" | "tcp", (host, port)) from "shm://127.0.0.1:5600"."""
    scheme, sep, rest = address.partition("://")
    host, colon, port = rest.rpartition(":")
    if not sep or scheme not in KV_TRANSPORTS or not colon or not port.isdigit():
        raise TransportError(f"bad KV address {address!r} (expected shm://host:port or tcp://host:port)")
    return scheme, (host.strip("[]"), int(port))


class DecodeKV:
    """The decode end: KV storage plus the receiver prefill workers link to."""

    def __init__(self, worker_id: str, layout: KVLayout, num_blocks: int, transport: str, host: str = "127.0.0.1",
                 port: int = 0, *, secret: ClusterSecret, pin_memory: bool = False, shared: bool = False) -> None:
        """`pin_memory`: the tcp receiver's buffer is page-locked (a CUDA engine copies landed KV from it).
        `shared`: keep the storage in a shared-memory region even for tcp (a parallel worker's rank processes
        map it: `kvbaton.engine.rank_group`)."""
        if transport not in KV_TRANSPORTS:
            raise ValueError(f"kv transport must be one of {KV_TRANSPORTS}, got {transport!r}")
        self.region: ShmKVRegion | None = None
        self.receiver: ShmKVReceiver | TcpKVReceiver
        if transport == "tcp" and shared:
            self.region = ShmKVRegion.create(layout, num_blocks)
            self.kv_cache = self.region.torch_view()
            try:
                self.receiver = TcpKVReceiver(worker_id, layout, numpy_kv(self.kv_cache), host, port, secret=secret)
            except BaseException:
                self.kv_cache = None  # type: ignore[assignment]
                self.region.close()
                raise
        elif transport == "shm":
            self.region = ShmKVRegion.create(layout, num_blocks)
            try:
                self.receiver = ShmKVReceiver(worker_id, self.region, host, port, secret=secret)
            except BaseException:
                self.region.close()
                raise
            self.kv_cache = self.region.torch_view()
        else:
            self.kv_cache = torch.zeros(layout.storage_shape(num_blocks), dtype=_TORCH_DTYPES[layout.dtype],
                                        pin_memory=pin_memory)
            self.receiver = TcpKVReceiver(worker_id, layout, numpy_kv(self.kv_cache), host, port, secret=secret)
        bound_host, bound_port = self.receiver.address
        self.address = f"{transport}://{bound_host}:{bound_port}"

    def close(self) -> None:
        self.receiver.close()
        if self.region is not None:
            self.kv_cache = None  # type: ignore[assignment] - drop our view so the mapping can go
            self.region.close()


class PrefillLinks(KVTransport):
    """The prefill end: one sender per transport kind, links opened on first use and forgotten when lost."""

    def __init__(self, worker_id: str, layout: KVLayout, faults: Sequence[FaultRule] = (),
                 clock: Callable[[], float] | None = None, *, secret: ClusterSecret) -> None:
        self.name = worker_id
        self._senders: dict[str, SocketKVSender] = {"shm": ShmKVSender(worker_id, layout, secret=secret),
                                                    "tcp": TcpKVSender(worker_id, layout, secret=secret)}
        self._faulty = {kind: FaultyTransport(sender, list(faults), clock) for kind, sender in self._senders.items()} \
            if faults and clock is not None else {}
        self._kind_of: dict[str, str] = {}  # linked peer -> transport kind

    def _end(self, peer: str) -> KVTransport:
        kind = self._kind_of.get(peer)
        if kind is None:
            raise TransportError(f"{self.name}: no link to {peer}")
        return self._faulty.get(kind) or self._senders[kind]

    def connect(self, peer: str, address: str) -> None:
        """Link to decode worker `peer` unless linked; raises TransportError (LayoutRejectedError on a mismatch)."""
        if peer in self._kind_of:
            return
        kind, host_port = parse_kv_address(address)
        linked = self._senders[kind].connect(host_port)
        if linked != peer:
            self._senders[kind].disconnect(linked)
            raise TransportError(f"{address} belongs to {linked}, not {peer}")
        self._kind_of[peer] = kind

    def send(self, peer: str, message: Message, source_kv: np.ndarray | None = None) -> None:
        self._end(peer).send(peer, message, source_kv)

    def send_many(self, peer: str, messages: list[Message], source_kv: np.ndarray | None = None) -> None:
        self._end(peer).send_many(peer, messages, source_kv)

    def poll(self, timeout_s: float) -> list[Delivery | PeerLost]:
        events: list[Delivery | PeerLost] = []
        for kind in KV_TRANSPORTS:
            end = self._faulty.get(kind) or self._senders[kind]
            events += end.poll(timeout_s if kind == "shm" else 0.0)
        for event in events:
            if isinstance(event, PeerLost):
                self._kind_of.pop(event.peer, None)
        return events

    def disconnect(self, peer: str) -> None:
        if peer in self._kind_of:
            self._end(peer).disconnect(peer)

    def close(self) -> None:
        for end in [*self._faulty.values(), *self._senders.values()]:
            end.close()
        self._kind_of.clear()
