"""KV cache events a worker publishes so the router's global prefix index stays honest."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvbaton.cache.fast_init import slot_setters


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
        return KVEvent(int(seq), KVEventKind(kind), tuple(int(h) for h in hashes), parent, int(block_size))  # type: ignore[arg-type]


_set_seq, _set_kind, _set_block_hashes, _set_parent_hash, _set_block_size = slot_setters(
    KVEvent, ("seq", "kind", "block_hashes", "parent_hash", "block_size"))


def make_kv_event(seq: int, kind: KVEventKind, block_hashes: tuple[int, ...], parent_hash: int | None,
                  block_size: int) -> KVEvent:
    """`KVEvent(seq, kind, block_hashes, parent_hash, block_size)` without the frozen `__init__`
    (kvbaton.cache.fast_init), for a cache emitting its own events; wire input goes through `from_wire`."""
    event = object.__new__(KVEvent)
    _set_seq(event, seq)
    _set_kind(event, kind)
    _set_block_hashes(event, block_hashes)
    _set_parent_hash(event, parent_hash)
    _set_block_size(event, block_size)
    return event
