"""Chained block hashes: one integer identifies a whole block-aligned prefix within a cache namespace.

`hash(parent, block tokens)` chains from a root derived from the cache key, so equal hashes mean
equal prefixes under the same (model revision, KV layout, tenant salt). Only ints and tuples of
ints go through Python's `hash`, which is not salted per process for those types, so a router
and its workers compute the same hashes; the string-valued key goes through blake2b once per
distinct key (memoised: the router and the simulator ask for it on every request), its parts
length-prefixed so that no two different keys share the material.

Hashes name blocks for the router's index and the KV events; they never decide what a request finds
cached. The radix cache keeps one tree per `CacheKey`, looked up by equality of the whole key, and
matches token tuples; the KV store keeps each block's key beside its hash and matches both. So a request's cached
tokens come from its own namespace whatever two hashes happen to share.

`hash_prompt` splits a prompt into block tuples and hashes them once, so a caller that both routes
a request and hands it to a local scheduler (the simulator) can pass the same `HashedBlocks` on
instead of splitting and hashing the prompt again on the worker.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

_HASH_SEED = b"kvbaton-block-hash-v1"


def length_prefixed(parts: Sequence[str]) -> str:
    """`len:part` for each part, concatenated: an injective encoding of a tuple of strings of a fixed arity (a
    reader always knows where each part ends), whatever characters the parts hold."""
    return "".join(f"{len(part)}:{part}" for part in parts)


def tenant_salt(key_tenant: str, client_tenant: str = "", cache_salt: str = "") -> str:
    """A request's tenant salt (its `Request.tenant`): the tenant of its API key, the tenant its client named
    (trusted only behind a gateway) and its `cache_salt`. Two requests get equal salts exactly when all three
    are equal (`length_prefixed` is injective, and "" is the salt of three empty parts only), so a cache
    namespace is never shared by two different triples."""
    if not (key_tenant or client_tenant or cache_salt):
        return ""
    return length_prefixed((key_tenant, client_tenant, cache_salt))


@lru_cache(maxsize=4096)
def _root_hash(model_revision: str, kv_layout: str, tenant_salt: str) -> int:
    material = length_prefixed((model_revision, kv_layout, tenant_salt)).encode()
    digest = hashlib.blake2b(material, digest_size=8, key=_HASH_SEED).digest()
    return int.from_bytes(digest, "little", signed=True)


def namespace_tag(namespace: Sequence[str]) -> int:
    """A signed 64-bit tag of a namespace as the store's wire names it (model revision, KV layout, tenant salt): the
    chain's root hash, equal exactly when the three parts are (up to blake2b's collisions)."""
    model_revision, kv_layout, salt = namespace
    return _root_hash(model_revision, kv_layout, salt)


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
        return _root_hash(self.model_revision, self.kv_layout, self.tenant_salt)


def hash_block(parent_hash: int, block_token_ids: Sequence[int]) -> int:
    """Hash of one full block given the hash of everything before it."""
    return hash((parent_hash, tuple(block_token_ids)))


def split_blocks(token_ids: Sequence[int], block_size: int) -> list[tuple[int, ...]]:
    """The token tuples of every full block of `token_ids` (a trailing partial block is skipped)."""
    return list(zip(*[iter(token_ids)] * block_size))  # consecutive block_size-tuples, built in C


def chain_hashes(parent_hash: int, token_blocks: Sequence[tuple[int, ...]]) -> list[int]:
    """Chained hashes of consecutive full blocks (token tuples) following the block hashed `parent_hash`."""
    hashes: list[int] = []
    append = hashes.append
    for block in token_blocks:
        parent_hash = hash((parent_hash, block))
        append(parent_hash)
    return hashes


def hash_block_tokens(key: CacheKey, token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of every full block of `token_ids` (a trailing partial block is skipped)."""
    return chain_hashes(key.root_hash, split_blocks(token_ids, block_size))


@dataclass(frozen=True, slots=True)
class HashedBlocks:
    """A prompt's full blocks, split and hashed once under `key` (tenant salt included)."""

    key: CacheKey
    block_size: int
    token_blocks: tuple[tuple[int, ...], ...]  # token tuple of each full block, in order
    block_hashes: tuple[int, ...]  # chain_hashes(key.root_hash, token_blocks)


def hash_prompt(key: CacheKey, token_ids: Sequence[int], block_size: int) -> HashedBlocks:
    """Split `token_ids` into full blocks and hash them: `hash_block_tokens` keeping the block tuples."""
    token_blocks = split_blocks(token_ids, block_size)
    return HashedBlocks(key, block_size, tuple(token_blocks), tuple(chain_hashes(key.root_hash, token_blocks)))
