"""KV cache events a worker publishes so the router's global prefix index stays honest."""

from __future__ import annotations

import enum
from dataclasses import dataclass



class KVEventKind(enum.Enum):
    STORED = "stored"  # blocks entered the prefix cache
    EVICTED = "evicted"  # blocks left the prefix cache
    CLEARED = "cleared"  # the whole cache was dropped (block_hashes empty)


@dataclass(frozen=True, slots=True)
class KVEvent:
    seq: int  # 1, 2, 3, ... per cache; a gap tells the consumer it missed events and must resync
    kind: KVEventKind
    block_hashes: tuple[int, ...]  # chained hashes (kvbaton.cache.hashing), in prefix order for STORED
    parent_hash: int | None = None  # STORED: hash of the block before block_hashes[0] (the key's root hash at the start)
    block_size: int = 16

    def to_wire(self) -> list[object]:
        """A msgpack-friendly form (no pickle on sockets)."""
        return [self.seq, self.kind.value, list(self.block_hashes), self.parent_hash, self.block_size]

    @staticmethod
    def from_wire(raw: list[object]) -> KVEvent:
        seq, kind, hashes, parent, block_size = raw
        # map(int, ...) converts in C: a router applies every worker's events (each router of several does).
        return KVEvent(int(seq), KVEventKind(kind), tuple(map(int, hashes)), parent, int(block_size))  # type: ignore[arg-type,call-overload]

