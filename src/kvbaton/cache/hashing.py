"""Chained block hashes: one integer identifies a whole block-aligned prefix within a cache namespace.

`hash(parent, block tokens)` chains from a root derived from the cache key, so equal hashes mean
equal prefixes under the same (model revision, KV layout, tenant salt). Only ints and tuples of
ints go through Python's `hash`, which is not salted per process for those types, so a router
and its workers compute the same hashes; the string-valued key goes through blake2b once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace

_HASH_SEED = b"kvbaton-block-hash-v1"


@dataclass(frozen=True, slots=True)
class CacheKey:
    """Namespace of cached KV: blocks are shared only between requests with equal keys."""

    model_revision: str
    kv_layout: str
    tenant_salt: str = ""

    def with_tenant(self, tenant: str) -> CacheKey:
        return self if tenant == self.tenant_salt else replace(self, tenant_salt=tenant)

    @property
    def root_hash(self) -> int:
        material = "\x1f".join((self.model_revision, self.kv_layout, self.tenant_salt)).encode()
        digest = hashlib.blake2b(material, digest_size=8, key=_HASH_SEED).digest()
        return int.from_bytes(digest, "little", signed=True)


def hash_block(parent_hash: int, block_token_ids: Sequence[int]) -> int:
    """Hash of one full block given the hash of everything before it."""
    return hash((parent_hash, tuple(block_token_ids)))


def hash_block_tokens(key: CacheKey, token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of every full block of `token_ids` (a trailing partial block is skipped)."""
    hashes: list[int] = []
    parent = key.root_hash
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return hashes
