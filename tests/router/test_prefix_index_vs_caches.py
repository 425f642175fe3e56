"""Regressions: the global prefix index against real worker caches; the pair choice."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvbaton.cache.block_pool import BlockPool
from kvbaton.cache.events import KVEvent, KVEventKind
from kvbaton.cache.hashing import CacheKey, hash_block_tokens
from kvbaton.cache.radix_cache import RadixCache
from kvbaton.router.base import RouteRequest
from kvbaton.router.load import WorkerStats
from kvbaton.router import block_map
from kvbaton.router.prefix_index import GlobalPrefixIndex
from kvbaton.router.state import RouterState
from kvbaton.router.pairs import PairChoiceConfig, PairChooser

KEY = CacheKey("m", "l")
BS = 2
WORKERS = ["w0", "w1"]
NUM_POOL_BLOCKS = 8


class _Worker:
    """A worker's real radix cache and the events it has published but the router has not applied yet."""

    def __init__(self) -> None:
        self.pool = BlockPool(NUM_POOL_BLOCKS)
        self.cache = RadixCache(self.pool, BS)
        self.outbox: list[KVEvent] = []

    def insert(self, token_ids: list[int]) -> None:
        match = self.cache.match_prefix(KEY, token_ids)
        num_new = len(token_ids) // BS - match.num_blocks
        if num_new > self.pool.num_free_blocks:
            self.cache.evict(num_new - self.pool.num_free_blocks)
        if num_new > self.pool.num_free_blocks:
            return
        self.pool.ref(match.block_ids)
        block_ids = list(match.block_ids) + self.pool.allocate(num_new)
        self.cache.insert(KEY, token_ids, block_ids)
        self.pool.release(block_ids)  # the request ends: only the cache's references remain

    def cached_depth(self, token_ids: list[int]) -> int:
        return self.cache.match_prefix(KEY, token_ids, touch=False).num_blocks


def _tokens(path: list[int]) -> list[int]:
    return [t for b in path for t in [b] * BS]


paths = st.lists(st.integers(0, 2), min_size=1, max_size=5)
worker_ops = st.one_of(
    st.tuples(st.just("insert"), st.sampled_from(WORKERS), paths),
    st.tuples(st.just("evict"), st.sampled_from(WORKERS), st.integers(1, 4)),
    st.tuples(st.just("clear"), st.sampled_from(WORKERS), st.just(0)),
    st.tuples(st.just("deliver"), st.sampled_from(WORKERS), st.integers(0, 3)),  # the first n pending batches' events
    st.tuples(st.just("duplicate"), st.sampled_from(WORKERS), st.just(0)),  # resend what was delivered last
    st.tuples(st.just("lose"), st.sampled_from(WORKERS), st.just(0)),  # drop the oldest pending event (not the last)
    st.tuples(st.just("restart"), st.sampled_from(WORKERS), st.just(0)),  # the worker restarts empty
)


@settings(max_examples=300, deadline=None)
@given(st.lists(worker_ops, max_size=40), st.lists(paths, min_size=1, max_size=8),
       st.sampled_from([0, 2, block_map._SCANS_BEFORE_MEMBERS]))
def test_index_fed_by_events_matches_the_workers_caches(ops: list[tuple[str, str, object]],
                                                        probes: list[list[int]], scans_before_members: int) -> None:
    """Once every published event is applied (snapshots on gaps), each worker's match equals its real cache's;
    with membership lookups by scan, by the kept set from the first, or switching mid-sequence."""
    index = GlobalPrefixIndex()
    index._blocks._num_scans = block_map._SCANS_BEFORE_MEMBERS - scans_before_members
    workers = {w: _Worker() for w in WORKERS}
    last_delivered: dict[str, list[KVEvent]] = {w: [] for w in WORKERS}

    def deliver(worker_id: str, events: list[KVEvent]) -> None:
        if not index.on_kv_events(worker_id, events):
            worker = workers[worker_id]
            worker.outbox.extend(worker.cache.take_events())  # the worker drains its queue before snapshotting
            worker.outbox.clear()  # ... and the snapshot covers all of it
            snapshot = worker.cache.snapshot()
            index.apply_snapshot(worker_id, [KVEvent(worker.cache.last_seq, KVEventKind.CLEARED, ()), *snapshot])
        last_delivered[worker_id] = events

    for kind, worker_id, arg in ops:
        worker = workers[worker_id]
        if kind == "insert":
            worker.insert(_tokens(arg))  # type: ignore[arg-type]
        elif kind == "evict":
            worker.cache.evict(arg)  # type: ignore[arg-type]
        elif kind == "clear":
            worker.cache.clear()
        elif kind == "restart":
            index.remove_worker(worker_id)
            workers[worker_id] = _Worker()
            last_delivered[worker_id] = []
        elif kind == "lose":
            worker.outbox.extend(worker.cache.take_events())
            if len(worker.outbox) >= 2:  # a later event reveals the gap (a lost last event goes unnoticed)
                worker.outbox[:1] = []
        elif kind == "duplicate":
            deliver(worker_id, last_delivered[worker_id])
        else:
            worker.outbox.extend(worker.cache.take_events())
            batch, worker.outbox = worker.outbox[: arg], worker.outbox[arg:]  # type: ignore[misc]
            deliver(worker_id, batch)
        index.check_invariants()
    for worker_id, worker in workers.items():  # flush: everything published reaches the router
        worker.outbox.extend(worker.cache.take_events())
        batch, worker.outbox = worker.outbox, []
        deliver(worker_id, batch)
    index.check_invariants()
    for path in probes:
        tokens = _tokens(path)
        hashes = tuple(hash_block_tokens(KEY, tokens, BS))
        matched = index.match(hashes)
        for worker_id, worker in workers.items():
            assert matched.get(worker_id, 0) == worker.cached_depth(tokens), (worker_id, path)


# ---- pair choice: decode workers between heartbeats ---------------------------------------------
def test_back_to_back_pairs_spread_over_identical_decode_workers_between_heartbeats() -> None:
    """A burst arriving between two heartbeats went wholly to the first decode worker by id (its batch and free
    blocks were read from the last heartbeat only); each handoff now counts on its decode worker until then."""
    state = RouterState(block_size=16)
    for worker in ("p0", "d0", "d1"):
        state.load.on_stats(WorkerStats(worker, 0, 0, 1000, 0, 0, 0, 16), 0.0)
    pairs = PairChooser(state, PairChoiceConfig(local_prefill_threshold_tokens=0))
    decode_workers = []
    for i in range(4):
        r = RouteRequest.from_tokens(f"r{i}", list(range(100 * i, 100 * i + 64)), KEY, 16, 8)
        decode_workers.append(pairs.choose_decode(r, {"d0": "shm", "d1": "shm"}))
        pairs.on_handed_off(r, decode_workers[-1], 0.01 * i)
    assert decode_workers == ["d0", "d1", "d0", "d1"]
    assert state.load.free_blocks("d0") == 1000 - 2 * 4  # two 64-token prompts reserved there
    state.load.on_stats(WorkerStats("d0", 0, 0, 1000, 0, 0, 0, 16), 1.0)  # the heartbeat reflects them (none ran)
    assert state.load.free_blocks("d0") == 1000


def test_prefill_queue_excludes_kv_held_for_handoffs() -> None:
    """A prefill worker's queue was priced from `load_tokens`, which adds the KV tokens in use (prompts already
    prefilled, held until their decode worker acknowledges) to the tokens waiting; an idle worker holding one
    long prompt for a handoff lost to a worker with a real queue."""
    state = RouterState(block_size=16)
    state.load.on_stats(WorkerStats("p0", 0, 250, 750, 0, 0, 0, 16), 0.0)  # 4000 tokens computed, held
    state.load.on_stats(WorkerStats("p1", 1000, 0, 1000, 1, 0, 0, 16), 0.0)  # 1000 tokens still to prefill
    state.load.on_stats(WorkerStats("d0", 0, 0, 1000, 0, 0, 0, 16), 0.0)
    pairs = PairChooser(state, PairChoiceConfig(local_prefill_threshold_tokens=0))
    worker, prefill_s = pairs.choose_prefill(RouteRequest.from_tokens("r", list(range(200)), KEY, 16, 8),
                                             ["p0", "p1"], {})
    assert worker == "p0"
    assert prefill_s == state.prefill_model.predict(200, 0)  # nothing queued ahead of it
