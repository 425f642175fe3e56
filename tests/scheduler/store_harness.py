"""A LocalScheduler whose prefix cache's tier is the KV store, run against a fake executor that keeps "KV".

The fake KV of a position is the token prefix up to it (`FakeKV.kv_at`), kept per device block and, on the
store's side, per block hash: a load or write-through of the wrong block, or a loaded block at the wrong position,
shows up as a chunk attending to positions that do not hold its own prefix, or as cached or stored blocks whose
contents disagree with their path. Shared by the scheduler's store tests; not collected itself.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbaton.cache.block_pool import BlockPool
from kvbaton.cache.hashing import CacheKey, hash_block_tokens, hash_prompt
from kvbaton.cache.kv_store import DISK, KVStore, StoreConfig
from kvbaton.cache.radix_cache import RadixCache
from kvbaton.cache.store_tier import StoreTier
from kvbaton.core.config import SchedulerConfig
from kvbaton.core.request import Request
from kvbaton.core.step import SampledToken, StepPlan, StepResult
from kvbaton.scheduler.local_scheduler import LocalScheduler
from tests.scheduler.helpers import BLOCK_SIZE, CACHE_KEY, make_request

Contents = dict[int, tuple]  # slot in the block -> the KV of that position (`FakeKV.kv_at`)
Sequences = list[tuple[CacheKey, list[int]]]  # (the key it is cached under, its tokens)
NODE_ID = "n0"  # the harness's one store node, the worker's own


class FakeKV:
    """The executor's side: what each device block holds, written by the plans it runs."""

    def __init__(self) -> None:
        self.device: dict[int, Contents] = {}

    def kv_at(self, tenant: str, tokens: Sequence[int], pos: int) -> tuple:
        """The KV of position `pos` of `tokens` computed for `tenant`: the token prefix up to it."""
        return tuple(tokens[: pos + 1])

    def block_contents(self, key: CacheKey, tokens: Sequence[int], index: int) -> Contents:
        """What block `index` of `tokens`, cached under `key`, holds when its KV is right."""
        start = index * BLOCK_SIZE
        return {slot: self.kv_at(key.tenant_salt, tokens, start + slot) for slot in range(BLOCK_SIZE)}

    def execute(self, sched: LocalScheduler, plan: StepPlan) -> None:
        """Check that every position a chunk attends to (cached, loaded or computed earlier) holds the request's own
        KV, then write the KV of every position it computes into its block table."""
        for chunk in plan.chunks:
            request = sched.get_request(chunk.request_id)
            assert request is not None
            tokens, tenant = request.all_token_ids, request.tenant
            for pos in range(chunk.start_pos):
                block_id, slot = chunk.block_ids[pos // BLOCK_SIZE], pos % BLOCK_SIZE
                held = self.device.get(block_id, {}).get(slot)
                assert held == self.kv_at(tenant, tokens, pos), (
                    f"{request.request_id} (tenant {tenant!r}) reads position {pos} holding {held}")
            for pos in range(chunk.start_pos, chunk.end_pos):
                block_id, slot = chunk.block_ids[pos // BLOCK_SIZE], pos % BLOCK_SIZE
                if slot == 0:
                    self.device[block_id] = {}  # a fresh use of the block: no stale slots
                self.device[block_id][slot] = self.kv_at(tenant, tokens, pos)

    def check_cached(self, cache: RadixCache, sequences: Sequences) -> None:
        """Every block on the cached device path of each sequence holds that sequence's KV."""
        for key, tokens in sequences:
            for index, block_id in enumerate(cache.match_prefix(key, tokens, touch=False).block_ids):
                assert self.device.get(block_id) == self.block_contents(key, tokens, index), (
                    f"block {block_id} at block {index} of {tokens} under {key}")


class FakeStoreIO:
    """One worker's side of the store's bytes (a `StoreIO`): copies between its device blocks (`kv.device`) and the
    store's blocks by hash (`store_kv`, shared by every worker of the store)."""

    def __init__(self, kv: FakeKV, store_kv: dict[int, Contents], store: KVStore, node_id: str) -> None:
        self.kv, self.store_kv, self.store, self.node_id = kv, store_kv, store, node_id
        self.num_loads = 0  # load calls: one per admission that loads
        self.num_disk_loaded_blocks = 0

    def save(self, block_hashes: list[int], device_block_ids: list[int]) -> None:
        for block_hash, block_id in zip(block_hashes, device_block_ids):
            contents = self.kv.device[block_id]
            assert len(contents) == BLOCK_SIZE, f"device block {block_id} written through before it was full"
            assert self.node_id in self.store.locations(block_hash), "saved where the store did not put it"
            self.store_kv[block_hash] = dict(contents)

    def load(self, block_hashes: list[int], sources: list[tuple[str, str]], device_block_ids: list[int]) -> None:
        assert len(block_hashes) == len(sources) == len(device_block_ids) == len(set(device_block_ids))
        for block_hash, (node_id, tier), block_id in zip(block_hashes, sources, device_block_ids):
            assert self.store.locations(block_hash).get(node_id) == tier, "loaded from where the block is not"
            assert self.store.nodes[node_id].entries[block_hash].num_pins > 0, "loaded a block no take pinned"
            self.kv.device[block_id] = dict(self.store_kv[block_hash])
            self.num_disk_loaded_blocks += tier == DISK
        self.num_loads += 1

    def check_stored(self, sequences: Sequences) -> None:
        """Every block the store holds under a sequence's key carries that sequence's KV at its position (a block
        held under another key with the same hash is not the sequence's)."""
        for key, tokens in sequences:
            for index, block_hash in enumerate(hash_block_tokens(key, tokens, BLOCK_SIZE)):
                holders = self.store.locations(block_hash)
                if holders and self.store.nodes[next(iter(holders))].entries[block_hash].namespace == key:
                    assert self.store_kv[block_hash] == self.kv.block_contents(key, tokens, index), (
                        f"stored block {index} of {tokens} under {key}")


class Harness:
    """A scheduler over a small pool and its radix cache, whose tier is a `StoreTier` over a one-node store of
    `num_dram_blocks` DRAM and `num_disk_blocks` disk blocks (no tier when both are 0), the fake executor and the
    store's fake IO. Every block costs the same to recompute, so the store's GDSF ranks blocks by their uses and the
    inflation clock alone, ties going to the deepest block, then to the one prioritised first."""

    def __init__(self, num_blocks: int, num_dram_blocks: int, num_disk_blocks: int = 0, *, budget: int = 64,
                 max_num_seqs: int = 8, policy: str = "fcfs", kv: FakeKV | None = None) -> None:
        self.kv = kv if kv is not None else FakeKV()
        self.pool = BlockPool(num_blocks)
        self.store: KVStore | None = None
        self.io: FakeStoreIO | None = None
        self.tier: StoreTier | None = None
        if num_dram_blocks or num_disk_blocks:
            self.store = KVStore(StoreConfig(num_dram_blocks, num_disk_blocks), [NODE_ID])
            self.io = FakeStoreIO(self.kv, {}, self.store, NODE_ID)
            self.tier = StoreTier(self.store, NODE_ID, self.io, lambda depth: 1.0)
        self.cache = RadixCache(self.pool, BLOCK_SIZE, self.tier)  # type: ignore[arg-type]
        config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, queue_policy=policy)
        self.sched = LocalScheduler(config, BLOCK_SIZE, self.pool, self.cache, CACHE_KEY)
        self.sequences: Sequences = []  # prompts, then finished requests' whole sequences
        self.finished: list[Request] = []
        self.now = 0.0

    def add(self, request: Request, *, seeded: bool = False) -> Request:
        """Queue `request`; `seeded`: with its prompt already hashed, as the simulator passes it."""
        key = CACHE_KEY.with_tenant(request.tenant)
        self.sched.add_request(request, hash_prompt(key, request.prompt_token_ids, BLOCK_SIZE) if seeded else None)
        self.sequences.append((key, list(request.prompt_token_ids)))
        return request

    def schedule(self) -> StepPlan:
        self.now += 1.0
        plan = self.sched.schedule(self.now)
        self.kv.execute(self.sched, plan)
        return plan

    def update(self, plan: StepPlan, token_id: int = 7) -> None:
        sampled = {c.request_id: SampledToken(token_id) for c in plan.chunks if c.samples}
        self.sched.update(plan, StepResult(plan.step_id, sampled), self.now)
        self.take_finished()
        self.check()

    def step(self, token_id: int = 7) -> StepPlan:
        plan = self.schedule()
        self.update(plan, token_id)
        return plan

    def take_finished(self) -> None:
        for request in self.sched.take_finished():
            self.finished.append(request)
            self.sequences.append((CACHE_KEY.with_tenant(request.tenant), request.all_token_ids))

    def run(self, request: Request, max_steps: int = 50) -> Request:
        self.add(request)
        self.drain(max_steps)
        return request

    def drain(self, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("requests never finished")

    def device_blocks(self, tokens: list[int], key: CacheKey = CACHE_KEY) -> int:
        """Leading blocks of `tokens` cached on the device under `key` (LRU order untouched)."""
        return self.cache.match_prefix(key, tokens, touch=False).num_blocks

    def stored_blocks(self, tokens: list[int], key: CacheKey = CACHE_KEY) -> int:
        """Leading blocks of `tokens` the store holds under `key` (changing nothing)."""
        if self.store is None:
            return 0
        return self.store.match(hash_block_tokens(key, tokens, BLOCK_SIZE), key)

    def store_entries(self) -> dict[int, tuple[str, int, float, int]]:
        """hash -> (tier, uses, GDSF priority, pins) of every block the store holds."""
        if self.store is None:
            return {}
        return {block_hash: (entry.tier, entry.uses, entry.priority, entry.num_pins)
                for block_hash, entry in self.store.nodes[NODE_ID].entries.items()}

    def num_pinned_store_blocks(self) -> int:
        return sum(num_pins > 0 for *_, num_pins in self.store_entries().values())

    def check(self) -> None:
        self.sched.check_invariants()  # and BlockManager.check_invariants(running)
        self.pool.check_invariants()
        self.cache.check_invariants()  # and the store's, and that blocks taken for a load are pinned
        self.kv.check_cached(self.cache, self.sequences)
        if self.io is not None:
            self.io.check_stored(self.sequences)

    def check_released(self) -> None:
        """Nothing runs: only the cache holds device blocks, no load pins a store block, and clearing the cache frees
        every device block and leaves the store as it was."""
        assert not self.sched.has_unfinished_requests()
        assert self.pool.num_used_blocks == self.cache.num_cached_blocks
        assert all(self.pool.ref_count(b) in (0, 1) for b in range(self.pool.num_blocks))
        self.check()
        assert self.num_pinned_store_blocks() == 0
        stored = self.store_entries()
        self.cache.clear()
        assert self.pool.num_free_blocks == self.pool.num_blocks
        if self.tier is not None:
            assert self.store_entries() == stored
            self.tier.check_invariants(set())


def prompt(group: int, suffix: int, num_prefix_blocks: int = 3) -> list[int]:
    """A shared prefix of `group` (whole blocks), then two tokens of its own."""
    return [100 * (group + 1) + i for i in range(num_prefix_blocks * BLOCK_SIZE)] + [9000 + suffix, 9100 + suffix]


def request_of(group: int, suffix: int, max_tokens: int = 2) -> Request:
    return make_request(f"g{group}-{suffix}", prompt(group, suffix), max_tokens=max_tokens)
