"""Block hashing: the fast implementations give exactly the reference chained hashes, and precomputed
hashes handed to the radix cache change nothing it stores or emits."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbaton.cache.block_pool import BlockPool
from kvbaton.cache.hashing import CacheKey, chain_hashes, hash_block_tokens, hash_prompt, split_blocks
from kvbaton.cache.radix_cache import RadixCache

KEY = CacheKey("rev-a", "layout-a")


def reference_root_hash(key: CacheKey) -> int:
    parts = (key.model_revision, key.kv_layout, key.tenant_salt)
    material = "".join(f"{len(part)}:{part}" for part in parts).encode()  # each part length-prefixed
    digest = hashlib.blake2b(material, digest_size=8, key=b"kvbaton-block-hash-v1").digest()
    return int.from_bytes(digest, "little", signed=True)


def reference_hashes(key: CacheKey, token_ids: list[int], block_size: int) -> list[int]:
    """The original slice-and-hash loop the live router and workers agree on."""
    hashes: list[int] = []
    parent = reference_root_hash(key)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return hashes


@settings(max_examples=200, deadline=None, derandomize=True)
@given(tokens=st.lists(st.integers(0, 2**31), max_size=70), block_size=st.integers(1, 9),
       tenant=st.sampled_from(["", "t1", "tenant-\u00e9"]))
def test_hash_block_tokens_matches_reference(tokens: list[int], block_size: int, tenant: str) -> None:
    key = KEY.with_tenant(tenant)
    expected = reference_hashes(key, tokens, block_size)
    assert key.root_hash == reference_root_hash(key)
    assert hash_block_tokens(key, tokens, block_size) == expected
    blocks = hash_prompt(key, tokens, block_size)
    assert blocks.block_hashes == tuple(expected) and blocks.key == key and blocks.block_size == block_size
    assert blocks.token_blocks == tuple(tuple(tokens[i : i + block_size])
                                        for i in range(0, len(tokens) - block_size + 1, block_size))
    assert split_blocks(tokens, block_size) == list(blocks.token_blocks)


def test_chain_hashes_continues_a_chain() -> None:
    tokens = list(range(12))
    full = hash_block_tokens(KEY, tokens, 4)
    assert chain_hashes(full[0], split_blocks(tokens[4:], 4)) == full[1:]
    assert chain_hashes(KEY.root_hash, []) == []


def _events(cache: RadixCache) -> list[tuple]:
    return [(e.seq, e.kind, e.block_hashes, e.parent_hash) for e in cache.take_events()]


@settings(max_examples=80, deadline=None, derandomize=True)
@given(prompts=st.lists(st.lists(st.integers(0, 3), min_size=2, max_size=14), min_size=1, max_size=6),
       num_known=st.integers(0, 8))
def test_insert_with_known_hashes_is_identical(prompts: list[list[int]], num_known: int) -> None:
    """Same nodes, hashes and events whether the cache hashes the blocks or is handed (some of) them."""
    block_size = 2
    caches = []
    for with_hashes in (False, True):
        pool = BlockPool(64)
        cache = RadixCache(pool, block_size)
        matches = []
        for tokens in prompts:
            blocks = hash_prompt(KEY, tokens, block_size)
            ids = pool.allocate(len(blocks.token_blocks))
            known = blocks.block_hashes[:num_known] if with_hashes else ()
            match = cache.insert_blocks(KEY, list(blocks.token_blocks), ids, known)
            pool.release(ids)
            matches.append((match.block_ids, match.block_hashes))
            cache.check_invariants()
        caches.append((matches, _events(cache), cache.snapshot()))
    assert caches[0] == caches[1]


def test_insert_from_with_known_hashes_and_wrong_hashes_rejected() -> None:
    pool = BlockPool(16)
    cache = RadixCache(pool, 2)
    blocks = hash_prompt(KEY, [1, 2, 3, 4, 5, 6, 7, 8], 2)
    ids = pool.allocate(4)
    head = cache.insert_blocks(KEY, list(blocks.token_blocks[:2]), ids[:2], blocks.block_hashes[:2])
    cache.lock(head.node)
    tail = cache.insert_from_blocks(head.node, list(blocks.token_blocks[2:]), ids[2:], blocks.block_hashes[2:3])
    assert tail.block_hashes == blocks.block_hashes[2:]
    cache.lock(tail.node)  # we still hold our own references on the blocks: keep them pinned
    cache.check_invariants()
    other = hash_prompt(KEY.with_tenant("other"), [1, 2, 3, 4, 9, 9], 2)
    own = pool.allocate(3)
    before = (cache.num_cached_blocks, [pool.ref_count(i) for i in own])
    with pytest.raises(ValueError, match="do not chain"):  # hashes of another tenant: refused, nothing changed
        cache.insert_blocks(KEY, list(other.token_blocks), own, other.block_hashes)
    assert (cache.num_cached_blocks, [pool.ref_count(i) for i in own]) == before
    cache.check_invariants()
