"""Requests waiting in the loading state: their prefix past the device cache comes from the KV store while other
requests keep stepping (the engine's side of `kvbaton.engine.store_io`).

A request whose prompt has at least `min_load_blocks` full blocks past its device prefix does not enter the
scheduler at once. Its device prefix is locked (so the blocks loaded can hang below it), and the store IO thread
asks the store node for the rest. When the pool has a free block for each block asked for, the request takes them
at once and the IO thread copies the leading k the node has straight after its answer (one trip, step 2; an
engine with nothing else to step or load reads what the node's slot index shows on its own thread instead, and
the IO thread goes on from there only when that was not the whole chain: `WorkerStoreIO.copy_now`); otherwise
between steps the engine calls `poll`:

1. **acquired**: the node pinned the leading k blocks (k may be 0). The engine takes k device blocks (evicting
   unlocked cached ones if short; fewer if it cannot) and the IO thread copies the blocks into them.
2. **copied**: the blocks enter the device cache below the locked prefix (the cache takes its reference, this
   drops its own), the lock is let go, and the request goes to the scheduler, which finds them as a device hit
   (`num_cached_tokens` counts them).
3. **failed** (the store did not answer, or the copy failed): the device blocks go back to the pool, the
   request goes to the scheduler and recomputes what it could not load.

An aborted request ends at its next step of the three with every block, lock and lease let go, and its final
output (ABORT) is handed back by `poll`. `num_held_blocks` is what loads hold right now (for the engine's
block accounting).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvbaton.cache.block_pool import BlockPool
from kvbaton.cache.hashing import CacheKey, hash_prompt
from kvbaton.cache.radix_cache import RadixCache
from kvbaton.core.request import Request
from kvbaton.engine.store_io import LoadJob, WorkerStoreIO, namespace_of


@dataclass(slots=True)
class _Loading:
    request: Request
    job: LoadJob
    node: object  # the locked device prefix the loaded blocks hang below
    token_blocks: list[tuple[int, ...]]
    aborted: bool = False


class StoreLoads:
    def __init__(self, io: WorkerStoreIO, pool: BlockPool, cache: RadixCache, cache_key: CacheKey, block_size: int,
                 min_load_blocks: int = 1) -> None:
        self.io = io
        self.pool = pool
        self.cache = cache
        self.cache_key = cache_key
        self.block_size = block_size
        self.min_load_blocks = min_load_blocks
        self._loading: dict[str, _Loading] = {}
        self.num_loaded_requests = self.num_failed_requests = self.num_aborted_requests = 0

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._loading

    @property
    def num_loading(self) -> int:
        return len(self._loading)

    @property
    def num_held_blocks(self) -> int:
        return sum(len(entry.job.device_block_ids) for entry in self._loading.values())

    def submit(self, request: Request, idle: bool = False) -> bool:
        """Start loading `request`'s prefix from the store; False (nothing held) when there is nothing worth it.
        `idle`: the engine has nothing else to step; with no other load in flight and room in the pool the load is
        then begun on this thread at once (`WorkerStoreIO.copy_now`: no step of another request waits on it), its
        result taken by the next `poll` as any other."""
        if request.sampling.prompt_logprobs is not None:
            return False  # it computes every prompt position anyway
        max_blocks = (request.num_prompt_tokens - 1) // self.block_size
        key = self.cache_key.with_tenant(request.tenant)
        hashed = hash_prompt(key, request.prompt_token_ids[: max_blocks * self.block_size], self.block_size)
        match = self.cache.match_prefix_blocks(key, list(hashed.token_blocks))
        if max_blocks - match.num_blocks < self.min_load_blocks:
            return False
        self.cache.lock(match.node)
        first = match.num_blocks
        job = LoadJob(request.request_id, namespace_of(key), list(hashed.block_hashes[first:]))
        self._loading[request.request_id] = _Loading(request, job, match.node, list(hashed.token_blocks[first:]))
        if self.pool.num_free_blocks >= len(job.block_hashes):  # room without evicting: one trip
            job.device_block_ids = self.pool.allocate(len(job.block_hashes))
            if not (idle and not self._loading.keys() - {request.request_id} and self.io.copy_now(job)):
                self.io.acquire_and_copy(job)
        else:
            self.io.acquire(job)
        return True

    def abort(self, request_id: str) -> bool:
        entry = self._loading.get(request_id)
        if entry is None:
            return False
        entry.aborted = True
        return True

    def poll(self, on_aborted: Callable[[Request], None], wait_s: float = 0.0) -> list[Request]:
        """Advance every load whose IO step finished, waiting up to `wait_s` for one when some are loading (an engine
        with nothing else to step); returns the requests ready for the scheduler."""
        ready = []
        for kind, job in self.io.take_results(wait_s if self._loading else 0.0):
            entry = self._loading.get(job.request_id)
            if entry is None or entry.job is not job:
                continue
            if kind == "acquired" and not entry.aborted and (job.slots or job.num_elsewhere):
                # What the own node holds and, past it, what other nodes held when asked: the copy goes on to them
                # (blocks it does not fill, a node having lost some since, go back unused)
                job.device_block_ids = self._allocate(len(job.slots) + job.num_elsewhere)
                if job.device_block_ids:
                    job.slots = job.slots[: len(job.device_block_ids)]
                    self.io.copy_in(job)
                    continue
            if kind == "copied" and not entry.aborted:
                self.num_loaded_requests += self._adopt(entry)
            elif kind == "failed":
                self.num_failed_requests += 1
            self._end(entry)
            if entry.aborted:
                self.num_aborted_requests += 1
                on_aborted(entry.request)
            else:
                ready.append(entry.request)
        return ready

    def _allocate(self, num_blocks: int) -> list[int]:
        shortfall = num_blocks - self.pool.num_free_blocks
        if shortfall > 0:
            self.cache.evict(shortfall)  # unlocked cached blocks only: the prefix below is locked
        return self.pool.allocate(min(num_blocks, self.pool.num_free_blocks))

    def _adopt(self, entry: _Loading) -> bool:
        """Cache the blocks copied below the locked prefix; False when there were none."""
        job = entry.job
        num = job.num_copied  # the leading blocks copied (the rest are released unused)
        if not num:
            return False
        # The store has them: caching them writes nothing, but for the copies another node granted this one
        copies = set(job.copies).intersection(job.block_hashes[:num])
        self.io.skip_saves, self.io.copy_saves = set(job.block_hashes[:num]) - copies, copies
        try:
            self.cache.insert_from_blocks(entry.node, entry.token_blocks[:num], job.device_block_ids[:num],
                                          job.block_hashes[:num])
        finally:
            self.io.skip_saves, self.io.copy_saves = set(), set()
        return True

    def _end(self, entry: _Loading) -> None:
        """Let go of everything the load holds: its device blocks (the cache keeps its own reference on those it
        adopted), the lock on the prefix, the lease."""
        job = entry.job
        self.pool.release(job.device_block_ids)
        job.device_block_ids = []
        self.cache.unlock(entry.node)
        self.io.release(job)
        del self._loading[job.request_id]
