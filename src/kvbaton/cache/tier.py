"""What the prefix cache asks of the tier past the device: the cluster KV store, as a worker sees it.

`RadixCache.tier` is None (the device pool alone) or one of two views of the store (`kvbaton.cache.kv_store`),
answering the same calls:

- `kvbaton.cache.store_tier.StoreTier`, the simulator's: `match` continues a device match into the store at
  admission and `BlockManager.attach_prefix` loads the run it finds (priced by the simulated links);
- `kvbaton.engine.store_io.WorkerStoreIO`, a live worker's: its loads are asynchronous, started before
  admission (`kvbaton.engine.store_loads`), so its `match` finds nothing and the scheduler sees device hits only.

Both write new full blocks through (`on_cached`) and keep their copies when the device evicts its own (`demote`
returns every evicted hash): the store is not exclusive of the device, and the worker's KV events speak of the
device only. (The synchronous host tier of earlier versions, an exclusive LRU of evicted blocks per worker, is
gone: the store's DRAM tier took its place.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

from kvbaton.cache.radix_node import BlockTokens


class EvictedBlock(NamedTuple):
    """A block the device cache just evicted: its KV is still in `device_block_id` until that is reused."""

    block_hash: int
    token_block: BlockTokens
    parent_hash: int
    device_block_id: int
    namespace: object = None  # the CacheKey it was cached under


class CacheTier(Protocol):
    """The calls `RadixCache` and `BlockManager` make of the tier past the device."""

    num_loaded_blocks: int
    num_saved_blocks: int

    @property
    def num_cached_blocks(self) -> int:
        """Blocks held past the device (the worker's store node's)."""

    def on_cached(self, block_hashes: Sequence[int], parent_hash: int, namespace: object,
                  device_block_ids: Sequence[int] = ()) -> None:
        """Blocks just cached on the device (in `device_block_ids`), the chain after `parent_hash`."""

    def demote(self, blocks: Sequence[EvictedBlock]) -> list[int]:
        """The device evicted these (their KV still in their blocks); returns the hashes that left the worker."""

    def match(self, parent_hash: int, token_blocks: Sequence[BlockTokens], block_hashes: Sequence[int] = (),
              namespace: object = None) -> int:
        """Leading blocks of `token_blocks` (after the block hashed `parent_hash`) held under `namespace`."""

    def take(self, parent_hash: int, token_blocks: Sequence[BlockTokens], block_hashes: Sequence[int] = (),
             namespace: object = None) -> list[int]:
        """Pin the run `match` finds for `load` or `put_back`; returns its hashes."""

    def load(self, block_hashes: Sequence[int], device_block_ids: list[int]) -> None:
        """Copy taken blocks into `device_block_ids`."""

    def put_back(self, block_hashes: Sequence[int]) -> None:
        """Unpin taken blocks that found no device room."""

    def clear(self) -> list[int]:
        """The device cache was cleared; returns hashes that left the worker with it."""

    def stored(self) -> list[tuple[int, int]]:
        """(hash, parent hash) the worker's snapshot adds past the device's."""

    def check_invariants(self, device_hashes: set[int]) -> None: ...
