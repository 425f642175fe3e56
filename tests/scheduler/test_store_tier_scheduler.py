"""Two LocalSchedulers on two store nodes sharing one cluster KV store, run against a fake executor keeping "KV".

The fake KV of a position is the token prefix up to it (`store_harness`), kept per device block on each worker
and per block hash in the store: a save, load or write-through of the wrong block, or a loaded block at the wrong
position, shows up as a chunk reading context that is not its own, or as cached or stored blocks whose contents
disagree with their path.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvbaton.cache.block_pool import BlockPool
from kvbaton.cache.hashing import CacheKey
from kvbaton.cache.kv_store import KVStore, StoreConfig
from kvbaton.cache.radix_cache import RadixCache
from kvbaton.cache.store_tier import StoreTier
from kvbaton.core.config import SchedulerConfig
from kvbaton.core.request import Request
from kvbaton.core.step import SampledToken, StepResult
from kvbaton.scheduler.local_scheduler import LocalScheduler
from tests.scheduler.helpers import BLOCK_SIZE, CACHE_KEY, make_request
from tests.scheduler.store_harness import Contents, FakeKV, FakeStoreIO, prompt


class Worker:
    def __init__(self, node_id: str, store: KVStore, store_kv: dict[int, Contents], num_blocks: int) -> None:
        self.kv = FakeKV()
        self.pool = BlockPool(num_blocks)
        self.io = FakeStoreIO(self.kv, store_kv, store, node_id)
        self.tier = StoreTier(store, node_id, self.io, lambda depth: 1.0)
        self.cache = RadixCache(self.pool, BLOCK_SIZE, self.tier)  # type: ignore[arg-type]
        self.sched = LocalScheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4), BLOCK_SIZE,
                                    self.pool, self.cache, CACHE_KEY)
        self.now = 0.0

    def step(self, sequences: list[tuple[CacheKey, list[int]]]) -> None:
        self.now += 1.0
        plan = self.sched.schedule(self.now)
        self.kv.execute(self.sched, plan)
        sampled = {c.request_id: SampledToken(7) for c in plan.chunks if c.samples}
        self.sched.update(plan, StepResult(plan.step_id, sampled), self.now)
        for request in self.sched.take_finished():
            sequences.append((CACHE_KEY.with_tenant(request.tenant), request.all_token_ids))

    def check(self, sequences: list[tuple[CacheKey, list[int]]]) -> None:
        self.sched.check_invariants()
        self.cache.check_invariants()  # and the store's
        self.kv.check_cached(self.cache, sequences)
        self.io.check_stored(sequences)  # the store's blocks, whichever worker wrote them


def make_cluster(num_blocks: int = 12, dram: int = 6, disk: int = 4) -> tuple[KVStore, list[Worker]]:
    store = KVStore(StoreConfig(dram, disk), ("n0", "n1"))
    store_kv: dict[int, Contents] = {}
    return store, [Worker(n, store, store_kv, num_blocks) for n in ("n0", "n1")]


def run(worker: Worker, request: Request, sequences) -> Request:
    worker.sched.add_request(request)
    sequences.append((CACHE_KEY, list(request.prompt_token_ids)))
    for _ in range(50):
        if not worker.sched.has_unfinished_requests():
            return request
        worker.step(sequences)
    raise AssertionError("never finished")


def test_a_prefix_computed_on_one_node_is_loaded_on_the_other_with_its_kv():
    _, (w0, w1) = make_cluster()
    sequences: list = []
    first = run(w0, make_request("a", prompt(0, 0)), sequences)
    # its 3 prompt blocks and the block its output filled (14 + 3 computed tokens) are written through
    assert first.num_cached_tokens == 0 and w0.tier.num_saved_blocks == 4
    second = run(w1, make_request("b", prompt(0, 1)), sequences)
    assert second.num_cached_tokens == 12 and w1.tier.num_remote_loaded_blocks == 3
    for worker in (w0, w1):
        worker.check(sequences)
    other = run(w1, make_request("c", prompt(0, 2), tenant="t"), sequences)  # another tenant: no hit
    assert other.num_cached_tokens == 0


_OPS = st.lists(st.tuples(st.sampled_from(("add", "step", "step", "step", "abort", "lose")), st.integers(0, 1),
                          st.integers(0, 3)), max_size=50)


@settings(max_examples=60, deadline=None)
@given(ops=_OPS, dram=st.integers(0, 6), disk=st.integers(0, 4))
def test_random_adds_steps_aborts_and_node_loss_keep_device_and_store_consistent(ops, dram, disk):
    store, workers = make_cluster(dram=dram, disk=disk)
    sequences: list = []
    num_added = 0
    for op, index, group in ops:
        worker = workers[index]
        if op == "add":
            num_added += 1
            request = make_request(f"r{num_added}", prompt(group, num_added), max_tokens=3)
            worker.sched.add_request(request)
            sequences.append((CACHE_KEY, list(request.prompt_token_ids)))
        elif op == "step":
            worker.step(sequences)
        elif op == "abort" and sequences:
            worker.sched.abort_request(f"r{group % max(num_added, 1) + 1}", worker.now)  # unknown ids are ignored
            worker.sched.take_finished()
        elif op == "lose":
            store.remove_node(f"n{index}")
            store.add_node(f"n{index}")
        for w in workers:
            w.check(sequences)
    for worker in workers:  # drain: every request ends, and the device holds only cached blocks
        for _ in range(200):
            if not worker.sched.has_unfinished_requests():
                break
            worker.step(sequences)
        assert not worker.sched.has_unfinished_requests()
        assert worker.pool.num_used_blocks == worker.cache.num_cached_blocks
        worker.check(sequences)
