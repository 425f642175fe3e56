"""Per-request KV block tables on top of the block pool and the radix prefix cache.

Ownership rules this module keeps (the scheduler never touches the pool or cache directly):
  * a running request holds one pool ref on every block id in `request.block_ids`;
  * the cache holds its own ref on each cached block (taken by `RadixCache.insert`);
  * while a request holds blocks that are in the cache, it keeps the deepest cached node of its
    prefix locked, so eviction can never take a block it reads; the lock moves deeper as more of
    its blocks are cached and is dropped when its blocks are freed.
A waiting (or preempted) request holds no blocks, no refs and no lock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvbaton.cache.block_pool import BlockPool
from kvbaton.cache.hashing import CacheKey, HashedBlocks
from kvbaton.cache.radix_cache import RadixCache
from kvbaton.core.request import Request


def _tokens_between(request: Request, start: int, end: int) -> list[int]:
    """request.all_token_ids[start:end] without concatenating the whole prompt and output."""
    prompt, output = request.prompt_token_ids, request.output_token_ids
    n = len(prompt)
    if end <= n:
        return prompt[start:end]
    if start >= n:
        return output[start - n : end - n]
    return prompt[start:] + output[: end - n]


@dataclass(slots=True)
class _CacheHold:
    node: Any  # deepest cached node of the request's prefix; locked while held (an opaque handle)
    num_blocks: int  # leading blocks of the request's table known to be cached under `node`


class BlockManager:
    """Grows, caches and frees the block tables of running requests."""

    def __init__(self, pool: BlockPool, cache: RadixCache | None, cache_key: CacheKey, block_size: int) -> None:
        self.pool = pool
        self.cache = cache
        self.cache_key = cache_key
        self.block_size = block_size
        self._holds: dict[str, _CacheHold] = {}
        # Per request (with a cache attached): its full blocks' token tuples, built once and extended as
        # it grows, so cache probes, matches and inserts do not re-tuple the prompt. Tokens are
        # append-only, so the tuples stay valid; the entry goes with `free`.
        self._token_blocks: dict[str, list[tuple[int, ...]]] = {}
        # Per request seeded by its caller (`seed`): the chained hashes of its prompt's full blocks, passed
        # to the cache's inserts so the blocks it adopts are not hashed again. Goes with `free` too.
        self._prompt_hashes: dict[str, tuple[int, ...]] = {}
        # Per running request: (its block_ids list, that list as a tuple). Tables only grow in place by
        # `extend` or are replaced by a new list (here, `admit_prefilled`), never edited in place, so the tuple
        # is current while the list is the same object of the same length; a decode then reuses it instead of
        # copying a ~100-block table every step. Goes with `free`.
        self._tables: dict[str, tuple[list[int], tuple[int, ...]]] = {}

    def seed(self, request: Request, blocks: HashedBlocks) -> None:
        """Take the request's prompt already split and hashed (by the router's caller) instead of doing it again.

        Ignored without a cache, or when `blocks` was hashed under another key, tenant or block
        size; `blocks` must be `hash_prompt` of this request's prompt (its block count is checked).
        """
        if (self.cache is None or blocks.block_size != self.block_size
                or len(blocks.token_blocks) != request.num_prompt_tokens // self.block_size
                or blocks.key != self.cache_key.with_tenant(request.tenant)):
            return
        request_id = request.request_id
        if request_id not in self._token_blocks:
            self._token_blocks[request_id] = list(blocks.token_blocks)
        self._prompt_hashes[request_id] = blocks.block_hashes

    @property
    def holds(self) -> Mapping[str, _CacheHold]:
        """Read-only: per request holding cached blocks, its lock's node and how many of its blocks it covers."""
        return self._holds

    def table(self, request: Request) -> tuple[int, ...]:
        """tuple(request.block_ids), reused from the previous step while the table is unchanged."""
        block_ids = request.block_ids
        entry = self._tables.get(request.request_id)
        if entry is not None and entry[0] is block_ids and len(entry[1]) == len(block_ids):
            return entry[1]
        table = tuple(block_ids)
        self._tables[request.request_id] = (block_ids, table)
        return table

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _max_hit_blocks(self, request: Request) -> int:
        # At least one token must be computed so the step that finishes the prefill samples. A request that asks
        # for its prompt's logprobs computes every prompt position (as vLLM: it reads nothing from the cache).
        if request.sampling.prompt_logprobs is not None:
            return 0
        return (request.num_tokens - 1) // self.block_size

    def peek_cached_tokens(self, request: Request) -> int:
        """Tokens the cache would supply if `request` were admitted now; does not touch LRU order."""
        if self.cache is None:
            return 0
        num_blocks = self._max_hit_blocks(request)
        key = self.cache_key.with_tenant(request.tenant)
        token_blocks = self._blocks_of(request, num_blocks)
        match = self.cache.match_prefix_blocks(key, token_blocks, touch=False)
        num_hit = match.num_blocks
        tier = self.cache.tier
        if tier is not None and num_hit < num_blocks:  # the store supplies blocks too, at a load's cost
            parent_hash = match.block_hashes[-1] if num_hit else key.root_hash
            num_hit += tier.match(parent_hash, token_blocks[num_hit:],
                                  self._prompt_hashes.get(request.request_id, ())[num_hit:], key)
        return num_hit * self.block_size

    def attach_prefix(self, request: Request) -> int:
        """Seed an empty block table with the cached prefix of `request`; returns the hit in tokens.

        Takes the request's refs on the hit blocks and locks their deepest node, so a later
        eviction (to make room for the rest of this request) cannot take them.
        """
        assert not request.block_ids and request.num_computed_tokens == 0
        if self.cache is None:
            return 0
        num_blocks = self._max_hit_blocks(request)
        if num_blocks == 0:
            return 0
        key = self.cache_key.with_tenant(request.tenant)
        token_blocks = self._blocks_of(request, num_blocks)
        match = self.cache.match_prefix_blocks(key, token_blocks)
        if match.num_blocks:
            self.pool.ref(match.block_ids)
            self.cache.lock(match.node)
            self._holds[request.request_id] = _CacheHold(match.node, match.num_blocks)
            request.block_ids = list(match.block_ids)
            request.num_computed_tokens = match.num_blocks * self.block_size
        if self.cache.tier is not None and match.num_blocks < num_blocks:
            self._promote(request, key, match.block_hashes[-1] if match.num_blocks else key.root_hash,
                          token_blocks[match.num_blocks :])
        return request.num_computed_tokens

    def _promote(self, request: Request, key: CacheKey, parent_hash: int, token_blocks: list[tuple[int, ...]]) -> None:
        """`attach_prefix` past the device match: the blocks the store holds next are loaded into fresh device
        blocks (as many as the pool can give, evicting cached ones if short), cached on the device as if computed
        there, and join the request's table and hold."""
        cache, tier = self.cache, self.cache.tier  # type: ignore[union-attr]
        assert cache is not None and tier is not None
        num_device = len(request.block_ids)
        taken = tier.take(parent_hash, token_blocks, self._prompt_hashes.get(request.request_id, ())[num_device:],
                          key)
        if not taken:
            return
        # Pinned in the store first (`take`), so the blocks this eviction demotes to it cannot push them out.
        shortfall = len(taken) - self.pool.num_free_blocks
        if shortfall > 0:
            cache.evict(shortfall)
        num_loaded = min(len(taken), self.pool.num_free_blocks)
        tier.put_back(taken[num_loaded:])
        if not num_loaded:
            return
        block_ids = self.pool.allocate(num_loaded)  # the request's references
        tier.load(taken[:num_loaded], block_ids)
        hold = self._holds.get(request.request_id)
        if hold is None:
            match = cache.insert_blocks(key, token_blocks[:num_loaded], block_ids, taken)
        else:
            match = cache.insert_from_blocks(hold.node, token_blocks[:num_loaded], block_ids, taken, grow=True)
        self._hold_through(request.request_id, hold, match.node, num_device + num_loaded)
        request.block_ids = request.block_ids + block_ids
        request.num_computed_tokens = (num_device + num_loaded) * self.block_size

    def try_grow(self, request: Request, end_pos: int) -> bool:
        """Make the table cover positions [0, end_pos), evicting cached blocks if the pool is short.

        Returns False, allocating nothing, when even an eviction cannot free enough blocks; it then evicts nothing
        either, as it can tell beforehand: a refused admission (retried every step) must not flush the cache.
        """
        num_new = self.num_blocks_for(end_pos) - len(request.block_ids)
        if num_new <= 0:
            return True
        shortfall = num_new - self.pool.num_free_blocks
        if shortfall > 0:
            if self.cache is None or not self.cache.make_room(shortfall):
                return False
            if not self.pool.can_allocate(num_new):  # an evicted block still held elsewhere (a handoff leg's)
                return False
        request.block_ids.extend(self.pool.allocate(num_new))
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Insert the request's newly full, computed blocks into the cache and move its lock deeper."""
        if self.cache is None:
            return
        num_full = request.num_computed_tokens // self.block_size
        hold = self._holds.get(request.request_id)
        if num_full <= (hold.num_blocks if hold else 0):
            return
        # Positions already cached keep the cache's block, and the request swaps its duplicate for it below.
        hashes = self._prompt_hashes.get(request.request_id, ())
        if hold is None:
            key = self.cache_key.with_tenant(request.tenant)
            match = self.cache.insert_blocks(key, self._blocks_of(request, num_full), request.block_ids[:num_full],
                                             hashes)
        else:
            # Root..hold.node is exactly our first hold.num_blocks blocks and stays so while it is
            # locked (splits keep the handle at the tail; locked blocks are never trimmed), so only
            # the blocks after it need walking: same result as re-inserting the whole prefix.
            token_blocks = self._blocks_of(request, num_full, hold.num_blocks)
            match = self.cache.insert_from_blocks(hold.node, token_blocks, request.block_ids[hold.num_blocks : num_full],
                                                  hashes[hold.num_blocks : num_full], grow=True)
        self._hold_through(request.request_id, hold, match.node, num_full)
        # The blocks the cache already held come first in the inserted range (the walk matches from its start), so
        # the first one tells whether there are any.
        first = num_full - len(match.block_ids)
        if match.block_ids and match.block_ids[0] != request.block_ids[first]:
            self._share_cached_blocks(request, first, match.block_ids)

    def _hold_through(self, request_id: str, hold: _CacheHold | None, node: object, num_blocks: int) -> None:
        """The request's cached blocks now end at `node` (an insert's result): its lock moves there."""
        cache = self.cache
        assert cache is not None
        if hold is None:
            cache.lock(node)
            self._holds[request_id] = _CacheHold(node, num_blocks)
            return
        if node is not hold.node:  # else the cache grew the hold's node (the request's alone) in place
            cache.lock(node)  # lock the new node before unlocking the old: no evictable gap
            cache.unlock(hold.node)
            hold.node = node  # the hold moves deeper in place (it is the request's own record)
        hold.num_blocks = num_blocks

    def _share_cached_blocks(self, request: Request, first: int, cached_ids: tuple[int, ...]) -> None:
        """The cache already held some of the blocks the request just computed (another request computed the same
        prefix first): the request takes the cache's blocks at those positions and frees its duplicates, as
        SGLang's radix cache does. Its locked path is then exactly its own table's blocks, so one request never
        holds a position twice (a request alone in a full pool could otherwise never fit: its copy and the cache's
        locked one both count)."""
        table = list(request.block_ids)
        duplicates = []
        for position, cached_id in enumerate(cached_ids, first):
            if table[position] != cached_id:
                duplicates.append(table[position])
                table[position] = cached_id
        self.pool.ref([cached_id for cached_id, own in zip(cached_ids, request.block_ids[first:]) if cached_id != own])
        self.pool.release(duplicates)
        request.block_ids = table  # a new list: the scheduler's table cache sees the change

    def trim(self, request: Request) -> None:
        """Release the blocks past what `request`'s tokens need (a speculative step's rejected drafts grew the
        table beyond them). The table becomes a new list, as every table change but `extend` does."""
        keep = self.num_blocks_for(request.num_tokens)
        if len(request.block_ids) > keep:
            extra = request.block_ids[keep:]
            request.block_ids = request.block_ids[:keep]
            self.pool.release(extra)

    def free(self, request: Request) -> None:
        """Drop every ref and lock `request` holds; its table becomes empty and nothing is computed."""
        # Release before unlocking: an unlocked cached block must be held by the cache alone.
        if request.block_ids:
            self.pool.release(request.block_ids)
        hold = self._holds.pop(request.request_id, None)
        if hold is not None and self.cache is not None:
            self.cache.unlock(hold.node)
        self._token_blocks.pop(request.request_id, None)
        self._prompt_hashes.pop(request.request_id, None)
        self._tables.pop(request.request_id, None)
        request.block_ids = []
        request.num_computed_tokens = 0

    def _blocks_of(self, request: Request, num_blocks: int, first: int = 0) -> list[tuple[int, ...]]:
        """The token tuples of the request's full blocks `first` to `num_blocks` (a fresh list: a block filled by a
        decode copies the tuples after the cached ones, not the request's whole prefix)."""
        blocks = self._token_blocks.get(request.request_id)
        if blocks is None:
            blocks = self._token_blocks[request.request_id] = []
        if len(blocks) < num_blocks:
            size = self.block_size
            tokens = _tokens_between(request, len(blocks) * size, num_blocks * size)
            blocks.extend(zip(*[iter(tokens)] * size))  # consecutive size-token tuples, built in C
        return blocks[first:num_blocks]

    def num_cached_blocks_of(self, request_id: str) -> int:
        hold = self._holds.get(request_id)
        return hold.num_blocks if hold else 0

    def check_invariants(self, running: list[Request], max_draft_tokens: int = 0, num_outside_blocks: int = 0) -> None:
        """Tables cover computed tokens, hold live refs, and only running requests hold locks. A table may reach
        `max_draft_tokens` past its request's tokens (a speculative decode's drafts, between schedule and update).
        `num_outside_blocks`: pool blocks their owners hold outside the scheduler (KV store loads in flight)."""
        running_ids = {r.request_id for r in running}
        assert set(self._holds) <= running_ids, "a non-running request still holds a cache lock"
        held: set[int] = set()
        for r in running:
            assert len(set(r.block_ids)) == len(r.block_ids), f"{r.request_id}: duplicate block ids"
            assert len(r.block_ids) >= self.num_blocks_for(r.num_computed_tokens), f"{r.request_id}: table short"
            assert len(r.block_ids) <= self.num_blocks_for(r.num_tokens + max_draft_tokens), (
                f"{r.request_id}: table too long")
            for b in r.block_ids:
                assert self.pool.ref_count(b) >= 1, f"{r.request_id}: block {b} has no ref"
            assert self.num_cached_blocks_of(r.request_id) <= r.num_computed_tokens // self.block_size
            held.update(r.block_ids)
        num_cached = self.cache.num_cached_blocks if self.cache is not None else 0
        assert len(held) <= self.pool.num_used_blocks <= len(held) + num_cached + num_outside_blocks, "pool refs leak"
