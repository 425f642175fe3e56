"""RadixCache.insert_from: same cached blocks, events, LRU order and block ids as re-inserting the whole prefix
(its tree may hold them in fewer nodes: it grows a node its caller alone locks).

The `*_blocks` variants (the sequence pre-split into token tuples) must match the token-list calls exactly.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbaton.cache.block_pool import BlockPool
from kvbaton.cache.events import KVEvent
from kvbaton.cache.hashing import CacheKey
from kvbaton.cache.radix_cache import RadixCache

BLOCK_SIZE = 2
NUM_BLOCKS = 24
KEY = CacheKey("rev-a", "layout-a")


class _World:
    """Requests that grow block by block, caching each full block the way the block manager does.

    `incremental` picks insert_from(held node, new blocks) over insert(whole prefix); everything
    else (the op sequence, admissions, evictions) is identical, so two worlds must stay identical.
    """

    def __init__(self, incremental: bool, use_blocks: bool = False, grow: bool = False) -> None:
        self.incremental = incremental
        self.use_blocks = use_blocks  # call match_prefix_blocks / insert_blocks / insert_from_blocks
        self.grow = grow  # insert_from(..., grow=True): the held node grows when this request alone locks it
        self.pool = BlockPool(NUM_BLOCKS)
        self.cache = RadixCache(self.pool, BLOCK_SIZE)
        self.tokens: dict[int, list[int]] = {}
        self.block_ids: dict[int, list[int]] = {}
        self.num_cached_blocks: dict[int, int] = {}  # blocks under the held (locked) node
        self.holds: dict[int, object] = {}

    def admit(self, rid: int, tokens: list[int]) -> bool:
        num_blocks = len(tokens) // BLOCK_SIZE
        if self.use_blocks:
            match = self.cache.match_prefix_blocks(KEY, _blocks(tokens[: (num_blocks - 1) * BLOCK_SIZE]))
        else:
            match = self.cache.match_prefix(KEY, tokens[: (num_blocks - 1) * BLOCK_SIZE])
        self.pool.ref(match.block_ids)  # take the hit (ref + lock) before evicting for the rest
        self.cache.lock(match.node)
        shortfall = num_blocks - match.num_blocks - self.pool.num_free_blocks
        if shortfall > 0:
            self.cache.evict(shortfall)
        if not self.pool.can_allocate(num_blocks - match.num_blocks):
            self.pool.release(match.block_ids)
            self.cache.unlock(match.node)
            return False
        if match.num_blocks:
            self.holds[rid] = match.node
        else:
            self.cache.unlock(match.node)  # the root: nothing cached to hold
        self.tokens[rid] = tokens
        self.block_ids[rid] = list(match.block_ids) + self.pool.allocate(num_blocks - match.num_blocks)
        self.num_cached_blocks[rid] = match.num_blocks
        return True

    def cache_next_block(self, rid: int) -> tuple[int, ...]:
        done = self.num_cached_blocks[rid]
        num_full = done + 1
        hold = self.holds.get(rid)
        if self.incremental and hold is not None:
            tokens = self.tokens[rid][done * BLOCK_SIZE : num_full * BLOCK_SIZE]
            if self.use_blocks:
                match = self.cache.insert_from_blocks(hold, _blocks(tokens), self.block_ids[rid][done:num_full],
                                                      grow=self.grow)
            else:
                match = self.cache.insert_from(hold, tokens, self.block_ids[rid][done:num_full], grow=self.grow)
        else:
            tokens = self.tokens[rid][: num_full * BLOCK_SIZE]
            if self.use_blocks:
                match = self.cache.insert_blocks(KEY, _blocks(tokens), self.block_ids[rid][:num_full])
            else:
                match = self.cache.insert(KEY, tokens, self.block_ids[rid][:num_full])
        self.cache.lock(match.node)
        if hold is not None:
            self.cache.unlock(hold)
        self.holds[rid] = match.node
        self.num_cached_blocks[rid] = num_full
        return match.block_ids[-1:]  # the block now cached at the new position (ours or a duplicate's)

    def finish(self, rid: int) -> None:
        self.pool.release(self.block_ids.pop(rid))
        hold = self.holds.pop(rid, None)
        if hold is not None:
            self.cache.unlock(hold)
        del self.tokens[rid], self.num_cached_blocks[rid]

    def state(self) -> tuple[object, ...]:
        self.cache.check_invariants()
        return (self.pool.free_block_ids(), self.cache.take_events(), _cached_blocks(self.cache.snapshot()),
                sorted(self.block_ids.items()))


def _cached_blocks(snapshot: list[KVEvent]) -> list[tuple[int, int | None, int]]:
    """A snapshot block by block: (hash, the hash before it, seq). Its events are one per node, and insert_from grows
    a node its caller alone locks where a whole-prefix insert adds a child: the same blocks in other runs."""
    blocks = []
    for event in snapshot:
        parent = event.parent_hash
        for block_hash in event.block_hashes:
            blocks.append((block_hash, parent, event.seq))
            parent = block_hash
    return sorted(blocks, key=lambda block: (block[0], block[1] or 0))


def _blocks(tokens: list[int]) -> list[tuple[int, ...]]:
    return [tuple(tokens[i : i + BLOCK_SIZE]) for i in range(0, len(tokens), BLOCK_SIZE)]


def _run(seed: int, use_blocks: bool = False, grow: bool = False) -> None:
    rng = random.Random(seed)
    full, incremental = _World(incremental=False), _World(incremental=True, use_blocks=use_blocks, grow=grow)
    next_rid = 0
    for _ in range(60):
        growable = sorted(rid for rid, n in full.num_cached_blocks.items() if n < len(full.block_ids[rid]))
        op = rng.random()
        if op < 0.3 or not full.tokens:
            tokens = [rng.randint(0, 1) for _ in range(BLOCK_SIZE * rng.randint(1, 6))]
            assert full.admit(next_rid, tokens) == incremental.admit(next_rid, tokens)
            next_rid += 1
        elif op < 0.75 and growable:
            rid = rng.choice(growable)
            assert full.cache_next_block(rid) == incremental.cache_next_block(rid)
        elif op < 0.9:
            rid = rng.choice(sorted(full.tokens))
            full.finish(rid)
            incremental.finish(rid)
        else:
            num_blocks = rng.randint(1, 4)
            assert full.cache.evict(num_blocks) == incremental.cache.evict(num_blocks)
        assert full.state() == incremental.state()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_insert_from_matches_whole_prefix_insert(seed: int) -> None:
    _run(seed)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_block_tuple_calls_match_token_list_calls(seed: int) -> None:
    _run(seed, use_blocks=True)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), use_blocks=st.booleans())
def test_growing_the_held_node_matches_whole_prefix_insert(seed: int, use_blocks: bool) -> None:
    """grow=True (a request's next blocks appended to the node it alone locks) leaves the same free queue, events,
    cached blocks and tables as inserting the whole prefix each time, evictions and shared prefixes between."""
    _run(seed, use_blocks=use_blocks, grow=True)


def test_grow_appends_to_a_leaf_only_its_caller_locks() -> None:
    pool = BlockPool(8)
    cache = RadixCache(pool, BLOCK_SIZE)
    mine = pool.allocate(4)
    first = cache.insert(KEY, [1, 2], mine[:1])
    cache.lock(first.node)
    grown = cache.insert_from(first.node, [3, 4], mine[1:2], grow=True)
    assert grown.node is first.node and grown.block_ids == (mine[1],)
    assert [e.block_hashes for e in cache.take_events()] == [first.block_hashes, grown.block_hashes]
    cache.lock(first.node)  # a second lock: the next blocks go below, in a node of their own
    below = cache.insert_from(first.node, [5, 6], mine[2:3], grow=True)
    assert below.node is not first.node
    cache.lock(below.node)
    cache.unlock(first.node)
    cache.unlock(first.node)
    cache.lock(first.node)  # alone again, but a node follows it now: no growth either
    assert cache.insert_from(first.node, [5, 6, 7, 8], mine[2:4], grow=True).node is not first.node
    assert cache.match_prefix(KEY, [1, 2, 3, 4, 5, 6, 7, 8], touch=False).block_ids == tuple(mine)
    cache.unlock(first.node)
    cache.unlock(below.node)
    pool.release(mine)
    cache.check_invariants()


def test_block_tuple_calls_reject_ragged_blocks_and_change_nothing() -> None:
    pool = BlockPool(8)
    cache = RadixCache(pool, BLOCK_SIZE)
    mine = pool.allocate(2)
    with pytest.raises(ValueError):
        cache.insert_blocks(KEY, [(1, 2), (3,)], mine)
    with pytest.raises(ValueError):
        cache.insert_blocks(KEY, [(1, 2)], mine)
    assert cache.num_cached_blocks == 0 and cache.take_events() == []
    cache.check_invariants()


def test_insert_from_extends_below_the_held_node_and_shares_cached_continuations() -> None:
    pool = BlockPool(8)
    cache = RadixCache(pool, BLOCK_SIZE)
    mine = pool.allocate(3)
    first = cache.insert(KEY, [1, 2], mine[:1])
    cache.lock(first.node)
    grown = cache.insert_from(first.node, [3, 4, 5, 6], mine[1:])
    assert grown.block_ids == (mine[1], mine[2]) and grown.num_blocks == 2
    assert cache.match_prefix(KEY, [1, 2, 3, 4, 5, 6]).block_ids == tuple(mine)
    # A second request with the same prefix keeps its own duplicate block; the cached one is returned.
    theirs = pool.allocate(1)
    cache.lock(grown.node)
    again = cache.insert_from(first.node, [3, 4], theirs)
    assert again.block_ids == (mine[1],) and pool.ref_count(theirs[0]) == 1
    cache.unlock(grown.node)
    cache.unlock(first.node)
    pool.release(mine + theirs)
    cache.check_invariants()


def test_insert_from_rejects_unlocked_stale_or_ragged_input_and_changes_nothing() -> None:
    pool = BlockPool(8)
    cache = RadixCache(pool, BLOCK_SIZE)
    mine = pool.allocate(2)
    first = cache.insert(KEY, [1, 2], mine[:1])
    with pytest.raises(ValueError, match="locked"):
        cache.insert_from(first.node, [3, 4], mine[1:])
    cache.lock(first.node)
    with pytest.raises(ValueError, match="do not fill"):
        cache.insert_from(first.node, [3, 4, 5], mine[1:])
    with pytest.raises(ValueError, match="already cached"):
        cache.insert_from(first.node, [3, 4], mine[:1])
    with pytest.raises(TypeError):
        cache.insert_from("not a node", [3, 4], mine[1:])
    assert cache.num_cached_blocks == 1 and len(cache.take_events()) == 1
    cache.unlock(first.node)
    pool.release(mine)
    cache.clear()
    with pytest.raises(ValueError, match="stale"):
        cache.insert_from(first.node, [3, 4], [0])
    cache.check_invariants()
