"""The `KVTransport` seam: one worker's end of its KV links, whatever carries the bytes (inproc, shm, tcp).

Contract shared by every transport:
- `send(peer, message, source_kv)` (and `send_many`): for a `LayerChunk`, the KV of the chunk's positions is read from
  `source_kv` (this worker's storage, `[layers, 2, blocks, block_size, kv_heads, head_dim]`, C-contiguous)
  and lands in the peer's destination blocks BEFORE the peer can see the message, so a chunk the
  protocol has recorded is a chunk whose bytes are in place. Every byte is copied at most once.
- `poll(timeout_s)`: what arrived, in arrival order per peer; `PeerLost` once when a link dies.
- `disconnect(peer)` drops a link abruptly (both ends see `PeerLost`): the "kill the peer" fault.
- Sending to a dead or unknown peer raises `TransportError`.
Peers are cluster members: a socket link opens only after both ends proved they hold the cluster secret
(`kvbaton.transfer.link_auth`), so no other process reaches a block. Among members, the destination's
protocol rejects chunks whose handles do not match its reservation, but with shm the bytes were already
written by then.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from kvbaton.core.errors import KvbatonError
from kvbaton.transfer.block_runs import flat_runs, paired_runs
from kvbaton.transfer.layout import KVLayout
from kvbaton.transfer.messages import LayerChunk, Message


class TransportError(KvbatonError):
    """A link is down or refused, or a frame could not be sent."""


class LayoutRejectedError(TransportError):
    """The receiving worker refused the link because its KV layout differs."""


class LinkAuthError(TransportError):
    """One end of a link did not prove it holds the cluster secret (`kvbaton.transfer.link_auth`)."""


@dataclass(frozen=True, slots=True)
class Delivery:
    peer: str
    message: Message


@dataclass(frozen=True, slots=True)
class PeerLost:
    peer: str
    reason: str


class KVTransport(ABC):
    """One worker's end of its KV links (see the module docstring for the contract)."""

    name: str  # this worker's id, as peers know it
    # How long a peer whose link died may still write into this end's KV storage: one that writes through its
    # own mapping of it (shm) learns of the loss only at its next send, after that write.
    peer_lost_write_grace_s: float = 0.0

    @abstractmethod
    def send(self, peer: str, message: Message, source_kv: np.ndarray | None = None) -> None: ...

    def send_many(self, peer: str, messages: list[Message], source_kv: np.ndarray | None = None) -> None:
        """Send several messages to one peer, in order, as one write where the transport can.

        Used when a prefill step produced KV for every layer at once: the per-layer chunks still
        arrive (and complete) one by one, but the peer is woken once, not once per layer.
        """
        for message in messages:
            self.send(peer, message, source_kv)

    @abstractmethod
    def poll(self, timeout_s: float) -> list[Delivery | PeerLost]: ...

    @abstractmethod
    def disconnect(self, peer: str) -> None: ...

    @abstractmethod
    def close(self) -> None:
        """Drop every link and free what this end owns (sockets, threads, shared memory); idempotent."""


def storage_dtype(layout: KVLayout) -> np.dtype:
    """The numpy dtype of KV storage; bfloat16 is kept as its raw 16-bit pattern (numpy has no bf16)."""
    return np.dtype({"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[layout.dtype])


def plane_bytes(kv: np.ndarray, layer_index: int, kv_index: int) -> memoryview:
    """Flat byte memoryview of one layer's K (0) or V (1); token slot i is bytes [i, i+1) * token_bytes."""
    return memoryview(kv[layer_index, kv_index].reshape(-1).view(np.uint8))


def check_storage(kv: np.ndarray, layout: KVLayout) -> None:
    if kv.ndim != 6 or kv.shape[:2] != (layout.num_layers, 2) or kv.shape[3:] != layout.storage_shape(1)[3:]:
        raise ValueError(f"KV storage shape {kv.shape} does not match layout {layout.layout_id}")
    if kv.itemsize != layout.dtype_num_bytes or not kv.flags.c_contiguous:
        raise ValueError("KV storage must be C-contiguous with the layout's element size")


def copy_chunk(chunk: LayerChunk, source_kv: np.ndarray, dst_kv: np.ndarray) -> None:
    """Copy the chunk's KV from the source storage into the destination storage: one copy per piece."""
    copy_chunks([chunk], source_kv, dst_kv)


def copy_chunks(chunks: list[LayerChunk], source_kv: np.ndarray, dst_kv: np.ndarray) -> None:
    """Copy several chunks' KV, merging pieces that are adjacent on both sides into one memcpy.

    A prefill step's chunks for consecutive layers of contiguous block tables are adjacent in both
    storages (`[layers, 2, blocks, ...]`), so they move as a few large copies — as fast as one
    memcpy of the same bytes — instead of one ~1 MB copy per layer and K/V plane.
    """
    src_bytes = memoryview(source_kv.reshape(-1).view(np.uint8))
    dst_bytes = memoryview(dst_kv.reshape(-1).view(np.uint8))
    src_plane_bytes, dst_plane_bytes = source_kv[0, 0].nbytes, dst_kv[0, 0].nbytes
    # The pending span [src_at, src_at + num_bytes) -> [dst_at, ...) grows while pieces stay adjacent.
    src_at = dst_at = num_bytes = 0
    for chunk in chunks:
        block_size = chunk.layout.block_size
        src_runs = flat_runs(chunk.src_block_ids, chunk.first_position, chunk.num_valid_tokens, block_size)
        dst_runs = flat_runs(chunk.dst_block_ids, chunk.first_position, chunk.num_valid_tokens, block_size)
        pieces = paired_runs(src_runs, dst_runs)
        token_bytes = chunk.layout.token_bytes
        for kv_index in (0, 1):
            plane_index = chunk.layer_index * 2 + kv_index
            src_base, dst_base = plane_index * src_plane_bytes, plane_index * dst_plane_bytes
            for src_start, dst_start, num in pieces:
                piece_src_at, piece_dst_at = src_base + src_start * token_bytes, dst_base + dst_start * token_bytes
                if num_bytes and src_at + num_bytes == piece_src_at and dst_at + num_bytes == piece_dst_at:
                    num_bytes += num * token_bytes
                    continue
                if num_bytes:
                    # Flat byte memoryviews: a slice assignment is one memcpy with ~0.2 us overhead, which
                    # keeps fragmented block tables (one piece per block) close to contiguous bandwidth.
                    dst_bytes[dst_at:dst_at + num_bytes] = src_bytes[src_at:src_at + num_bytes]
                src_at, dst_at, num_bytes = piece_src_at, piece_dst_at, num * token_bytes
    if num_bytes:
        dst_bytes[dst_at:dst_at + num_bytes] = src_bytes[src_at:src_at + num_bytes]
