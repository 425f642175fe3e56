"""KV over shared memory for workers on one host: the prefill worker writes the reserved blocks in place.

The decode worker's KV storage itself lives in a file under /dev/shm (`ShmKVRegion`), mapped by
the decode worker and, once per link, by each prefill worker that connects. Sending a chunk copies
the source runs straight into the destination blocks of that mapping — the only copy — and then
sends the small control frame over the socket link, so the destination sees a chunk only after
its bytes are written (the socket round trip orders the writes before the read).
"""

from __future__ import annotations

import mmap
import os
import secrets
from functools import lru_cache

import numpy as np

from kvbaton.core.cluster_secret import ClusterSecret
from kvbaton.transfer.base import TransportError, copy_chunks, storage_dtype
from kvbaton.transfer.layout import KVLayout
from kvbaton.transfer.messages import LayerChunk
from kvbaton.transfer.transport_socket import SocketKVReceiver, SocketKVSender, _Link

SHM_DIRECTORY = "/dev/shm"
SHM_PREFIX = "kvbaton-kv"

# Every layer chunk of a step carries the same destination table: scan it once, not once a layer.
_lowest = lru_cache(maxsize=64)(min)
_highest = lru_cache(maxsize=64)(max)


def map_shared_file(path: str, num_bytes: int, owner: bool, *, populate: bool = False,
                    size_error: type[Exception] = TransportError) -> mmap.mmap:
    """`num_bytes` of the file at `path`, mapped MAP_SHARED. The owner creates it (O_EXCL, mode 0600: only this user
    maps it) and sizes it; anyone else opens the existing file and must find that size (else `size_error`). The
    descriptor is closed either way, and an owner that fails removes the file. `populate` faults every page in now
    (MAP_POPULATE) instead of on first touch."""
    fd = os.open(path, (os.O_CREAT | os.O_EXCL | os.O_RDWR) if owner else os.O_RDWR, 0o600)
    try:
        if owner:
            os.ftruncate(fd, num_bytes)
        elif os.fstat(fd).st_size != num_bytes:
            raise size_error(f"{path} holds {os.fstat(fd).st_size} bytes, expected {num_bytes}")
        return mmap.mmap(fd, num_bytes, flags=mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0))
    except BaseException:
        if owner:
            os.unlink(path)
        raise
    finally:
        os.close(fd)


class ShmKVRegion:
    """KV storage `[layers, 2, blocks, block_size, kv_heads, head_dim]` in a shared, pre-faulted mapping."""

    def __init__(self, path: str, layout: KVLayout, num_blocks: int, owner: bool) -> None:
        self.path, self.layout, self.num_blocks, self.owner = path, layout, num_blocks, owner
        # Pre-faulted once per link, instead of inside the first handoffs.
        self._mmap = map_shared_file(path, num_blocks * layout.block_bytes, owner, populate=True)
        self.kv: np.ndarray | None = np.frombuffer(self._mmap, dtype=storage_dtype(layout)).reshape(
            layout.storage_shape(num_blocks))

    @classmethod
    def create(cls, layout: KVLayout, num_blocks: int, directory: str = SHM_DIRECTORY) -> ShmKVRegion:
        """A new zeroed region owned by this process; `close` unlinks it."""
        path = os.path.join(directory, f"{SHM_PREFIX}-{os.getpid()}-{secrets.token_hex(4)}")
        return cls(path, layout, num_blocks, owner=True)

    @classmethod
    def attach(cls, path: str, layout: KVLayout, num_blocks: int) -> ShmKVRegion:
        return cls(path, layout, num_blocks, owner=False)

    def torch_view(self) -> object:
        """The region as a torch tensor of the layout's dtype (no copy), for the engine's KV storage."""
        import torch  # only the engine needs tensors; the transports and benchmark stay numpy-only

        dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[self.layout.dtype]
        return torch.frombuffer(self._mmap, dtype=dtype).view(self.layout.storage_shape(self.num_blocks))

    def close(self) -> None:
        """Unmap (once no array views remain) and, for the owner, remove the file; idempotent."""
        self.kv = None
        if self.owner and os.path.exists(self.path):
            os.unlink(self.path)  # the memory itself goes once every process has unmapped it
        try:
            self._mmap.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes with the last reference


def remove_stale_regions(directory: str = SHM_DIRECTORY, prefix: str = SHM_PREFIX) -> list[str]:
    """Delete regions named `prefix-PID-TOKEN` whose creating process is gone (a decode worker, or a KV store node
    with `store_slots`' prefix, killed before it could clean up)."""
    removed: list[str] = []
    for name in sorted(os.listdir(directory)):
        parts = name.split("-")
        if not name.startswith(prefix + "-") or len(parts) != prefix.count("-") + 3 or not parts[-2].isdigit():
            continue
        try:
            os.kill(int(parts[-2]), 0)
        except ProcessLookupError:
            os.unlink(os.path.join(directory, name))
            removed.append(name)
        except PermissionError:
            pass  # alive, owned by another user
    return removed


class ShmKVReceiver(SocketKVReceiver):
    """Decode end whose storage is `region`; chunk frames carry no payload."""

    peer_lost_write_grace_s = 2.0  # a sender writes a step's layers, then sends: it sees a dead link after writing

    def __init__(self, name: str, region: ShmKVRegion, host: str = "127.0.0.1", port: int = 0, *,
                 secret: ClusterSecret) -> None:
        assert region.kv is not None
        super().__init__(name, region.layout, region.kv, host, port, secret=secret)
        self.region = region

    def _shm_path(self) -> str:
        return self.region.path


class ShmKVSender(SocketKVSender):
    """Prefill end: attaches each decode peer's region at link time and writes chunks into it."""

    def __init__(self, name: str, layout: KVLayout, *, secret: ClusterSecret) -> None:
        super().__init__(name, layout, secret=secret)
        self._regions: dict[str, ShmKVRegion] = {}

    def _on_welcome(self, link: _Link) -> None:
        assert link.welcome is not None
        if not link.welcome.shm_path:
            raise TransportError(f"{link.peer} offers no shared-memory region (a tcp receiver?)")
        try:
            region = ShmKVRegion.attach(link.welcome.shm_path, self.layout, link.welcome.num_blocks)
        except OSError as error:  # e.g. the decode worker is on another host: its /dev/shm is not ours
            raise TransportError(f"cannot map {link.peer}'s region {link.welcome.shm_path}: {error}") from error
        self._regions[link.peer] = region

    def _chunk_payload(self, link: _Link, chunk: LayerChunk, source_kv: np.ndarray) -> list[memoryview]:
        """Only checks the handles: the bytes move in `_place_chunks`, all chunks of a write together."""
        dst_block_ids, num_blocks = chunk.dst_block_ids, self._regions[link.peer].num_blocks
        if dst_block_ids and not (0 <= _lowest(dst_block_ids) and _highest(dst_block_ids) < num_blocks):
            raise TransportError(f"destination blocks {chunk.dst_block_ids} outside {link.peer}'s region")
        return []

    def _place_chunks(self, link: _Link, chunks: list[LayerChunk], source_kv: np.ndarray) -> None:
        # `_chunk_payload` checked every chunk of the write: a bad one failed it before any byte moved.
        region = self._regions[link.peer]
        assert region.kv is not None
        copy_chunks(chunks, source_kv, region.kv)

    def _on_link_closed(self, link: _Link) -> None:
        region = self._regions.pop(link.peer, None)
        if region is not None:
            region.close()
