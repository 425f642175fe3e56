"""A simulated worker's view of the cluster KV store, the prefix cache's tier past the device (`RadixCache.tier`).

It answers the calls `RadixCache` and `BlockManager` make of a tier (`kvbaton.cache.tier`), with the
store's meaning:

- **Write-through.** `on_cached` (blocks newly cached on the device, computed or loaded) puts them in the
  store from this worker's node, where the cluster does not hold them yet; `save` of the executor's IO
  moves the bytes, off the step's critical path.
- **Loads.** `match` continues a device match into the store (namespace checked); `take` pins the run it
  finds and picks each block's source (`KVStore.best_source`: this node, else DRAM before disk); `load`
  has the IO bring them into fresh device blocks, tells the store they were used (GDSF uses, disk
  promotion, hot-block replication) and unpins; `put_back` unpins what found no device room.
- **Not exclusive.** The store keeps its copy when the device holds one. So the worker's KV events and
  snapshots speak of the device only (`demote` returns every evicted hash, `stored` is empty), and the
  router learns of store blocks from the store's own events (`kvbaton.cache.store_directory`).

The store prices recomputing a block with `recompute_s(depth)`, its depth one more than its parent's in the
store (0 when the parent is not there: a root block, or one whose parent was evicted). A store node lost in
the middle of a load (only a live store can: the simulator's losses fall between steps, and a load there changes
its state at once) makes `load` raise: the live data path fails such a load over to recomputation.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

from kvbaton.cache.tier import BlockTokens, EvictedBlock
from kvbaton.cache.kv_store import KVStore, NodeId


class StoreIO(Protocol):
    """Moves KV between the store and the worker's device blocks (the executor's side)."""

    def load(self, block_hashes: list[int], sources: list[tuple[NodeId, str]], device_block_ids: list[int]) -> None:
        """Copy each block from its (node, tier) into the device block at the same position."""

    def save(self, block_hashes: list[int], device_block_ids: list[int]) -> None:
        """Write these newly cached device blocks to this node's store (asynchronously: they must be read
        before the device block is reused, and the cache holds a block while it is cached)."""


class StoreTier:
    def __init__(self, store: KVStore, node_id: NodeId, io: StoreIO, recompute_s: Callable[[int], float]) -> None:
        self.store = store
        self.node_id = node_id
        self.io = io
        self.recompute_s = recompute_s
        self._taken: dict[int, NodeId] = {}  # hash -> the node it loads from, pinned until loaded or put back
        self.num_saved_blocks = 0  # blocks this worker wrote to the store
        self.num_loaded_blocks = 0  # blocks it loaded from the store
        self.num_remote_loaded_blocks = 0  # of which from another node

    @property
    def num_cached_blocks(self) -> int:
        """Blocks this worker's node holds for the cluster."""
        node = self.store.nodes.get(self.node_id)
        return len(node.entries) if node is not None else 0

    def on_cached(self, block_hashes: Sequence[int], parent_hash: int, namespace: Hashable,
                  device_block_ids: Sequence[int] = ()) -> None:
        """Blocks just cached on the device (in `device_block_ids`), the chain after `parent_hash`: write them
        through."""
        if not block_hashes:
            return
        first_depth = self.store.depth_after(parent_hash)
        stored = self.store.put(self.node_id, block_hashes, parent_hash, namespace, first_depth, self.recompute_s)
        if stored:
            self.io.save([block_hashes[i] for i in stored], [device_block_ids[i] for i in stored])
            self.num_saved_blocks += len(stored)

    def demote(self, blocks: Sequence[EvictedBlock]) -> list[int]:
        """The device evicted these: the store already has what write-through could keep; all left the device."""
        return [block.block_hash for block in blocks]

    def match(self, parent_hash: int, token_blocks: Sequence[BlockTokens], block_hashes: Sequence[int] = (),
              namespace: object = None) -> int:
        """Leading blocks of `token_blocks` (after the block hashed `parent_hash`) the store holds under
        `namespace`; `block_hashes`: their chained hashes where known. Changes nothing."""
        return self.store.match(self._hashes(parent_hash, token_blocks, block_hashes), namespace)

    def take(self, parent_hash: int, token_blocks: Sequence[BlockTokens], block_hashes: Sequence[int] = (),
             namespace: object = None) -> list[int]:
        hashes = self._hashes(parent_hash, token_blocks, block_hashes)
        hashes = hashes[: self.store.match(hashes, namespace)]
        self.store.pin(hashes)
        for block_hash in hashes:
            source = self.store.best_source(block_hash, self.node_id)
            assert source is not None
            self._taken[block_hash] = source[0]
        return hashes

    def load(self, block_hashes: Sequence[int], device_block_ids: list[int]) -> None:
        if not block_hashes:
            return
        sources = []
        for block_hash in block_hashes:
            node_id = self._taken.pop(block_hash)
            node = self.store.nodes.get(node_id)
            if node is None or block_hash not in node.entries:
                raise RuntimeError(f"store node {node_id} lost block {block_hash} during its load")
            sources.append((node_id, node.entries[block_hash].tier))
        self.io.load(list(block_hashes), sources, device_block_ids)
        self.store.on_loaded(self.node_id, list(zip(block_hashes, (node_id for node_id, _ in sources))))
        self.store.unpin(block_hashes)
        self.num_loaded_blocks += len(block_hashes)
        self.num_remote_loaded_blocks += sum(node_id != self.node_id for node_id, _ in sources)

    def put_back(self, block_hashes: Sequence[int]) -> None:
        for block_hash in block_hashes:
            del self._taken[block_hash]
        self.store.unpin(block_hashes)

    def clear(self) -> list[int]:
        """A cleared device cache leaves the store as it is: nothing of the worker's own left with it."""
        return []

    def stored(self) -> list[tuple[int, int]]:
        return []

    def check_invariants(self, device_hashes: set[int]) -> None:
        """The store's own invariants; blocks taken for a load are still pinned where they load from."""
        self.store.check_invariants()
        for block_hash, node_id in self._taken.items():
            node = self.store.nodes.get(node_id)
            if node is not None and block_hash in node.entries:
                assert node.entries[block_hash].num_pins > 0, "a block taken for a load is not pinned"

    @staticmethod
    def _hashes(parent_hash: int, token_blocks: Sequence[BlockTokens], block_hashes: Sequence[int]) -> list[int]:
        hashes = list(block_hashes[: len(token_blocks)])
        block_hash = hashes[-1] if hashes else parent_hash
        for tokens in token_blocks[len(hashes):]:
            block_hash = hash((block_hash, tokens))
            hashes.append(block_hash)
        return hashes
