"""Property tests: random operation sequences through BlockPool and RadixCache against simple models."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvbaton.cache.block_pool import BlockPool
from kvbaton.cache.events import KVEvent, KVEventKind
from kvbaton.cache.hashing import CacheKey, hash_block_tokens
from kvbaton.cache.radix_cache import RadixCache
from kvbaton.core.errors import CapacityError

BLOCK_SIZE = 2
NUM_BLOCKS = 12
KEYS = (CacheKey("rev", "layout", "tenant-a"), CacheKey("rev", "layout", "tenant-b"))
# Two token values and 2-token blocks: 4 distinct blocks, so prefixes are shared and split often.
TOKENS = st.lists(st.integers(0, 1), max_size=10)
MACHINE_SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None)


class BlockPoolMachine(RuleBasedStateMachine):
    """The pool against a model: a ref-count dict and the free queue as a plain list."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.refs = [0] * NUM_BLOCKS
        self.free_queue = list(range(NUM_BLOCKS))

    def held(self) -> list[int]:
        return [block_id for block_id, count in enumerate(self.refs) if count > 0]

    @rule(num_blocks=st.integers(0, NUM_BLOCKS))
    def allocate(self, num_blocks: int) -> None:
        if num_blocks > len(self.free_queue):
            with pytest.raises(CapacityError):
                self.pool.allocate(num_blocks)
            return
        expected, self.free_queue = self.free_queue[:num_blocks], self.free_queue[num_blocks:]
        assert self.pool.allocate(num_blocks) == expected
        for block_id in expected:
            self.refs[block_id] = 1

    @precondition(lambda self: self.held())
    @rule(data=st.data())
    def ref(self, data: st.DataObject) -> None:
        block_ids = data.draw(st.lists(st.sampled_from(self.held()), max_size=4))
        self.pool.ref(block_ids)
        for block_id in block_ids:
            self.refs[block_id] += 1

    @precondition(lambda self: self.held())
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        block_ids = data.draw(st.lists(st.sampled_from(self.held()), max_size=4))
        if any(self.refs[b] < n for b, n in Counter(block_ids).items()):
            try:
                self.pool.release(block_ids)
            except ValueError:
                return
            raise AssertionError("over-release succeeded")
        self.pool.release(block_ids)
        for block_id in block_ids:
            self.refs[block_id] -= 1
            if self.refs[block_id] == 0:
                self.free_queue.append(block_id)

    @precondition(lambda self: self.free_queue)
    @rule(data=st.data())
    def misuse_free_block(self, data: st.DataObject) -> None:
        block_id = data.draw(st.sampled_from(self.free_queue))
        for operation in (self.pool.ref, self.pool.release):
            try:
                operation([block_id])
            except ValueError:
                continue
            raise AssertionError(f"{operation.__name__} of a free block succeeded")

    @invariant()
    def matches_model(self) -> None:
        self.pool.check_invariants()
        assert self.pool.free_block_ids() == self.free_queue
        assert [self.pool.ref_count(i) for i in range(NUM_BLOCKS)] == self.refs


@dataclass(slots=True)
class SimRequest:
    key: CacheKey
    token_ids: list[int]  # full blocks only
    block_ids: list[int]  # one reference held on each
    node: object  # the locked node
    locked_hashes: tuple[int, ...]  # hashes the lock pins: must never be evicted


class RadixCacheMachine(RuleBasedStateMachine):
    """Requests that match, lock, allocate, insert, finish; a router-like mirror built only from events."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.cache = RadixCache(self.pool, BLOCK_SIZE)
        self.requests: list[SimRequest] = []
        self.mirror: set[int] = set()  # hashes the event stream says are cached
        self.block_of_hash: dict[int, int] = {}
        self.last_seq = 0

    def expected_match(self, key: CacheKey, token_ids: list[int]) -> list[int]:
        block_ids: list[int] = []
        for block_hash in hash_block_tokens(key, token_ids, BLOCK_SIZE):
            if block_hash not in self.mirror:
                break
            block_ids.append(self.block_of_hash[block_hash])
        return block_ids

    def apply_events(self) -> None:
        for event in self.cache.take_events():
            assert event.seq == self.last_seq + 1, "event seq gap"
            self.last_seq = event.seq
            if event.kind is KVEventKind.STORED:
                assert event.parent_hash in self.mirror or event.parent_hash in {k.root_hash for k in KEYS}
                assert self.mirror.isdisjoint(event.block_hashes), "stored twice"
                self.mirror.update(event.block_hashes)
            elif event.kind is KVEventKind.EVICTED:
                assert set(event.block_hashes) <= self.mirror, "evicted what was not stored"
                self.mirror.difference_update(event.block_hashes)
            else:
                self.mirror.clear()
        for request in self.requests:
            assert self.mirror.issuperset(request.locked_hashes), "a locked block was evicted"

    @rule(key=st.sampled_from(KEYS), token_ids=TOKENS)
    def start_request(self, key: CacheKey, token_ids: list[int]) -> None:
        token_ids = token_ids[: len(token_ids) // BLOCK_SIZE * BLOCK_SIZE]
        match = self.cache.match_prefix(key, token_ids)
        assert list(match.block_ids) == self.expected_match(key, token_ids)
        self.pool.ref(match.block_ids)
        self.cache.lock(match.node)
        num_new_blocks = len(token_ids) // BLOCK_SIZE - match.num_blocks
        if not self.pool.can_allocate(num_new_blocks):
            self.cache.evict(num_new_blocks - self.pool.num_free_blocks)
        if not self.pool.can_allocate(num_new_blocks):  # does not fit: give everything back
            self.pool.release(match.block_ids)
            self.cache.unlock(match.node)
            self.apply_events()
            return
        block_ids = list(match.block_ids) + self.pool.allocate(num_new_blocks)
        self.requests.append(SimRequest(key, token_ids, block_ids, match.node, match.block_hashes))
        self.apply_events()

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), adopt_canonical=st.booleans())
    def finish_prefill(self, data: st.DataObject, adopt_canonical: bool) -> None:
        request = data.draw(st.sampled_from(self.requests))
        match = self.cache.insert(request.key, request.token_ids, request.block_ids)
        self.cache.lock(match.node)
        self.cache.unlock(request.node)
        request.node, request.locked_hashes = match.node, match.block_hashes
        for block_id, block_hash in zip(match.block_ids, match.block_hashes):
            self.block_of_hash[block_hash] = block_id
        self.apply_events()
        assert list(match.block_ids) == self.expected_match(request.key, request.token_ids)
        if adopt_canonical:  # swap the request's duplicates for the cached blocks
            self.pool.ref(match.block_ids)
            self.pool.release(request.block_ids)
            request.block_ids = list(match.block_ids)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish_request(self, data: st.DataObject) -> None:
        request = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
        self.pool.release(request.block_ids)
        self.cache.unlock(request.node)

    @rule(num_blocks=st.integers(0, 6))
    def evict(self, num_blocks: int) -> None:
        num_free_before = self.pool.num_free_blocks
        num_freed = self.cache.evict(num_blocks)
        assert num_freed <= num_blocks
        assert self.pool.num_free_blocks == num_free_before + num_freed
        if num_freed < num_blocks:
            assert self.cache.num_evictable_blocks == 0
        self.apply_events()

    @rule(key=st.sampled_from(KEYS), token_ids=TOKENS)
    def peek(self, key: CacheKey, token_ids: list[int]) -> None:
        snapshot = self.cache.snapshot()
        match = self.cache.match_prefix(key, token_ids, touch=False)
        assert list(match.block_ids) == self.expected_match(key, token_ids)
        assert self.cache.snapshot() == snapshot

    @rule()
    def clear(self) -> None:
        num_cached_before = self.cache.num_cached_blocks
        num_freed = self.cache.clear()
        assert num_freed == num_cached_before - self.cache.num_cached_blocks
        assert self.cache.num_evictable_blocks == 0
        self.apply_events()

    @invariant()
    def consistent(self) -> None:
        self.cache.check_invariants()
        cached = {self.block_of_hash[h] for h in self.mirror}
        expected_refs = Counter(block_id for r in self.requests for block_id in r.block_ids)
        expected_refs.update(cached)
        assert [self.pool.ref_count(i) for i in range(NUM_BLOCKS)] == [expected_refs[i] for i in range(NUM_BLOCKS)]
        assert self.cache.num_cached_blocks == len(self.mirror)

    def teardown(self) -> None:
        for request in self.requests:
            self.pool.release(request.block_ids)
            self.cache.unlock(request.node)
        self.requests.clear()
        self.cache.check_invariants()
        cached = {self.block_of_hash[h] for h in self.mirror}
        for block_id in range(NUM_BLOCKS):
            assert self.pool.ref_count(block_id) == (1 if block_id in cached else 0)
        assert self.cache.num_evictable_blocks == self.cache.num_cached_blocks
        num_cached_blocks = self.cache.num_cached_blocks
        assert num_cached_blocks == NUM_BLOCKS - self.pool.num_free_blocks
        assert self.cache.clear() == num_cached_blocks
        assert self.pool.num_free_blocks == NUM_BLOCKS and self.cache.num_cached_blocks == 0
        self.cache.check_invariants()


TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = MACHINE_SETTINGS
TestRadixCacheMachine = RadixCacheMachine.TestCase
TestRadixCacheMachine.settings = MACHINE_SETTINGS


def run_scripted_workload(seed: int) -> tuple[list[KVEvent], list[int]]:
    """A seeded mix of requests, inserts, evictions and releases; returns the events and the free queue."""
    rng = random.Random(seed)
    pool = BlockPool(64)
    cache = RadixCache(pool, BLOCK_SIZE)
    held: list[tuple[list[int], object]] = []
    for _ in range(300):
        key = KEYS[rng.randrange(2)]
        token_ids = [rng.randrange(3) for _ in range(2 * rng.randrange(1, 6))]
        match = cache.match_prefix(key, token_ids)
        pool.ref(match.block_ids)
        cache.lock(match.node)
        num_new_blocks = len(token_ids) // BLOCK_SIZE - match.num_blocks
        cache.evict(max(0, num_new_blocks - pool.num_free_blocks))
        if pool.can_allocate(num_new_blocks):
            block_ids = list(match.block_ids) + pool.allocate(num_new_blocks)
            inserted = cache.insert(key, token_ids, block_ids)
            cache.lock(inserted.node)
            held.append((block_ids, inserted.node))
        else:
            pool.release(match.block_ids)
        cache.unlock(match.node)
        while held and (len(held) > 4 or rng.random() < 0.4):
            block_ids, node = held.pop(rng.randrange(len(held)))
            pool.release(block_ids)
            cache.unlock(node)
    cache.check_invariants()
    return cache.take_events(), pool.free_block_ids()


def test_same_operations_give_same_events_and_eviction_order() -> None:
    for seed in range(3):
        first_events, first_free = run_scripted_workload(seed)
        assert any(e.kind is KVEventKind.EVICTED for e in first_events), "workload must exercise eviction"
        assert run_scripted_workload(seed) == (first_events, first_free)
