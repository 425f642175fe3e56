"""The radix prefix cache's handles: its tree node, and the `PrefixMatch` that hands one out.

Callers of `kvbaton.cache.radix_cache.RadixCache` only ever hold a node as an opaque handle (the
`node` of a `PrefixMatch`) to pass back to `lock`/`unlock`/`insert_from`; the cache and its LRU
LRU order (`kvbaton.cache.radix_lru`) read and write its fields directly. The tree rules (how
nodes split, when they leave the tree, why a locked handle stays valid) are in `radix_cache`'s
docstring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


BlockTokens = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The cached prefix of a token sequence."""

    block_ids: tuple[int, ...]  # cached blocks covering the matched prefix, in order
    block_hashes: tuple[int, ...]  # their chained hashes (kvbaton.cache.hashing)
    node: Any  # opaque handle for lock/unlock: the deepest node of the path (root if empty); mypyc: Any, not object

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


class RadixNode:
    """A run of cached blocks; opaque to callers (they only pass it back to lock/unlock)."""

    __slots__ = (
        "key", "parent", "children", "token_blocks", "block_ids", "block_hashes", "parent_hash",
        "lock_ref", "num_direct_locks", "last_access", "serial", "attached", "namespace",
    )  # fmt: skip

    def __init__(self, parent: RadixNode | None, parent_hash: int, serial: int, last_access: int) -> None:
        self.key: BlockTokens | None = None  # token tuple of the first block (None for a root)
        self.parent = parent
        self.children: dict[BlockTokens, RadixNode] = {}
        self.token_blocks: list[BlockTokens] = []
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []
        self.parent_hash = parent_hash  # hash of the block just before this node (key.root_hash under a root)
        self.lock_ref = 0  # locks on this node plus locks on any descendant: > 0 means pinned
        self.num_direct_locks = 0  # locks taken with this node as the handle
        self.last_access = last_access
        self.serial = serial  # creation order; breaks LRU ties deterministically
        self.attached = True
        # The CacheKey of this node's tree (set on its root; a node never moves to another tree).
        self.namespace: object = parent.namespace if parent is not None else None

    @property
    def tail_hash(self) -> int:
        return self.block_hashes[-1] if self.block_hashes else self.parent_hash
