"""KV over TCP for workers on different hosts: the chunk's bytes follow its frame and land via `recv_into`.

The sender gathers each contiguous source run straight from its KV storage into `sendmsg` (no
staging buffer); the receiver scatters the bytes straight into its destination blocks with
`recvmsg_into` (no staging buffer either), so the only copies are the kernel's, and a fragmented
block table costs few syscalls.
"""

from __future__ import annotations

import socket

import numpy as np

from kvbaton.transfer.base import plane_bytes
from kvbaton.transfer.block_runs import flat_runs
from kvbaton.transfer.messages import LayerChunk
from kvbaton.transfer.framing import recv_exact_into, recv_into_buffers
from kvbaton.transfer.transport_socket import SocketKVReceiver, SocketKVSender, _Link


class TcpKVSender(SocketKVSender):
    def _chunk_payload(self, link: _Link, chunk: LayerChunk, source_kv: np.ndarray) -> list[memoryview]:
        return _views(source_kv, chunk, chunk.src_block_ids)


class TcpKVReceiver(SocketKVReceiver):
    streams_payload = True

    def _receive_payload(self, sock: socket.socket, chunk: LayerChunk) -> bool:
        blocks = self.layout.block_range(chunk.first_position, chunk.num_valid_tokens)
        placeable = (not self.layout.mismatch(chunk.layout) and 0 <= chunk.layer_index < self.layout.num_layers
                     and chunk.first_position >= 0 and len(chunk.dst_block_ids) == len(blocks)
                     and chunk.num_valid_tokens > 0
                     and 0 <= min(chunk.dst_block_ids) and max(chunk.dst_block_ids) < self.kv.shape[2])
        if not placeable:
            # Keep the stream in step and let the protocol refuse the chunk; its bytes go nowhere.
            remaining = chunk.layout.chunk_bytes(max(chunk.num_valid_tokens, 0))
            scratch = memoryview(bytearray(min(remaining, 1 << 20)))
            while remaining > 0:
                view = scratch[:min(remaining, len(scratch))]
                if not recv_exact_into(sock, view):
                    return False
                remaining -= len(view)
            return True
        # Scattered straight into the destination blocks: no staging buffer.
        return recv_into_buffers(sock, _views(self.kv, chunk, chunk.dst_block_ids))


def _views(kv: np.ndarray, chunk: LayerChunk, block_ids: tuple[int, ...]) -> list[memoryview]:
    """The chunk's bytes in `kv` through `block_ids`, in wire order: K runs, then V runs."""
    token_bytes = chunk.layout.token_bytes
    runs = flat_runs(block_ids, chunk.first_position, chunk.num_valid_tokens, chunk.layout.block_size)
    views: list[memoryview] = []
    for kv_index in (0, 1):
        plane = plane_bytes(kv, chunk.layer_index, kv_index)
        views += [plane[start * token_bytes:(start + num) * token_bytes] for start, num in runs]
    return views
