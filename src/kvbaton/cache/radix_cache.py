"""Radix-tree prefix cache over block-aligned token ids, with LRU eviction of unlocked leaf blocks.

Ownership model (shared with `kvbaton.cache.block_pool`):
- the cache holds exactly ONE pool reference on every block it caches (taken by `insert`, dropped
  by `evict`/`clear`);
- a request holds its own reference on every block of its block table (the scheduler calls
  `pool.ref` on the blocks of a match) and `lock`s the deepest cached node it uses, which pins
  root..node against eviction;
- so a cached block in an unlocked node has ref count exactly 1 and evicting it frees it.
  `check_invariants` verifies this. Callers must therefore lock the node `insert` returns before
  anything else looks at the cache (while they still hold their own references on those blocks),
  and unlock only after (or together with) releasing their references.

Structure: one tree per CacheKey namespace; a root holds no blocks. A node holds a run of
consecutive full blocks (token tuples, block ids, chained hashes starting from `key.root_hash`);
its children are keyed by the token tuple of their first block. `insert` and a touching
`match_prefix` split a node where a match ends inside it, so a lock pins exactly the matched
blocks. The node object keeps the TAIL part on a split and the new node becomes its parent, so a
handle that is locked stays valid across later splits. Eviction only ever trims blocks from the
tail of an unlocked leaf; a leaf that becomes empty leaves the tree. Nodes are not merged back.
Hence a locked handle always ends exactly where it ended when taken, and `insert_from(node, ...)`
(a request caching its next full blocks) can walk on from it with the same effect as `insert` of
the whole sequence from the root. The one exception is asked for: with `insert_from(..., grow=True)`
the holder of a leaf's only lock, who moves that lock to the result, has the blocks appended to the
leaf itself (a request's chunks and decode blocks then make one node, not one each).

A `PrefixMatch` (and its node handle) is valid until the next `evict`/`clear` unless its node is
locked; locking a node that has left the tree raises ValueError.

Where the code lives: the node and `PrefixMatch` in `kvbaton.cache.radix_node`; the LRU order (the
logical tick, the heap of evictable leaves) in `kvbaton.cache.radix_lru`, an object the cache owns;
matching, locking, inserting, eviction, events and the invariant check here.

Eviction only ever trims blocks from the tail of the least recently used unlocked leaf; a leaf
that becomes empty leaves the tree (its parent may become evictable).

Events: `insert` emits one STORED event for the blocks it adopted; `evict` emits one EVICTED event
per call listing the hashes in eviction order; `clear` emits CLEARED when the cache ends up empty
and EVICTED (with the hashes) when locked blocks survive. Sequence numbers are 1, 2, 3, ...

The tier past the device (`tier`, `kvbaton.cache.tier`): a worker's view of the cluster KV store. Blocks an
insert adopts are written through to it (`on_cached`); evicted blocks are handed to `demote` before their device
blocks can be reused, and EVICTED lists what it returns (every evicted hash: the store is not exclusive); a
snapshot adds what its `stored` lists. `BlockManager.attach_prefix` loads the run its `match` finds.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from kvbaton.cache.block_pool import BlockPool
from kvbaton.cache.events import KVEvent, KVEventKind
from kvbaton.cache.hashing import CacheKey, chain_hashes, hash_block
from kvbaton.cache.radix_lru import LruLeaves
from kvbaton.cache.radix_node import BlockTokens, PrefixMatch, RadixNode
from kvbaton.cache.tier import CacheTier, EvictedBlock


class RadixCache:
    """Prefix cache over full blocks; see the module docstring for the ownership and lock rules."""

    def __init__(self, pool: BlockPool, block_size: int, tier: CacheTier | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.pool = pool
        self.block_size = block_size
        self.tier = tier
        self._roots: dict[CacheKey, RadixNode] = {}
        self._serials = itertools.count()
        self._lru = LruLeaves(self._roots)
        self._num_nodes = 0  # non-root nodes in all trees
        self._num_cached_blocks = 0
        self._num_locked_blocks = 0  # blocks in nodes with lock_ref > 0
        self._cached_block_ids: set[int] = set()
        self._seq = 0
        self._events: list[KVEvent] = []

    @property
    def num_cached_blocks(self) -> int:
        return self._num_cached_blocks

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks `evict` could free right now: those in nodes with no lock on them or below them."""
        return self._num_cached_blocks - self._num_locked_blocks

    def make_room(self, num_blocks: int) -> bool:
        """Evict `num_blocks` blocks if the unlocked leaves hold that many, else nothing: an allocation that
        cannot succeed anyway must not flush the cache. True when it evicted."""
        if num_blocks > self.num_evictable_blocks:
            return False
        self.evict(num_blocks)
        return True

    @property
    def last_seq(self) -> int:
        """Seq of the latest event emitted (taken or not); 0 before any. An empty snapshot is as of it."""
        return self._seq

    def match_prefix(self, key: CacheKey, token_ids: Sequence[int], *, touch: bool = True) -> PrefixMatch:
        """Longest cached prefix of the full blocks of `token_ids` under `key`; takes no refs or locks.

        touch=True marks the path as just used and splits the last node at the match end.
        touch=False changes nothing; its node is then the one holding the last matched block, which
        may hold more blocks, so locking it pins those too (safe, merely conservative).
        """
        return self.match_prefix_blocks(key, self._token_blocks(token_ids), touch=touch)

    def match_prefix_blocks(self, key: CacheKey, token_blocks: list[BlockTokens], *,
                            touch: bool = True) -> PrefixMatch:
        """`match_prefix` of a sequence already split into full blocks (a list of block_size-token tuples).

        For callers that keep a request's block tuples between calls instead of re-tupling its tokens.
        It must be a list (the walk compares list slices) and is not kept: the cache copies what it adopts.
        """
        node, num_in_node, block_ids, block_hashes = self._walk(self._root(key), token_blocks)
        if touch:
            if num_in_node < len(node.block_ids):
                node = self._split(node, num_in_node)
            self._lru.touch(node, self._num_nodes)
        return PrefixMatch(tuple(block_ids), tuple(block_hashes), node)

    def lock(self, node: object) -> None:
        """Pin root..node against eviction; locks nest and each needs one `unlock`."""
        radix_node = self._check_node(node)
        radix_node.num_direct_locks += 1
        current: RadixNode | None = radix_node
        while current is not None:
            current.lock_ref += 1
            if current.lock_ref == 1:
                self._num_locked_blocks += len(current.block_ids)
            current = current.parent

    def unlock(self, node: object) -> None:
        """Undo one `lock(node)`."""
        radix_node = self._check_node(node)
        if radix_node.num_direct_locks == 0:
            raise ValueError("unlock of a node that is not locked")
        radix_node.num_direct_locks -= 1
        current: RadixNode | None = radix_node
        while current is not None:
            current.lock_ref -= 1
            if current.lock_ref == 0:
                self._num_locked_blocks -= len(current.block_ids)
            current = current.parent
        self._lru.offer(radix_node, self._num_nodes)

    def insert(self, key: CacheKey, token_ids: Sequence[int], block_ids: Sequence[int]) -> PrefixMatch:
        """Cache the blocks of `token_ids` (exactly len(block_ids) full blocks) and return the whole path.

        Positions already cached keep their cached block; the caller keeps (and later releases) its
        own block there. Blocks at new positions are adopted: the cache takes its own reference.
        """
        if len(token_ids) != len(block_ids) * self.block_size:
            raise ValueError(
                f"{len(token_ids)} tokens do not fill {len(block_ids)} blocks of {self.block_size} tokens"
            )
        return self._insert_below(self._root(key), self._token_blocks(token_ids), block_ids)

    def insert_blocks(self, key: CacheKey, token_blocks: list[BlockTokens], block_ids: Sequence[int],
                      block_hashes: Sequence[int] = ()) -> PrefixMatch:
        """`insert` of a sequence already split into full blocks: one token tuple per block id.

        `block_hashes`: the chained hashes (`kvbaton.cache.hashing.chain_hashes` under `key`) of
        the leading blocks of `token_blocks`, as many as the caller has (none, some or all);
        blocks the cache adopts take them instead of being hashed again. The first adopted block's
        hash is checked (a wrong key or offset raises ValueError, changing nothing).
        """
        self._check_blocks(token_blocks, block_ids)
        return self._insert_below(self._root(key), token_blocks, block_ids, block_hashes)

    def insert_from(self, node: object, token_ids: Sequence[int], block_ids: Sequence[int], *,
                    grow: bool = False) -> PrefixMatch:
        """`insert` of a path that continues below `node`, given only the blocks after it.

        `node` must be a node handle the caller holds locked (so root..node is exactly the prefix
        before `token_ids`, see the module docstring); the result, events, ticks and splits are
        identical to `insert` of the whole sequence, without re-walking (and re-tupling) the
        prefix. The returned match covers only the blocks after `node`; its node is the deepest.

        `grow=True`: the caller moves its lock to the returned node (lock it, unlock `node`), as a request caching
        its next blocks does. When that lock is `node`'s only one and nothing follows `node`, the new blocks are
        appended to `node` itself, which is returned: the same cached blocks, events and LRU order in one node
        fewer (no node to create, lock and unlock; a shallower tree to walk). `node` then ends past the prefix it
        was taken for: only its caller, whose next prefix that is, may use it.
        """
        start = self._check_node(node)
        if start.lock_ref == 0:
            raise ValueError("insert_from needs a locked node: an unlocked one may be trimmed or split")
        if len(token_ids) != len(block_ids) * self.block_size:
            raise ValueError(
                f"{len(token_ids)} tokens do not fill {len(block_ids)} blocks of {self.block_size} tokens"
            )
        return self._insert_below(start, self._token_blocks(token_ids), block_ids, grow=grow)

    def insert_from_blocks(self, node: object, token_blocks: list[BlockTokens], block_ids: Sequence[int],
                           block_hashes: Sequence[int] = (), *, grow: bool = False) -> PrefixMatch:
        """`insert_from` of blocks already split into token tuples: one tuple per block id.

        `block_hashes`: known chained hashes of the leading blocks of `token_blocks`, as in `insert_blocks`.
        """
        start = self._check_node(node)
        if start.lock_ref == 0:
            raise ValueError("insert_from needs a locked node: an unlocked one may be trimmed or split")
        self._check_blocks(token_blocks, block_ids)
        return self._insert_below(start, token_blocks, block_ids, block_hashes, grow)

    def _check_blocks(self, token_blocks: list[BlockTokens], block_ids: Sequence[int]) -> None:
        if len(token_blocks) != len(block_ids) or set(map(len, token_blocks)) - {self.block_size}:
            raise ValueError(f"{len(token_blocks)} token blocks for {len(block_ids)} block ids; every block "
                             f"must hold {self.block_size} tokens")

    def _insert_below(self, start: RadixNode, token_blocks: list[BlockTokens], block_ids: Sequence[int],
                      block_hashes: Sequence[int] = (), grow: bool = False) -> PrefixMatch:
        """Shared body of `insert`/`insert_from`: walk down from `start`, adopt the blocks past the
        cached path, touch the end node. `block_hashes`: known hashes of leading `token_blocks`; `grow`: as in
        `insert_from`."""
        node, num_in_node, path_ids, path_hashes = self._walk(start, token_blocks)
        num_path = len(path_ids)
        new_ids = list(block_ids[num_path:])
        known_hashes = block_hashes[num_path : len(block_ids)]
        # Validate everything before changing anything, so a bad call leaves the cache untouched.
        reused = self._cached_block_ids.intersection(new_ids)
        if reused or len(set(new_ids)) != len(new_ids):
            raise ValueError(f"blocks {sorted(reused) or new_ids} are already cached or listed twice")
        if known_hashes:
            # The path ends inside `node` after num_in_node blocks: the hash before the first new block.
            before = node.block_hashes[num_in_node - 1] if num_in_node else node.parent_hash
            if known_hashes[0] != hash_block(before, token_blocks[num_path]):
                raise ValueError("block_hashes do not chain from the cached path (wrong key or offset)")
        self.pool.ref(new_ids)  # raises (changing nothing) if the caller does not hold them
        if num_in_node < len(node.block_ids):
            node = self._split(node, num_in_node)
        if new_ids:
            parent_hash = node.tail_hash
            if (grow and node is start and node.lock_ref == 1 and node.num_direct_locks == 1 and not node.children
                    and node.parent is not None):
                # nothing matched below the caller's node, which it alone locks: the node grows (`insert_from`)
                new_hashes = self._extend(node, token_blocks[num_path:], new_ids, known_hashes)
            else:
                node = self._add_child(node, token_blocks[num_path:], new_ids, known_hashes)
                new_hashes = node.block_hashes
            path_ids.extend(new_ids)
            path_hashes.extend(new_hashes)
            if self.tier is not None:
                # the KV store writes them through
                self.tier.on_cached(tuple(new_hashes), parent_hash, node.namespace, tuple(new_ids))
            self._emit(KVEventKind.STORED, tuple(new_hashes), parent_hash)
        self._lru.touch(node, self._num_nodes)
        return PrefixMatch(tuple(path_ids), tuple(path_hashes), node)

    def evict(self, num_blocks: int) -> int:
        """Free up to `num_blocks` blocks from unlocked leaves, least recently used first; returns how many.

        With a tier the trimmed blocks are handed to its `demote` first, and the EVICTED event lists the hashes it
        returns."""
        num_freed, evicted_hashes = self._evict(num_blocks)
        if evicted_hashes:
            self._emit(KVEventKind.EVICTED, tuple(evicted_hashes), None)
        return num_freed

    def clear(self) -> int:
        """Drop every unlocked block (LRU order), and what the tier's `clear` lets go; returns how many device blocks
        went back to the free queue. Emits CLEARED when the cache ends up empty, else EVICTED with the hashes."""
        tier, self.tier = self.tier, None  # nothing is demoted by a clear
        try:
            num_freed, evicted_hashes = self._evict(None)
        finally:
            self.tier = tier
        if tier is not None:
            evicted_hashes.extend(tier.clear())
        if evicted_hashes:
            if self._num_cached_blocks == 0:
                self._emit(KVEventKind.CLEARED, (), None)
            else:
                self._emit(KVEventKind.EVICTED, tuple(evicted_hashes), None)
        return num_freed

    def _evict(self, num_blocks: int | None) -> tuple[int, list[int]]:
        """Trim LRU leaves until `num_blocks` are free (None: all unlocked).

        A leaf stays the least recent until it is empty (trimming changes neither its tick nor its lock), so its
        blocks are taken from the tail in one cut of at most what is still needed, in the order (deepest first)
        and with the result of taking them one at a time: an unlocked cached block is freed by its release, and
        if one were not, the loop would go on taking from the same leaf."""
        num_freed = 0
        evicted_hashes: list[int] = []
        tier = self.tier
        demoted: list[EvictedBlock] = []
        lru = self._lru
        pool = self.pool
        while num_blocks is None or num_freed < num_blocks:
            node = lru.least_recent()
            if node is None:
                break
            block_ids = node.block_ids
            num_left = len(block_ids)
            cut = 0 if num_blocks is None else max(0, num_left - (num_blocks - num_freed))
            taken_ids = block_ids[cut:][::-1]  # the tail, deepest first
            taken_hashes = node.block_hashes[cut:][::-1]
            if tier is None:
                evicted_hashes.extend(taken_hashes)
            else:  # their KV stays in the freed blocks until the next allocation: `demote` copies it out first
                hashes, tokens = node.block_hashes, node.token_blocks
                demoted.extend(
                    EvictedBlock(hashes[i], tokens[i], hashes[i - 1] if i else node.parent_hash, block_ids[i],
                                 node.namespace)
                    for i in range(num_left - 1, cut - 1, -1))
            del block_ids[cut:], node.token_blocks[cut:], node.block_hashes[cut:]
            self._cached_block_ids.difference_update(taken_ids)
            self._num_cached_blocks -= len(taken_ids)
            num_free_before = pool.num_free_blocks
            pool.release(taken_ids)
            num_freed += pool.num_free_blocks - num_free_before
            if not block_ids:
                self._detach(node)
        if demoted:
            evicted_hashes = tier.demote(demoted)  # type: ignore[union-attr]
        return num_freed, evicted_hashes

    def _detach(self, node: RadixNode) -> None:
        parent = node.parent
        assert parent is not None and node.key is not None
        del parent.children[node.key]
        node.attached = False
        node.parent = None
        self._num_nodes -= 1
        self._lru.offer(parent, self._num_nodes)

    def close(self) -> None:
        """The cache is being dropped: unlink every node from its parent (the trees' only reference cycles), so
        that it is freed by reference counting alone, not by a pass of the cyclic collector over every node (the
        simulator drops one per worker per run with the collector paused). Nothing may use the cache afterwards;
        the pool's references are left as they were."""
        for node in list(self._iter_nodes(ordered=False)):
            node.parent = None

    @property
    def has_events(self) -> bool:
        """Whether events wait for `take_events`."""
        return bool(self._events)

    def take_events(self) -> list[KVEvent]:
        """Events since the last call, in seq order."""
        events, self._events = self._events, []
        return events

    def snapshot(self) -> list[KVEvent]:
        """STORED events, parents first, that rebuild the whole content; all carry the latest seq.

        A consumer resyncing from it ignores later events with seq <= that number.
        """
        events = [
            KVEvent(self._seq, KVEventKind.STORED, tuple(node.block_hashes), node.parent_hash, self.block_size)
            for node in self._iter_nodes(ordered=True)
        ]
        if self.tier is not None:  # blocks the worker can load back count as held
            events.extend(KVEvent(self._seq, KVEventKind.STORED, (block_hash,), parent_hash, self.block_size)
                          for block_hash, parent_hash in self.tier.stored())
        return events

    def check_invariants(self) -> None:
        """Raise AssertionError on any inconsistency between tree, counters, heap, events and pool."""
        self.pool.check_invariants()
        seen_ids: set[int] = set()
        num_nodes = num_locked_blocks = 0
        heap_entries = self._lru.entries()
        for key, root in self._roots.items():
            assert root.parent is None and not root.block_ids and root.attached, "malformed root"
            assert root.parent_hash == key.root_hash, "root hash does not match its cache key"
            assert root.namespace is key, "root does not name its cache key"
            self._check_lock_ref(root)
        for node in self._iter_nodes(ordered=False):
            parent = node.parent
            assert parent is not None and node.attached, "tree node is detached"
            assert node.key is not None and node.token_blocks and node.key == node.token_blocks[0], \
                "empty node or wrong key"
            assert parent.children.get(node.key) is node, "node is not its parent's child under its key"
            assert len(node.token_blocks) == len(node.block_ids) == len(node.block_hashes), "ragged node"
            assert node.parent_hash == parent.tail_hash, "hash chain broken between nodes"
            assert node.namespace is parent.namespace, "node in another tree than its parent"
            assert node.last_access <= parent.last_access, "child touched more recently than parent"
            chained = node.parent_hash
            for tokens, block_hash, block_id in zip(node.token_blocks, node.block_hashes, node.block_ids):
                assert len(tokens) == self.block_size, f"block {block_id} holds {len(tokens)} tokens"
                chained = hash_block(chained, tokens)
                assert block_hash == chained, f"block {block_id} has a wrong chained hash"
                assert block_id not in seen_ids, f"block {block_id} cached twice"
                seen_ids.add(block_id)
                ref_count = self.pool.ref_count(block_id)
                if node.lock_ref == 0:
                    assert ref_count == 1, f"unlocked cached block {block_id} has ref {ref_count}, expected 1"
                else:
                    assert ref_count >= 1, f"locked cached block {block_id} is free"
            num_nodes += 1
            num_locked_blocks += len(node.block_ids) if node.lock_ref > 0 else 0
            self._check_lock_ref(node)
            if not node.children and node.lock_ref == 0:
                assert (node.last_access, node.serial) in heap_entries, "evictable leaf missing from heap"
        assert seen_ids == self._cached_block_ids, "cached block id set out of date"
        if self.tier is not None:
            self.tier.check_invariants({h for node in self._iter_nodes(ordered=False) for h in node.block_hashes})
        assert len(seen_ids) == self._num_cached_blocks, "num_cached_blocks out of date"
        assert num_nodes == self._num_nodes, "node count out of date"
        assert num_locked_blocks == self._num_locked_blocks, "locked block count out of date"
        expected_seqs = list(range(self._seq - len(self._events) + 1, self._seq + 1))
        assert [event.seq for event in self._events] == expected_seqs, "event seqs have gaps"

    def _check_lock_ref(self, node: RadixNode) -> None:
        expected = node.num_direct_locks + sum(child.lock_ref for child in node.children.values())
        assert node.num_direct_locks >= 0 and node.lock_ref == expected, "lock_ref != own locks + children's"

    def _root(self, key: CacheKey) -> RadixNode:
        root = self._roots.get(key)
        if root is None:
            root = RadixNode(None, key.root_hash, next(self._serials), self._lru.tick)
            root.namespace = key
            self._roots[key] = root
        return root

    def _token_blocks(self, token_ids: Sequence[int]) -> list[BlockTokens]:
        size = self.block_size
        return [tuple(token_ids[start : start + size]) for start in range(0, len(token_ids) - size + 1, size)]

    def _walk(self, start: RadixNode, token_blocks: list[BlockTokens]) -> tuple[RadixNode, int, list[int], list[int]]:
        """Follow the longest cached prefix below `start` (a root, or a node whose blocks all precede
        `token_blocks`): (last node reached, blocks matched in it, ids, hashes after `start`)."""
        node, num_in_node = start, len(start.block_ids)
        block_ids: list[int] = []
        block_hashes: list[int] = []
        position = 0
        num_token_blocks = len(token_blocks)
        while position < num_token_blocks:
            child = node.children.get(token_blocks[position])
            if child is None:
                break
            node = child
            child_blocks = child.token_blocks
            num_comparable = min(len(child_blocks), num_token_blocks - position)
            # Usually the whole node matches: one C-level list comparison instead of a Python loop.
            if child_blocks[:num_comparable] == token_blocks[position : position + num_comparable]:
                num_in_node = num_comparable
            else:
                num_in_node = 1  # the first block matched: it is the child's key
                while child_blocks[num_in_node] == token_blocks[position + num_in_node]:
                    num_in_node += 1  # stops before num_comparable: the slices differ somewhere
            position += num_in_node
            block_ids.extend(child.block_ids[:num_in_node])
            block_hashes.extend(child.block_hashes[:num_in_node])
            if num_in_node < len(child.token_blocks):
                break
        return node, num_in_node, block_ids, block_hashes

    def _split(self, node: RadixNode, num_head_blocks: int) -> RadixNode:
        """Move the first `num_head_blocks` of `node` into a new parent, which is returned."""
        parent = node.parent
        assert parent is not None and 0 < num_head_blocks < len(node.block_ids)
        head = RadixNode(parent, node.parent_hash, next(self._serials), node.last_access)
        head.key = node.key
        head.token_blocks = node.token_blocks[:num_head_blocks]
        head.block_ids = node.block_ids[:num_head_blocks]
        head.block_hashes = node.block_hashes[:num_head_blocks]
        head.lock_ref = node.lock_ref  # every lock through `node` also passes through its new parent
        del node.token_blocks[:num_head_blocks], node.block_ids[:num_head_blocks], node.block_hashes[:num_head_blocks]
        node.key = node.token_blocks[0]
        node.parent = head
        node.parent_hash = head.tail_hash
        head.children[node.key] = node
        parent.children[head.key] = head  # type: ignore[index]
        self._num_nodes += 1
        return head

    def _add_child(self, parent: RadixNode, token_blocks: list[BlockTokens], block_ids: list[int],
                   known_hashes: Sequence[int] = ()) -> RadixNode:
        child = RadixNode(parent, parent.tail_hash, next(self._serials), self._lru.tick)
        child.key = token_blocks[0]
        child.token_blocks = token_blocks
        child.block_ids = block_ids
        # Hashes the caller already has (checked to chain from `parent` by `_insert_below`), then the rest.
        hashes = list(known_hashes)
        if len(hashes) < len(token_blocks):
            hashes.extend(chain_hashes(hashes[-1] if hashes else parent.tail_hash, token_blocks[len(hashes):]))
        child.block_hashes = hashes
        parent.children[child.key] = child
        self._cached_block_ids.update(block_ids)
        self._num_cached_blocks += len(block_ids)
        self._num_nodes += 1
        return child

    def _extend(self, node: RadixNode, token_blocks: list[BlockTokens], block_ids: list[int],
                known_hashes: Sequence[int] = ()) -> list[int]:
        """Append blocks at the tail of a locked leaf (its one lock the caller's); returns their hashes."""
        hashes = list(known_hashes)
        if len(hashes) < len(token_blocks):
            hashes.extend(chain_hashes(hashes[-1] if hashes else node.tail_hash, token_blocks[len(hashes):]))
        node.token_blocks.extend(token_blocks)
        node.block_ids.extend(block_ids)
        node.block_hashes.extend(hashes)
        self._cached_block_ids.update(block_ids)
        self._num_cached_blocks += len(block_ids)
        self._num_locked_blocks += len(block_ids)
        return hashes

    def _check_node(self, node: object) -> RadixNode:
        if not isinstance(node, RadixNode):
            raise TypeError(f"expected a node handle from this cache, got {type(node).__name__}")
        if not node.attached:
            raise ValueError("node handle is stale: its blocks were evicted")
        return node

    def _emit(self, kind: KVEventKind, block_hashes: tuple[int, ...], parent_hash: int | None) -> None:
        self._seq += 1
        self._events.append(KVEvent(self._seq, kind, block_hashes, parent_hash, self.block_size))

    def _iter_nodes(self, *, ordered: bool) -> Iterator[RadixNode]:
        """Every non-root node, parents before children; `ordered` sorts namespaces and siblings."""
        roots = list(self._roots.items())
        if ordered:
            roots.sort(key=lambda item: (item[0].model_revision, item[0].kv_layout, item[0].tenant_salt))
        stack = [root for _, root in reversed(roots)]
        while stack:
            node = stack.pop()
            if node.parent is not None:
                yield node
            children = list(node.children.values())
            if ordered:
                children.sort(key=lambda child: child.key)  # type: ignore[arg-type, return-value]
            stack.extend(reversed(children))
