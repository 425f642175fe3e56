"""HostTier alone (demote, match, take, load, put_back, discard, clear, LRU drops) and RadixCache with a tier."""

from __future__ import annotations

import pytest

from kvbaton.cache.block_pool import BlockPool
from kvbaton.cache.events import KVEvent, KVEventKind
from kvbaton.cache.hashing import CacheKey, chain_hashes, hash_block_tokens
from kvbaton.cache.host_tier import EvictedBlock, HostTier
from kvbaton.cache.radix_cache import RadixCache
from kvbaton.cache.radix_node import PrefixMatch

BLOCK_SIZE = 2
KEY = CacheKey("rev-a", "layout-a")
ROOT = KEY.root_hash
CHAIN = [(1, 1), (2, 2), (3, 3), (4, 4)]  # blocks A, B, C, D of one prefix
H = chain_hashes(ROOT, CHAIN)  # H[i]: chained hash of CHAIN[i]
OTHER = (5, 5)  # a one-block prefix of its own
H_OTHER = chain_hashes(ROOT, [OTHER])[0]


class RecordingIO:
    """A `TierIO` that logs every call and copies block contents (any value) between two dicts."""

    def __init__(self) -> None:
        self.device: dict[int, object] = {}
        self.host: dict[int, object] = {}
        self.calls: list[tuple[str, list[int], list[int]]] = []

    def save(self, device_block_ids: list[int], host_block_ids: list[int]) -> None:
        _check_copy(device_block_ids, host_block_ids)
        self.calls.append(("save", list(device_block_ids), list(host_block_ids)))
        for device_block_id, host_block_id in zip(device_block_ids, host_block_ids):
            self.host[host_block_id] = self.device.get(device_block_id)

    def load(self, host_block_ids: list[int], device_block_ids: list[int]) -> None:
        _check_copy(device_block_ids, host_block_ids)
        self.calls.append(("load", list(host_block_ids), list(device_block_ids)))
        for host_block_id, device_block_id in zip(host_block_ids, device_block_ids):
            self.device[device_block_id] = self.host[host_block_id]


def _check_copy(device_block_ids: list[int], host_block_ids: list[int]) -> None:
    assert len(device_block_ids) == len(host_block_ids) > 0
    assert len(set(device_block_ids)) == len(device_block_ids), "a device block copied twice in one call"
    assert len(set(host_block_ids)) == len(host_block_ids), "a host block written twice in one call"


def make_tier(num_blocks: int) -> tuple[RecordingIO, HostTier]:
    io = RecordingIO()
    return io, HostTier(num_blocks, io)


def evicted(index: int, device_block_id: int) -> EvictedBlock:
    """Block `index` of CHAIN, evicted from `device_block_id`."""
    return EvictedBlock(H[index], CHAIN[index], H[index - 1] if index else ROOT, device_block_id)


def evicted_other(device_block_id: int) -> EvictedBlock:
    return EvictedBlock(H_OTHER, OTHER, ROOT, device_block_id)


# ---- HostTier alone ---------------------------------------------------------------------------------


def test_tier_needs_a_positive_size() -> None:
    with pytest.raises(ValueError, match="positive"):
        HostTier(0, RecordingIO())


def test_demote_saves_blocks_in_one_call() -> None:
    io, tier = make_tier(4)
    io.device = {10: "kv-B", 11: "kv-A"}
    assert tier.demote([evicted(1, 10), evicted(0, 11)]) == []  # eviction order: deepest first
    assert io.calls == [("save", [10, 11], [0, 1])]
    assert io.host == {0: "kv-B", 1: "kv-A"}
    assert tier.num_cached_blocks == 2 and tier.num_saved_blocks == 2 and tier.num_dropped_blocks == 0
    assert H[0] in tier and H[1] in tier and H[2] not in tier
    assert tier.stored() == [(H[0], ROOT), (H[1], H[0])]  # most recently demoted first
    tier.check_invariants(set())


def test_full_tier_drops_the_least_recently_demoted_block_first() -> None:
    io, tier = make_tier(2)
    assert tier.demote([evicted(1, 10), evicted(0, 11)]) == []
    assert tier.demote([evicted(2, 12)]) == [H[1]]  # B was demoted before A
    assert io.calls[-1] == ("save", [12], [0])  # into B's host block
    assert tier.demote([evicted(3, 13)]) == [H[0]]
    assert io.calls[-1] == ("save", [13], [1])
    assert tier.stored() == [(H[3], H[2]), (H[2], H[1])]
    assert tier.num_dropped_blocks == 2 and tier.num_saved_blocks == 4
    tier.check_invariants(set())


def test_a_block_dropped_in_the_same_call_is_never_copied() -> None:
    io, tier = make_tier(2)
    io.device = {10: "kv-A", 11: "kv-B", 12: "kv-C"}
    assert tier.demote([evicted(2, 12), evicted(1, 11), evicted(0, 10)]) == [H[2]]
    assert io.calls == [("save", [11, 10], [1, 0])]  # C's copy into host block 0 was withdrawn
    assert io.host == {0: "kv-A", 1: "kv-B"}
    assert tier.stored() == [(H[0], ROOT), (H[1], H[0])]
    tier.check_invariants(set())


def test_a_one_block_tier_copies_only_the_last_block_of_a_call() -> None:
    io, tier = make_tier(1)
    io.device = {10: "kv-A", 11: "kv-B", 12: "kv-C"}
    assert tier.demote([evicted(2, 12), evicted(1, 11), evicted(0, 10)]) == [H[2], H[1]]
    assert io.calls == [("save", [10], [0])]
    assert io.host == {0: "kv-A"} and tier.stored() == [(H[0], ROOT)]
    assert tier.num_saved_blocks == 1 and tier.num_dropped_blocks == 2
    tier.check_invariants(set())


def test_demote_skips_a_block_already_held() -> None:
    io, tier = make_tier(2)
    tier.demote([evicted(0, 10)])
    assert tier.demote([evicted(0, 20)]) == []
    assert io.calls == [("save", [10], [0])] and tier.num_cached_blocks == 1
    tier.check_invariants(set())


def test_with_every_host_block_taken_new_blocks_are_dropped_uncopied() -> None:
    io, tier = make_tier(2)
    tier.demote([evicted(1, 11), evicted(0, 10)])
    assert tier.take(ROOT, CHAIN[:2]) == [H[0], H[1]]
    assert tier.demote([evicted(2, 12)]) == [H[2]]  # taken blocks are never dropped
    assert len(io.calls) == 1 and tier.num_cached_blocks == 0
    tier.check_invariants(set())
    tier.put_back([H[0], H[1]])
    assert tier.match(ROOT, CHAIN) == 2
    tier.check_invariants(set())


def test_match_follows_one_chain_and_changes_nothing() -> None:
    io, tier = make_tier(4)
    tier.demote([evicted(2, 12), evicted(1, 11), evicted(0, 10)])
    stored = tier.stored()
    assert tier.match(ROOT, CHAIN) == 3  # D is not held
    assert tier.match(ROOT, CHAIN[:2]) == 2
    assert tier.match(H[0], CHAIN[1:]) == 2  # continuing a device match that ended at A
    assert tier.match(ROOT, CHAIN[1:]) == 0  # B after the root is another prefix
    assert tier.match(ROOT, [CHAIN[0], CHAIN[3], CHAIN[2]]) == 1
    assert tier.match(ROOT, []) == 0
    assert tier.match(ROOT, CHAIN[:3], [H[0]]) == 3  # the caller's hashes, then computed ones
    assert tier.match(ROOT, [CHAIN[0], (9, 9)], [H[0], H[1]]) == 1  # H[1] is held, for other tokens
    assert tier.stored() == stored and len(io.calls) == 1
    tier.discard([H[1]])
    assert tier.match(ROOT, CHAIN) == 1  # stops at the missing block even though C is held


def test_take_and_load_move_blocks_to_the_device_and_free_their_host_blocks() -> None:
    io, tier = make_tier(3)
    io.device = {10: "kv-A", 11: "kv-B", 12: "kv-C"}
    tier.demote([evicted(2, 12), evicted(1, 11), evicted(0, 10)])  # host blocks C:0, B:1, A:2
    assert tier.take(ROOT, [CHAIN[0], CHAIN[1], (9, 9)]) == [H[0], H[1]]
    assert tier.num_cached_blocks == 1 and H[0] not in tier and tier.match(ROOT, CHAIN) == 0
    tier.check_invariants(set())  # taken blocks are neither free nor lost
    tier.load([H[0], H[1]], [20, 21])
    assert io.calls[-1] == ("load", [2, 1], [20, 21])
    assert io.device[20] == "kv-A" and io.device[21] == "kv-B"
    assert tier.num_loaded_blocks == 2
    tier.check_invariants({H[0], H[1]})  # on the device now, and no longer here
    assert tier.demote([evicted(3, 13), evicted_other(14)]) == []  # the freed host blocks are reused
    assert io.calls[-1] == ("save", [13, 14], [1, 2])
    tier.check_invariants({H[0], H[1]})


def test_put_back_makes_blocks_most_recent_with_the_head_last() -> None:
    io, tier = make_tier(3)
    tier.demote([evicted_other(9)])
    tier.demote([evicted(1, 11), evicted(0, 10)])
    taken = tier.take(ROOT, CHAIN)
    assert taken == [H[0], H[1]] and tier.stored() == [(H_OTHER, ROOT)]
    tier.put_back(taken)
    assert tier.stored() == [(H[0], ROOT), (H[1], H[0]), (H_OTHER, ROOT)]
    assert tier.demote([evicted(2, 12)]) == [H_OTHER]  # older than the put-back chain
    assert tier.demote([evicted(3, 13)]) == [H[1]]  # then the chain's tail before its head
    assert tier.stored() == [(H[3], H[2]), (H[2], H[1]), (H[0], ROOT)]
    tier.check_invariants(set())


def test_discard_frees_host_blocks_without_a_copy() -> None:
    io, tier = make_tier(2)
    tier.demote([evicted(1, 11), evicted(0, 10)])  # B:0, A:1
    tier.discard([H[1], H_OTHER])  # an unknown hash is ignored
    assert tier.stored() == [(H[0], ROOT)] and len(io.calls) == 1 and tier.num_dropped_blocks == 0
    assert tier.demote([evicted(2, 12)]) == []
    assert io.calls[-1] == ("save", [12], [0])
    tier.check_invariants(set())


def test_clear_drops_entries_but_leaves_taken_blocks_taken() -> None:
    io, tier = make_tier(3)
    tier.demote([evicted(1, 11), evicted(0, 10)])
    tier.demote([evicted_other(12)])
    assert tier.take(ROOT, CHAIN[:1]) == [H[0]]
    assert tier.clear() == [H[1], H_OTHER]  # oldest first
    assert tier.num_cached_blocks == 0 and tier.stored() == []
    tier.check_invariants(set())
    tier.put_back([H[0]])
    assert tier.stored() == [(H[0], ROOT)]
    tier.check_invariants(set())


def test_check_invariants_catches_a_block_in_both_tiers_and_a_wrong_hash() -> None:
    _, tier = make_tier(2)
    tier.demote([evicted(0, 10)])
    with pytest.raises(AssertionError, match="both tiers"):
        tier.check_invariants({H[0]})
    tier.demote([EvictedBlock(12345, CHAIN[1], H[0], 11)])
    with pytest.raises(AssertionError, match="wrong chained hash"):
        tier.check_invariants(set())


# ---- RadixCache with a tier ---------------------------------------------------------------------------


TOKENS = [1, 2, 3, 4, 5, 6]  # three blocks
T = hash_block_tokens(KEY, TOKENS, BLOCK_SIZE)


def make_cache(num_blocks: int = 8, num_host_blocks: int = 4) -> tuple[BlockPool, RadixCache, HostTier, RecordingIO]:
    pool = BlockPool(num_blocks)
    io, tier = make_tier(num_host_blocks)
    return pool, RadixCache(pool, BLOCK_SIZE, tier), tier, io


def cache_tokens(pool: BlockPool, cache: RadixCache, tokens: list[int], key: CacheKey = KEY) -> PrefixMatch:
    """Act like a finished request: allocate its blocks, insert them, drop its own references."""
    block_ids = pool.allocate(len(tokens) // BLOCK_SIZE)
    match = cache.insert(key, tokens, block_ids)
    pool.release(block_ids)
    return match


def test_evict_demotes_the_trimmed_blocks_without_an_evicted_event() -> None:
    pool, cache, tier, io = make_cache()
    assert cache_tokens(pool, cache, TOKENS).block_ids == (0, 1, 2)
    cache.take_events()
    assert cache.evict(2) == 2
    assert io.calls == [("save", [2, 1], [0, 1])]  # copied before anything can reuse blocks 1 and 2
    assert cache.take_events() == []  # the worker still serves them
    assert tier.stored() == [(T[1], T[0]), (T[2], T[1])]
    assert cache.match_prefix(KEY, TOKENS, touch=False).block_ids == (0,)
    assert tier.match(T[0], [(3, 4), (5, 6)], namespace=KEY) == 2  # the tier continues the device match
    assert tier.match(T[0], [(3, 4), (5, 6)], namespace=KEY.with_tenant("other")) == 0  # only under their key
    assert pool.num_free_blocks == 7
    cache.check_invariants()


def test_evicted_event_lists_only_blocks_that_left_both_tiers() -> None:
    pool, cache, tier, io = make_cache(num_host_blocks=1)
    cache_tokens(pool, cache, TOKENS)
    cache.take_events()
    assert cache.evict(3) == 3
    (event,) = cache.take_events()
    assert event.kind is KVEventKind.EVICTED and event.block_hashes == (T[2], T[1])
    assert io.calls == [("save", [0], [0])]  # only the block that stayed was copied
    assert tier.stored() == [(T[0], ROOT)]
    assert cache.num_cached_blocks == 0 and pool.num_free_blocks == 8
    cache.check_invariants()


def test_inserting_a_demoted_prefix_again_discards_it_from_the_tier() -> None:
    pool, cache, tier, _ = make_cache()
    cache_tokens(pool, cache, TOKENS)
    cache.evict(3)
    cache.take_events()
    assert tier.num_cached_blocks == 3
    cache_tokens(pool, cache, TOKENS[:4])  # computed again on the device
    assert tier.stored() == [(T[2], T[1])]
    assert [(e.kind, e.block_hashes, e.parent_hash) for e in cache.take_events()] == [
        (KVEventKind.STORED, (T[0], T[1]), ROOT)]
    cache.check_invariants()  # exclusive: no hash in both tiers
    cache_tokens(pool, cache, TOKENS)
    assert tier.num_cached_blocks == 0
    cache.check_invariants()


def test_snapshot_lists_the_tiers_blocks_after_the_tree() -> None:
    pool, cache, tier, _ = make_cache()
    cache_tokens(pool, cache, TOKENS)
    cache.evict(2)  # demotes C, then B
    seq = cache.last_seq
    assert cache.snapshot() == [
        KVEvent(seq, KVEventKind.STORED, (T[0],), ROOT, BLOCK_SIZE),
        KVEvent(seq, KVEventKind.STORED, (T[1],), T[0], BLOCK_SIZE),
        KVEvent(seq, KVEventKind.STORED, (T[2],), T[1], BLOCK_SIZE),
    ]


def test_clear_empties_both_tiers_without_copying() -> None:
    pool, cache, tier, io = make_cache()
    cache_tokens(pool, cache, TOKENS)
    cache.evict(1)
    cache.take_events()
    assert cache.clear() == 2
    assert cache.take_events() == [KVEvent(cache.last_seq, KVEventKind.CLEARED, (), None, BLOCK_SIZE)]
    assert tier.num_cached_blocks == 0 and len(io.calls) == 1 and pool.num_free_blocks == 8
    cache.check_invariants()
    assert cache.clear() == 0 and cache.take_events() == []


def test_clear_with_locked_blocks_reports_both_tiers_hashes() -> None:
    pool, cache, tier, io = make_cache()
    cache_tokens(pool, cache, TOKENS)
    match = cache.match_prefix(KEY, TOKENS[:2])
    pool.ref(match.block_ids)
    cache.lock(match.node)
    cache.evict(1)  # C to the tier
    cache.take_events()
    assert cache.clear() == 1
    (event,) = cache.take_events()
    assert event.kind is KVEventKind.EVICTED and event.block_hashes == (T[1], T[2])
    assert tier.num_cached_blocks == 0 and len(io.calls) == 1
    assert cache.num_cached_blocks == 1
    cache.check_invariants()
    pool.release(match.block_ids)
    cache.unlock(match.node)
    cache.check_invariants()


def test_a_block_with_the_same_hash_and_tokens_under_another_key_is_no_hit() -> None:
    # A chained hash is 64 bits of Python's tuple hash: two tenants' blocks may share one, by chance or crafted. The
    # tier holds tenant A's block under hash H[0]; tenant B presents the same tokens and claims the same hash
    # (as a caller passing its own hashes can): it must find nothing, and take nothing.
    _, tier = make_tier(4)
    alice, bob = KEY.with_tenant("alice"), KEY.with_tenant("bob")
    tier.demote([EvictedBlock(H[0], CHAIN[0], ROOT, 10, alice)])
    assert tier.match(ROOT, CHAIN[:1], [H[0]], namespace=bob) == 0
    assert tier.take(ROOT, CHAIN[:1], [H[0]], namespace=bob) == [] and H[0] in tier
    assert tier.match(ROOT, CHAIN[:1], [H[0]], namespace=alice) == 1


def test_blocks_demoted_by_the_radix_cache_carry_their_trees_key() -> None:
    pool, cache, tier, _ = make_cache()
    alice = KEY.with_tenant("alice")
    cache_tokens(pool, cache, [t for block in CHAIN[:2] for t in block], key=alice)
    cache.evict(2)
    assert tier.stored() and {entry.namespace for entry in tier._entries.values()} == {alice}
    assert tier.match(alice.root_hash, CHAIN[:2], namespace=alice) == 2
    assert tier.match(alice.root_hash, CHAIN[:2], namespace=KEY) == 0
