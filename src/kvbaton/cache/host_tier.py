"""The prefix cache's second tier: KV blocks the device radix cache evicted, kept in host memory by chained hash.

SGLang's hierarchical cache and vLLM's CPU KV offloading keep what the accelerator's cache evicts in the
host's larger DRAM, so a prefix that comes back costs a host-to-device copy instead of a prefill. Here:

- **Demote.** When `RadixCache` evicts unlocked leaf blocks, it hands them (chained hash, token tuple,
  parent hash, device block id) to `demote`, which copies them into free host blocks through the
  executor's `TierIO.save`, before any device block can be reused. Without a free host block, the least
  recently demoted entry is dropped. The tier is exclusive: a block lives on the device or here, never
  both (a block computed again on the device is `discard`ed from here).
- **Promote.** At admission `BlockManager.attach_prefix` continues the device match here (`match`):
  consecutive blocks whose chained hashes follow the device prefix. `take` removes them from the LRU
  (so an eviction made to find device room cannot drop them), `load` copies them into fresh device
  blocks through `TierIO.load` and frees their host blocks; `put_back` returns the ones that found no
  device room. The loaded blocks then enter the device tree as if computed there.
- **Events.** The router's index should know every prefix a worker can serve without a prefill, so a
  demoted block is not reported as evicted: the cache's EVICTED events list the hashes that left both
  tiers (`demote` returns them), and a snapshot includes this tier's blocks.

Entries sit in one LRU ordered by demotion (and `put_back`); an eviction of a device leaf demotes its
deepest block first, so the deepest blocks of a prefix are dropped from here first too. Copies are
synchronous: `save` runs inside the eviction, when the freed device blocks still hold their KV. Plain
Python over metadata: the executor's `TierIO` moves the bytes (torch tensors live, a byte count in the
simulator).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple, Protocol

BlockTokens = tuple[int, ...]


class TierIO(Protocol):
    """Moves KV between the device's blocks and the host tier's blocks (the executor's side)."""

    def save(self, device_block_ids: list[int], host_block_ids: list[int]) -> None:
        """Copy each device block into the host block at the same position (all distinct)."""

    def load(self, host_block_ids: list[int], device_block_ids: list[int]) -> None:
        """Copy each host block into the device block at the same position (all distinct)."""


class EvictedBlock(NamedTuple):
    """A block the device cache just evicted: its KV is still in `device_block_id` until that is reused."""

    block_hash: int
    token_block: BlockTokens
    parent_hash: int
    device_block_id: int
    namespace: object = None  # the CacheKey it was cached under


class HostEntry(NamedTuple):
    host_block_id: int
    token_block: BlockTokens
    parent_hash: int
    namespace: object = None


class HostTier:
    """Host-memory blocks holding KV the device cache evicted; see the module docstring."""

    def __init__(self, num_blocks: int, io: TierIO) -> None:
        if num_blocks <= 0:
            raise ValueError(f"a host tier needs a positive number of blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.io = io
        self._entries: OrderedDict[int, HostEntry] = OrderedDict()  # chained hash -> entry, oldest first
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # popped from the end: 0, 1, 2, ...
        self._taken: dict[int, HostEntry] = {}  # taken out of the LRU for a promotion, not yet loaded or returned
        self.num_saved_blocks = 0  # copies device -> host
        self.num_loaded_blocks = 0  # copies host -> device
        self.num_dropped_blocks = 0  # blocks dropped for want of room (their KV is gone from both tiers)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._entries)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._entries

    def demote(self, blocks: Sequence[EvictedBlock]) -> list[int]:
        """Keep `blocks` (in eviction order) in host blocks, with one `save`; returns the hashes that left both
        tiers: entries dropped to make room, including any of `blocks` dropped for a later one."""
        entries = self._entries
        free = self._free
        pending: dict[int, int] = {}  # host block -> device block to copy into it
        dropped: list[int] = []
        for block in blocks:
            if block.block_hash in entries or block.block_hash in self._taken:
                continue  # already here (its device copy was a duplicate): nothing to keep
            if not free:
                if not entries:
                    dropped.append(block.block_hash)  # everything here is taken for a promotion
                    self.num_dropped_blocks += 1
                    continue
                old_hash, old = entries.popitem(last=False)
                pending.pop(old.host_block_id, None)  # dropped before its copy ran: no copy
                free.append(old.host_block_id)
                dropped.append(old_hash)
                self.num_dropped_blocks += 1
            host_block_id = free.pop()
            entries[block.block_hash] = HostEntry(host_block_id, block.token_block, block.parent_hash, block.namespace)
            pending[host_block_id] = block.device_block_id
        if pending:
            self.io.save(list(pending.values()), list(pending))
            self.num_saved_blocks += len(pending)
        return dropped

    def match(self, parent_hash: int, token_blocks: Sequence[BlockTokens], block_hashes: Sequence[int] = (),
              namespace: object = None) -> int:
        """How many leading blocks of `token_blocks` (the blocks after the one hashed `parent_hash`) are here, as
        one chain, demoted from `namespace` (the CacheKey they are looked up under). `block_hashes`: their chained
        hashes where the caller has them (the rest are computed). Changes nothing. A block whose hash matches
        but whose tokens or namespace differ is not a match: a hash is 64 bits of Python's tuple hash, which two
        tenants' blocks may share, by chance or by construction."""
        entries = self._entries
        num_known = len(block_hashes)
        block_hash = parent_hash
        for i, tokens in enumerate(token_blocks):
            block_hash = block_hashes[i] if i < num_known else hash((block_hash, tokens))
            entry = entries.get(block_hash)
            if entry is None or entry.token_block != tokens or entry.namespace != namespace:
                return i
        return len(token_blocks)

    def take(self, parent_hash: int, token_blocks: Sequence[BlockTokens],
             block_hashes: Sequence[int] = (), namespace: object = None) -> list[int]:
        """Remove the chain `match` finds from the LRU, keeping its host blocks, for `load` or `put_back`;
        returns its hashes in order."""
        num = self.match(parent_hash, token_blocks, block_hashes, namespace)
        hashes: list[int] = []
        block_hash = parent_hash
        for i in range(num):
            block_hash = block_hashes[i] if i < len(block_hashes) else hash((block_hash, token_blocks[i]))
            self._taken[block_hash] = self._entries.pop(block_hash)
            hashes.append(block_hash)
        return hashes

    def load(self, block_hashes: Sequence[int], device_block_ids: list[int]) -> None:
        """Copy taken blocks into `device_block_ids` (one `load`) and free their host blocks: they now live on
        the device."""
        host_block_ids = [self._taken.pop(h).host_block_id for h in block_hashes]
        if host_block_ids:
            self.io.load(host_block_ids, device_block_ids)
            self.num_loaded_blocks += len(host_block_ids)
            self._free.extend(host_block_ids)

    def put_back(self, block_hashes: Sequence[int]) -> None:
        """Return taken blocks that were not loaded, as the most recently used entries (deepest first, so a
        chain's head outlives its tail)."""
        for block_hash in reversed(block_hashes):
            self._entries[block_hash] = self._taken.pop(block_hash)

    def on_cached(self, block_hashes: Sequence[int], parent_hash: int, namespace: object,
                  device_block_ids: Sequence[int] = ()) -> None:
        """The device cache just cached these blocks (the chain after `parent_hash`): they leave this tier."""
        self.discard(block_hashes)

    def discard(self, block_hashes: Sequence[int]) -> None:
        """Blocks now cached on the device (computed again): their host copies go, silently (the worker still
        holds them, so no event)."""
        entries = self._entries
        for block_hash in block_hashes:
            entry = entries.pop(block_hash, None)
            if entry is not None:
                self._free.append(entry.host_block_id)

    def clear(self) -> list[int]:
        """Drop every entry not taken; returns their hashes."""
        hashes = list(self._entries)
        self._free.extend(entry.host_block_id for entry in self._entries.values())
        self._entries.clear()
        return hashes

    def stored(self) -> list[tuple[int, int]]:
        """(hash, parent hash) of every entry, most recently demoted first (a snapshot's STORED events)."""
        return [(h, entry.parent_hash) for h, entry in reversed(self._entries.items())]

    def check_invariants(self, device_hashes: set[int]) -> None:
        """Host blocks are each free, held by one entry, or taken; no block is in both tiers."""
        used = [entry.host_block_id for entry in self._entries.values()]
        used += [entry.host_block_id for entry in self._taken.values()]
        assert len(set(used)) == len(used), "a host block is held twice"
        assert not set(used) & set(self._free), "a host block is both free and held"
        assert len(used) + len(self._free) == self.num_blocks, "host blocks leak"
        assert not device_hashes & self._entries.keys(), "a block is cached in both tiers"
        for block_hash, entry in self._entries.items():
            assert hash((entry.parent_hash, entry.token_block)) == block_hash, "host entry has a wrong chained hash"
