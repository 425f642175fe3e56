"""The KV store's disk tier on a node: one file per block under a directory, each checked by a checksum when read.

A file is `header | payload`: the header holds a magic number, the payload's length, a digest of the block's
key (its chained hash and the cache key it was stored under) and a blake2b checksum of the payload. `read`
returns the payload only when all four agree with what the caller asks for and the file's size is exactly
header + length; anything else (a flipped byte, a truncated or foreign file, a block of another tenant under
the same hash) is a miss, and the file is removed, so a corrupt block is never used: the caller recomputes it.

Files are written to a temporary name and renamed, so a reader never sees half a block (a crash mid-write
leaves only a `.tmp` file, which `open` removes). The directory is the store node's own: `open` empties it,
since the blocks it held are not in the node's metadata (a restarted node starts empty, as its DRAM does).
Which blocks live here, and when they leave, is decided by the store's policy core (`kvbaton.cache.kv_store`);
this only moves bytes.
"""

from __future__ import annotations

import hashlib
import os
import struct
import time
from pathlib import Path

_MAGIC = b"KVB1"
_HEADER = struct.Struct("<4sQ16s16s")  # magic, payload length, key digest, payload checksum
HEADER_BYTES = _HEADER.size


def key_digest(block_hash: int, namespace: tuple[str, ...]) -> bytes:
    """16 bytes naming a block: its chained hash under its cache key (parts length-prefixed)."""
    material = b"".join(len(p.encode()).to_bytes(4, "little") + p.encode() for p in namespace)
    return hashlib.blake2b(block_hash.to_bytes(8, "little", signed=True) + material, digest_size=16).digest()


def checksum(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


class DiskBlockFiles:
    """Blocks as files in `directory`, at most `capacity_blocks` of them (the policy core keeps to it)."""

    def __init__(self, directory: str | Path, capacity_blocks: int) -> None:
        self.directory = Path(directory)
        self.capacity_blocks = capacity_blocks
        self.num_written_bytes = 0
        self.num_read_bytes = 0
        self.read_s = 0.0  # seconds spent reading block files (what the router measures the disk's speed by)
        self.num_read_blocks = 0  # reads that passed every check
        self.num_corrupt_blocks = 0  # reads refused: checksum, length, key or magic wrong, or file missing

    def open(self) -> None:
        """Create the directory (mode 0700: other users read no KV) and remove blocks a previous node left."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        for path in self.directory.iterdir():
            if path.suffix in (".kvb", ".tmp"):
                path.unlink(missing_ok=True)

    def path_of(self, block_hash: int) -> Path:
        return self.directory / f"{block_hash & 0xFFFF_FFFF_FFFF_FFFF:016x}.kvb"

    def write(self, block_hash: int, namespace: tuple[str, ...], payload: bytes | memoryview) -> None:
        path = self.path_of(block_hash)
        tmp = path.with_suffix(".tmp")
        header = _HEADER.pack(_MAGIC, len(payload), key_digest(block_hash, namespace), checksum(payload))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, header)
            view = memoryview(payload).cast("B")
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)
        self.num_written_bytes += HEADER_BYTES + len(payload)

    def read(self, block_hash: int, namespace: tuple[str, ...], num_bytes: int) -> bytes | None:
        """The block's payload of `num_bytes`, or None (and the file gone) if it is missing or fails a check."""
        path = self.path_of(block_hash)
        started = time.perf_counter()
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self.num_corrupt_blocks += 1
            return None
        self.read_s += time.perf_counter() - started
        self.num_read_bytes += len(data)
        if len(data) == HEADER_BYTES + num_bytes:
            magic, length, digest, check = _HEADER.unpack_from(data)
            payload = memoryview(data)[HEADER_BYTES:]
            if (magic == _MAGIC and length == num_bytes and digest == key_digest(block_hash, namespace)
                    and check == checksum(payload)):
                self.num_read_blocks += 1
                return data[HEADER_BYTES:]
        self.num_corrupt_blocks += 1
        path.unlink(missing_ok=True)
        return None

    def remove(self, block_hash: int) -> None:
        self.path_of(block_hash).unlink(missing_ok=True)

    def num_files(self) -> int:
        return sum(1 for path in self.directory.iterdir() if path.suffix == ".kvb")
