"""RadixCache: exact block ids, splits, namespaces, LRU eviction order, locks, events and snapshot."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvbaton.cache.block_pool import BlockPool
from kvbaton.cache.events import KVEvent, KVEventKind
from kvbaton.cache.hashing import CacheKey, hash_block_tokens
from kvbaton.cache.radix_cache import RadixCache
from kvbaton.cache.radix_node import PrefixMatch

BLOCK_SIZE = 2
KEY = CacheKey("rev-a", "layout-a")
OTHER_TENANT = KEY.with_tenant("tenant-b")


def make_cache(num_blocks: int = 16) -> tuple[BlockPool, RadixCache]:
    pool = BlockPool(num_blocks)
    return pool, RadixCache(pool, BLOCK_SIZE)


def cache_tokens(pool: BlockPool, cache: RadixCache, tokens: list[int], key: CacheKey = KEY) -> PrefixMatch:
    """Act like a finished request: allocate its blocks, insert them, drop its own references."""
    block_ids = pool.allocate(len(tokens) // BLOCK_SIZE)
    match = cache.insert(key, tokens, block_ids)
    pool.release(block_ids)
    return match


def hashes(tokens: list[int], key: CacheKey = KEY) -> tuple[int, ...]:
    return tuple(hash_block_tokens(key, tokens, BLOCK_SIZE))


def test_insert_then_match_full_blocks_only() -> None:
    pool, cache = make_cache()
    inserted = cache_tokens(pool, cache, [1, 2, 3, 4, 5, 6])
    assert inserted.block_ids == (0, 1, 2) and inserted.block_hashes == hashes([1, 2, 3, 4, 5, 6])
    match = cache.match_prefix(KEY, [1, 2, 3, 4, 9])  # third block is partial: never matched
    assert match.block_ids == (0, 1)
    assert match.block_hashes == hashes([1, 2, 3, 4])
    assert match.num_blocks == 2
    assert cache.match_prefix(KEY, [2, 1]).block_ids == ()
    assert [pool.ref_count(i) for i in range(4)] == [1, 1, 1, 0]
    assert cache.num_cached_blocks == 3 and cache.num_evictable_blocks == 3
    cache.check_invariants()


def test_partial_match_splits_node_and_keeps_canonical_blocks() -> None:
    pool, cache = make_cache()
    cache_tokens(pool, cache, [1, 2, 3, 4, 5, 6])  # blocks 0, 1, 2
    own_ids = pool.allocate(3)  # 3, 4, 5
    match = cache.insert(KEY, [1, 2, 3, 4, 7, 8], own_ids)
    assert match.block_ids == (0, 1, 5)  # cached prefix kept; only the new position adopted
    assert [pool.ref_count(i) for i in (3, 4, 5)] == [1, 1, 2]
    cache.lock(match.node)
    cache.check_invariants()
    pool.release(own_ids)
    cache.unlock(match.node)
    assert pool.free_block_ids()[-2:] == [3, 4]
    snapshot = cache.snapshot()
    assert [(e.block_hashes, e.parent_hash) for e in snapshot] == [
        (hashes([1, 2, 3, 4]), KEY.root_hash),
        (hashes([1, 2, 3, 4, 5, 6])[2:], hashes([1, 2, 3, 4])[1]),
        (hashes([1, 2, 3, 4, 7, 8])[2:], hashes([1, 2, 3, 4])[1]),
    ]
    cache.check_invariants()


def test_duplicate_insert_adopts_nothing_and_emits_nothing() -> None:
    pool, cache = make_cache()
    cache_tokens(pool, cache, [1, 2, 3, 4])
    cache.take_events()
    duplicate_ids = pool.allocate(2)
    match = cache.insert(KEY, [1, 2, 3, 4], duplicate_ids)
    assert match.block_ids == (0, 1)
    assert cache.take_events() == []
    assert [pool.ref_count(i) for i in (0, 1, 2, 3)] == [1, 1, 1, 1]
    pool.release(duplicate_ids)
    assert cache.num_cached_blocks == 2
    cache.check_invariants()


def test_namespaces_do_not_share_blocks() -> None:
    pool, cache = make_cache()
    cache_tokens(pool, cache, [1, 2, 3, 4])
    assert cache.match_prefix(OTHER_TENANT, [1, 2, 3, 4]).block_ids == ()
    other = cache_tokens(pool, cache, [1, 2, 3, 4], key=OTHER_TENANT)
    assert other.block_ids == (2, 3)
    assert other.block_hashes == hashes([1, 2, 3, 4], OTHER_TENANT) != hashes([1, 2, 3, 4])
    assert cache.match_prefix(KEY, [1, 2, 3, 4]).block_ids == (0, 1)
    cache.check_invariants()


def test_evict_least_recently_used_leaf_first_block_by_block() -> None:
    pool, cache = make_cache()
    cache_tokens(pool, cache, [1, 1, 2, 2])  # blocks 0, 1
    cache_tokens(pool, cache, [3, 3, 4, 4])  # blocks 2, 3
    cache_tokens(pool, cache, [5, 5])  # block 4
    cache.match_prefix(KEY, [1, 1])  # splits [1,1]|[2,2] and touches only [1,1]
    cache.match_prefix(KEY, [3, 3, 4, 4], touch=False)  # a peek changes nothing
    cache.take_events()
    # Oldest leaves: [2,2] (block 1), then [3,3,4,4] trimmed from its tail.
    assert cache.evict(3) == 3
    assert pool.free_block_ids()[-3:] == [1, 3, 2]
    (event,) = cache.take_events()
    assert event.kind is KVEventKind.EVICTED and event.seq == 4
    assert event.block_hashes == (hashes([1, 1, 2, 2])[1], hashes([3, 3, 4, 4])[1], hashes([3, 3])[0])
    assert cache.match_prefix(KEY, [1, 1, 2, 2], touch=False).block_ids == (0,)
    assert cache.evict(10) == 2  # [5,5] (older than the touched [1,1]), then [1,1]
    assert pool.free_block_ids()[-2:] == [4, 0]
    assert cache.evict(1) == 0 and cache.take_events()[0].block_hashes == (hashes([5, 5])[0], hashes([1, 1])[0])
    cache.check_invariants()


def test_locked_nodes_are_never_evicted() -> None:
    pool, cache = make_cache()
    cache_tokens(pool, cache, [1, 2, 3, 4, 5, 6])
    match = cache.match_prefix(KEY, [1, 2, 3, 4])  # splits: the lock pins exactly two blocks
    pool.ref(match.block_ids)
    cache.lock(match.node)
    cache.lock(match.node)  # nested
    assert cache.num_evictable_blocks == 1
    assert cache.evict(5) == 1
    assert cache.match_prefix(KEY, [1, 2, 3, 4, 5, 6], touch=False).block_ids == (0, 1)
    cache.check_invariants()
    pool.release(match.block_ids)
    cache.unlock(match.node)
    assert cache.num_evictable_blocks == 0
    cache.unlock(match.node)
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(match.node)
    assert cache.num_evictable_blocks == 2
    assert cache.evict(5) == 2 and pool.num_free_blocks == 16
    with pytest.raises(ValueError, match="stale"):
        cache.lock(match.node)
    cache.check_invariants()


def test_peek_handle_pins_the_whole_node() -> None:
    pool, cache = make_cache()
    cache_tokens(pool, cache, [1, 2, 3, 4, 5, 6])
    peek = cache.match_prefix(KEY, [1, 2], touch=False)
    assert peek.block_ids == (0,)
    cache.lock(peek.node)
    assert cache.num_evictable_blocks == 0 and cache.evict(3) == 0
    cache.unlock(peek.node)
    cache.check_invariants()


def test_locked_handle_survives_a_split_of_its_node() -> None:
    pool, cache = make_cache()
    first = cache_tokens(pool, cache, [1, 2, 3, 4, 5, 6])
    cache.lock(first.node)
    cache_tokens(pool, cache, [1, 2, 9, 9])  # splits the locked node after its first block
    assert cache.num_evictable_blocks == 1  # only the new [9,9] block
    cache.check_invariants()
    cache.unlock(first.node)
    assert cache.num_evictable_blocks == 4
    cache.check_invariants()


def test_events_have_gapless_seqs_and_exact_content() -> None:
    pool, cache = make_cache()
    cache_tokens(pool, cache, [1, 2, 3, 4])
    cache_tokens(pool, cache, [1, 2, 7, 7, 8, 8])
    assert cache.take_events() == [
        KVEvent(1, KVEventKind.STORED, hashes([1, 2, 3, 4]), KEY.root_hash, BLOCK_SIZE),
        KVEvent(2, KVEventKind.STORED, hashes([1, 2, 7, 7, 8, 8])[1:], hashes([1, 2])[0], BLOCK_SIZE),
    ]
    assert cache.take_events() == []
    cache.evict(1)
    assert [(e.seq, e.kind) for e in cache.take_events()] == [(3, KVEventKind.EVICTED)]


def test_snapshot_describes_content_without_consuming_events() -> None:
    pool, cache = make_cache()
    cache_tokens(pool, cache, [1, 2, 3, 4], key=OTHER_TENANT)
    cache_tokens(pool, cache, [5, 6])
    snapshot = cache.snapshot()
    # Namespaces sorted by key (tenant "" before "tenant-b"); every event carries the current seq.
    assert snapshot == [
        KVEvent(2, KVEventKind.STORED, hashes([5, 6]), KEY.root_hash, BLOCK_SIZE),
        KVEvent(2, KVEventKind.STORED, hashes([1, 2, 3, 4], OTHER_TENANT), OTHER_TENANT.root_hash, BLOCK_SIZE),
    ]
    assert [e.seq for e in cache.take_events()] == [1, 2]


def test_clear_frees_unlocked_blocks_and_reports_it() -> None:
    pool, cache = make_cache()
    cache_tokens(pool, cache, [1, 2, 3, 4])
    locked = cache_tokens(pool, cache, [5, 6])
    cache.lock(locked.node)
    cache.take_events()
    assert cache.clear() == 2
    (event,) = cache.take_events()
    assert event.kind is KVEventKind.EVICTED and set(event.block_hashes) == set(hashes([1, 2, 3, 4]))
    assert cache.num_cached_blocks == 1
    cache.unlock(locked.node)
    assert cache.clear() == 1
    assert cache.take_events() == [KVEvent(4, KVEventKind.CLEARED, (), None, BLOCK_SIZE)]
    assert pool.num_free_blocks == 16 and cache.clear() == 0 and cache.take_events() == []
    cache.check_invariants()


def test_bad_inserts_raise_and_change_nothing() -> None:
    pool, cache = make_cache()
    cache_tokens(pool, cache, [1, 2])  # block 0
    with pytest.raises(ValueError, match="do not fill"):
        cache.insert(KEY, [1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="free block 5"):
        cache.insert(KEY, [3, 4], [5])  # the caller does not hold block 5
    with pytest.raises(ValueError, match="already cached"):
        cache.insert(KEY, [9, 9], [0])  # block 0 is cached at another position
    held = pool.allocate(1)
    with pytest.raises(ValueError, match="listed twice"):
        cache.insert(KEY, [3, 4, 5, 6], held * 2)
    assert cache.num_cached_blocks == 1 and cache.take_events()[0].seq == 1
    pool.release(held)
    cache.check_invariants()


def test_check_invariants_catches_an_unlocked_block_held_by_a_request() -> None:
    pool, cache = make_cache()
    block_ids = pool.allocate(1)
    cache.insert(KEY, [1, 2], block_ids)  # the request still holds its reference and did not lock
    with pytest.raises(AssertionError, match="expected 1"):
        cache.check_invariants()


def test_cache_package_does_not_import_torch_fastapi_or_zmq() -> None:
    code = (
        "import sys, kvbaton.cache.block_pool, kvbaton.cache.radix_cache;"
        "bad = sorted(m for m in ('torch', 'fastapi', 'zmq') if m in sys.modules);"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_heap_rebuilds_keep_every_evictable_leaf_and_the_lru_order() -> None:
    pool, cache = make_cache()
    leaves = [cache_tokens(pool, cache, [value, value]) for value in (1, 2, 3, 4)]  # blocks 0..3
    for step in range(300):  # every unlock and touch pushes a heap entry: forces several rebuilds
        leaf = leaves[step % 3]
        cache.lock(leaf.node)
        cache.unlock(leaf.node)
        cache.match_prefix(KEY, [step % 3 + 1, step % 3 + 1])
        cache.check_invariants()
    # Last touches: 3 (step 299), 2 (step 298), 1 (step 297); block 3 ([4,4]) was never touched again.
    assert cache.evict(4) == 4
    assert pool.free_block_ids()[-4:] == [3, 0, 1, 2]
    cache.check_invariants()


def test_last_seq_counts_emitted_events_whether_taken_or_not() -> None:
    pool, cache = make_cache()
    assert cache.last_seq == 0
    cache_tokens(pool, cache, [1, 2])
    cache.evict(1)
    assert cache.last_seq == 2 and cache.snapshot() == []
    assert [e.seq for e in cache.take_events()] == [1, 2] and cache.last_seq == 2


def _cyclic_garbage_after_dropping(close: bool) -> int:
    """Objects the cyclic collector frees once a cache holding branched trees in two namespaces is dropped."""
    import gc

    pool, cache = make_cache(32)
    for tokens in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8], [1, 2, 9, 9], [5, 5, 6, 6]):
        cache_tokens(pool, cache, tokens)
    cache_tokens(pool, cache, [1, 2, 3, 4], OTHER_TENANT)
    cache.check_invariants()
    gc.collect()
    if close:
        cache.close()
    del cache
    return gc.collect()


def test_close_leaves_the_trees_to_reference_counting() -> None:
    # The parent <-> child links are cycles: without close the collector has the nodes to free, with it nothing.
    assert _cyclic_garbage_after_dropping(close=False) > 0
    assert _cyclic_garbage_after_dropping(close=True) == 0


def _cache_with_three_leaves() -> tuple[BlockPool, RadixCache]:
    pool, cache = make_cache(16)
    cache_tokens(pool, cache, [1, 2, 3, 4, 5, 6, 7, 8])  # blocks 0-3
    cache_tokens(pool, cache, [1, 2, 3, 4, 9, 9, 8, 8])  # splits after two blocks: 4, 5 below them
    cache_tokens(pool, cache, [5, 5, 6, 6, 7, 7])  # 6-8
    cache.take_events()
    return pool, cache


def test_evicting_many_at_once_equals_evicting_one_at_a_time() -> None:
    # One cut per leaf must take the same blocks, in the same order, into the same free-queue places.
    for num_blocks in (1, 3, 5, 7, 9, 20):
        bulk_pool, bulk = _cache_with_three_leaves()
        assert bulk.evict(num_blocks) == min(num_blocks, 9)
        bulk_hashes = [h for event in bulk.take_events() for h in event.block_hashes]
        one_pool, one = _cache_with_three_leaves()
        freed = sum(one.evict(1) for _ in range(num_blocks))
        one_hashes = [h for event in one.take_events() for h in event.block_hashes]
        assert freed == min(num_blocks, 9)
        assert bulk_hashes == one_hashes
        assert bulk_pool.free_block_ids() == one_pool.free_block_ids()
        assert [(e.block_hashes, e.parent_hash) for e in bulk.snapshot()] == [
            (e.block_hashes, e.parent_hash) for e in one.snapshot()]  # the same tree (seqs differ: more events)
        bulk.check_invariants()
        one.check_invariants()
    pool, cache = _cache_with_three_leaves()
    cache.evict(3)  # the least recent leaf is [7, 8] (blocks 2, 3), then [9, 9, 8, 8]'s deepest block
    assert [h for event in cache.take_events() for h in event.block_hashes] == [
        hashes([1, 2, 3, 4, 5, 6, 7, 8])[3], hashes([1, 2, 3, 4, 5, 6, 7, 8])[2], hashes([1, 2, 3, 4, 9, 9, 8, 8])[3]]
