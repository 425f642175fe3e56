"""GlobalPrefixIndex: matching, routing feedback, KV events (gaps, eviction, snapshots), worker removal, bound."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbaton.cache.events import KVEvent, KVEventKind
from kvbaton.cache.hashing import CacheKey, hash_block_tokens
from kvbaton.router import block_map
from kvbaton.router.prefix_index import GlobalPrefixIndex

KEY = CacheKey("m", "l")
BS = 4


def chain(*blocks: int) -> list[int]:
    """Chained hashes of blocks whose tokens are all equal to the given values."""
    tokens = [t for b in blocks for t in [b] * BS]
    return hash_block_tokens(KEY, tokens, BS)


def stored(seq: int, hashes: list[int], parent: int | None = None) -> KVEvent:
    return KVEvent(seq, KVEventKind.STORED, tuple(hashes), parent if parent is not None else KEY.root_hash, BS)


def evicted(seq: int, hashes: list[int]) -> KVEvent:
    return KVEvent(seq, KVEventKind.EVICTED, tuple(hashes), None, BS)


def test_match_reports_each_workers_depth_in_one_walk() -> None:
    index = GlobalPrefixIndex()
    a = chain(1, 2, 3, 4)
    index.on_routed("w0", a)
    index.on_routed("w1", a[:2])
    index.on_routed("w2", chain(1, 9))
    assert index.match(a) == {"w0": 4, "w1": 2, "w2": 1}
    assert index.match(chain(1, 2, 7)) == {"w0": 2, "w1": 2, "w2": 1}
    assert index.match(chain(5)) == {}
    assert index.match([]) == {}
    assert index.match(tuple(a[:3])) == {"w0": 3, "w1": 2, "w2": 1}
    index.check_invariants()


def test_routing_counts_reuse_per_block() -> None:
    index = GlobalPrefixIndex()
    index.on_routed("w0", chain(1, 2))
    index.on_routed("w1", chain(1, 3))
    assert index.num_routed(chain(1)[0]) == 2
    assert index.num_routed(chain(1, 2)[1]) == 1
    assert index.holders(chain(1)[0]) == {"w0", "w1"}
    index.check_invariants()


def test_events_store_evict_and_detect_gaps() -> None:
    index = GlobalPrefixIndex()
    a = chain(1, 2, 3)
    assert index.on_kv_events("w0", [stored(1, a[:2]), stored(2, a[2:], parent=a[1])])
    assert index.match(a) == {"w0": 3}
    # Evicting a middle block drops it and everything below it (the worker's cache is prefix-closed).
    assert index.on_kv_events("w0", [evicted(3, [a[1]])])
    assert index.match(a) == {"w0": 1}
    assert index.num_blocks == 1
    # Duplicates are skipped, a gap stops processing and reports False.
    assert index.on_kv_events("w0", [evicted(3, [a[0]])])
    assert index.match(a) == {"w0": 1}
    assert not index.on_kv_events("w0", [stored(5, a[1:2], parent=a[0]), stored(6, a[2:], parent=a[1])])
    assert index.match(a) == {"w0": 1}
    assert index.last_seq("w0") == 3
    index.check_invariants()


def test_snapshot_replaces_worker_state_and_resumes_seq() -> None:
    index = GlobalPrefixIndex()
    a, b = chain(1, 2), chain(7, 8)
    index.on_routed("w0", a)
    index.on_routed("w1", a)
    index.apply_snapshot("w0", [stored(10, b)])
    assert index.match(a) == {"w1": 2}
    assert index.match(b) == {"w0": 2}
    assert index.on_kv_events("w0", [evicted(11, [b[1]])])
    assert index.match(b) == {"w0": 1}
    index.check_invariants()


def test_cleared_and_remove_worker_purge_only_that_worker() -> None:
    index = GlobalPrefixIndex()
    a = chain(1, 2, 3)
    index.on_routed("w0", a)
    index.on_routed("w1", a[:1])
    assert index.on_kv_events("w1", [KVEvent(1, KVEventKind.CLEARED, ())])
    assert index.match(a) == {"w0": 3}
    index.on_routed("w1", a)
    index.remove_worker("w0")
    assert index.match(a) == {"w1": 3}
    assert index.workers == ["w1"]
    index.remove_worker("w1")
    assert index.num_blocks == 0
    index.check_invariants()


def test_stored_under_unknown_parent_is_adopted_when_parent_appears() -> None:
    index = GlobalPrefixIndex()
    a = chain(1, 2, 3)
    assert index.on_kv_events("w1", [stored(1, a[2:], parent=a[1])])  # parent not indexed yet
    assert index.match(a) == {}
    index.on_routed("w0", a[:2])
    index.on_routed("w0", a)
    # Adoption attaches w1's block under its parent and records that w1 holds the parent chain too.
    assert index.match(a) == {"w0": 3, "w1": 3}
    index.check_invariants()


def test_orphan_is_attached_when_a_route_indexes_its_parent_without_walking_into_it() -> None:
    index = GlobalPrefixIndex()
    b0, b1 = chain(0, 0)
    assert index.on_kv_events("w1", [stored(1, [b1], parent=b0)])
    index.on_routed("w0", [b0])  # ends at the parent: never walks into the orphan
    assert index.match([b0, b1]) == {"w0": 1, "w1": 2}
    assert index.holders(b0) == {"w0", "w1"}
    index.check_invariants()
    # Once attached it is an ordinary child: w1 evicting its parent drops w1 from both blocks.
    assert index.on_kv_events("w1", [evicted(2, [b0])])
    assert index.match([b0, b1]) == {"w0": 1}
    assert index.num_blocks == 1
    index.check_invariants()


def test_orphan_waiting_on_a_middle_block_splits_the_new_run_there() -> None:
    index = GlobalPrefixIndex()
    a, b = chain(1, 2, 3), chain(1, 9)  # share the first block, then diverge
    assert index.on_kv_events("w1", [stored(1, b[1:], parent=b[0])])
    assert index.on_kv_events("w2", [stored(1, a[2:], parent=a[1]), stored(2, b[1:], parent=b[0])])
    index.on_routed("w0", a)  # indexes a[0] (w1's and w2's parent) and a[1] (w2's) in one call
    assert index.match(a) == {"w0": 3, "w1": 1, "w2": 3}
    assert index.match(b) == {"w0": 1, "w1": 2, "w2": 2}
    assert index.holders(a[1]) == {"w0", "w2"}
    index.check_invariants()


def test_deleted_orphan_is_forgotten() -> None:
    index = GlobalPrefixIndex()
    a = chain(1, 2)
    assert index.on_kv_events("w1", [stored(1, a[1:], parent=a[0])])
    index.remove_worker("w1")
    index.on_routed("w0", a[:1])
    assert index.match(a) == {"w0": 1}
    assert index.num_blocks == 1
    index.check_invariants()


def test_bound_evicts_least_recently_routed_first() -> None:
    index = GlobalPrefixIndex(max_blocks=6)
    old, mid, new = chain(1, 2), chain(3, 4), chain(5, 6)
    index.on_routed("w0", old)
    index.on_routed("w0", mid)
    index.on_routed("w0", new)
    index.on_routed("w0", old)  # touch: now most recent
    index.on_routed("w1", chain(7, 8))
    assert index.num_blocks == 6
    assert index.match(mid) == {}
    assert index.match(old) == {"w0": 2}
    assert index.match(new) == {"w0": 2}
    assert index.num_evicted_blocks == 2
    index.check_invariants()


def test_bound_trims_a_long_cold_leaf_instead_of_dropping_it() -> None:
    index = GlobalPrefixIndex(max_blocks=5)
    a = chain(1, 2, 3, 4)
    index.on_routed("w0", a)
    index.on_routed("w0", chain(9, 8))
    assert index.num_blocks == 5
    assert index.match(a) == {"w0": 3}
    index.check_invariants()


def test_coldest_lists_least_recent_segments_first() -> None:
    index = GlobalPrefixIndex()
    index.on_routed("w0", chain(1, 2))
    index.on_routed("w0", chain(3))
    index.on_routed("w0", chain(3))
    assert index.coldest("w0", 10) == [(2, 1), (1, 2)]
    assert index.coldest("w0", 1) == [(1, 1)]
    assert index.coldest("nobody", 4) == []


def _index_state(index: GlobalPrefixIndex, hashes: list[int]) -> tuple[object, ...]:
    """What the router reads: depths, holders and reuse of every block, each worker's coldest segments."""
    return (index.match(hashes), index.num_blocks, [index.holders(h) for h in hashes],
            [index.num_routed(h) for h in hashes], {w: index.coldest(w, 100) for w in index.workers})


def test_a_long_run_stored_chunk_by_chunk_splits_near_its_front() -> None:
    # Routed whole, then stored by its worker in 4-block chunks (chunked prefill): each store splits the run
    # where the chunk ends, the short head leaving the long rest in place; every block stays findable.
    a = chain(*range(1, 41))
    index = GlobalPrefixIndex()
    index.on_routed("w0", a)
    index.on_routed("w1", a[:6])
    for seq, start in enumerate(range(0, 40, 4), 1):
        assert index.on_kv_events("w0", [stored(seq, a[start : start + 4], parent=a[start - 1] if start else None)])
        index.check_invariants()
    assert index.match(a) == {"w0": 40, "w1": 6}
    assert [index.holders(h) for h in a] == [{"w0", "w1"}] * 6 + [{"w0"}] * 34
    # Segments [0:4] and [4:6] routed twice, [6:8] split off by the second chunk, then the chunks; a split keeps
    # the head more recent than its tail, and a store touches only its own path.
    assert index.coldest("w0", 100) == [(4, 2), (2, 1), (2, 2)] + [(4, 1)] * 8
    assert index.coldest("w1", 100) == [(2, 2), (4, 2)]
    # w1 evicts its deepest block: a split one block before the end of its run, the end leaving w1.
    assert index.on_kv_events("w1", [evicted(1, [a[5]])])
    assert index.match(a) == {"w0": 40, "w1": 5}
    index.check_invariants()


def test_an_evicted_run_equals_its_blocks_evicted_one_by_one() -> None:
    a = chain(*range(1, 13))
    b = chain(*range(1, 5), 50, 51)
    indexes = [GlobalPrefixIndex(), GlobalPrefixIndex()]
    for index in indexes:
        index.on_routed("w0", a)
        index.on_routed("w1", b)
        index.on_routed("w0", b)
    # Deepest first, as a radix cache lists them: w0 alone holds a's leaf, then a shared run (split per block).
    run = a[2:][::-1] + b[4:][::-1]
    assert indexes[0].on_kv_events("w0", [evicted(1, run)])
    assert indexes[1].on_kv_events("w0", [evicted(seq, [h]) for seq, h in enumerate(run, 1)])
    assert _index_state(indexes[0], a) == _index_state(indexes[1], a)
    assert _index_state(indexes[0], b) == _index_state(indexes[1], b)
    assert indexes[0].match(a) == {"w0": 2, "w1": 4} and indexes[0].match(b) == {"w0": 2, "w1": 6}
    for index in indexes:
        index.check_invariants()


def test_invalid_bound_is_rejected() -> None:
    with pytest.raises(ValueError):
        GlobalPrefixIndex(max_blocks=0)


# ---- property test: random operation sequences keep the structure consistent -------------------
WORKERS = ["w0", "w1", "w2"]
paths = st.lists(st.integers(0, 3), min_size=1, max_size=6)
ops = st.one_of(
    st.tuples(st.just("route"), st.sampled_from(WORKERS), paths),
    st.tuples(st.just("store"), st.sampled_from(WORKERS), paths),
    st.tuples(st.just("evict"), st.sampled_from(WORKERS), paths),
    st.tuples(st.just("evict_tail"), st.sampled_from(WORKERS), paths),
    st.tuples(st.just("clear"), st.sampled_from(WORKERS), paths),
    st.tuples(st.just("remove"), st.sampled_from(WORKERS), paths),
    st.tuples(st.just("snapshot"), st.sampled_from(WORKERS), paths),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(ops, max_size=40), st.integers(3, 30), st.sampled_from([0, 3, block_map._SCANS_BEFORE_MEMBERS]))
def test_random_operations_keep_invariants(operations: list[tuple[str, str, list[int]]], max_blocks: int,
                                           scans_before_members: int) -> None:
    """Membership lookups by scan, by the kept set from the first (0), and switching between them mid-sequence."""
    index = GlobalPrefixIndex(max_blocks=max_blocks)
    index._blocks._num_scans = block_map._SCANS_BEFORE_MEMBERS - scans_before_members
    seqs = {w: 0 for w in WORKERS}
    for kind, worker, blocks in operations:
        hashes = chain(*blocks)
        if kind == "route":
            index.on_routed(worker, hashes)
            assert index.match(hashes).get(worker, 0) == min(len(hashes), max_blocks) or index.num_evicted_blocks
        elif kind in ("store", "evict", "evict_tail", "clear"):
            seqs[worker] = max(seqs[worker], index.last_seq(worker)) + 1
            if kind == "store":
                event = stored(seqs[worker], hashes[-1:], parent=hashes[-2] if len(hashes) > 1 else None)
            elif kind == "evict":
                event = evicted(seqs[worker], hashes[-1:])
            elif kind == "evict_tail":  # leaf first, as an LRU radix cache evicts
                event = evicted(seqs[worker], hashes[len(hashes) // 2 :][::-1])
            else:
                event = KVEvent(seqs[worker], KVEventKind.CLEARED, ())
            assert index.on_kv_events(worker, [event])
        elif kind == "remove":
            index.remove_worker(worker)
            seqs[worker] = 0
        else:
            index.apply_snapshot(worker, [stored(seqs[worker] + 5, hashes)])
            seqs[worker] = index.last_seq(worker)
        index.check_invariants()
        matched = index.match(hashes)
        for holder, depth in matched.items():
            assert 1 <= depth <= len(hashes)
            assert holder in index.holders(hashes[depth - 1])
            assert depth == len(hashes) or holder not in index.holders(hashes[depth])


def _cyclic_garbage_after_dropping(close: bool) -> int:
    """Objects the cyclic collector frees once an index with routed and stored segments (orphans too) is dropped."""
    import gc

    index = GlobalPrefixIndex()
    index.on_routed("w0", chain(1, 2, 3, 4))
    index.on_routed("w1", chain(1, 2, 7))
    index.on_kv_events("w2", [stored(1, chain(1, 2, 3, 4, 5)[3:], parent=chain(1, 2, 3, 4)[2])])
    index.on_kv_events("w3", [stored(1, chain(8, 9)[1:], parent=chain(8)[0])])  # an orphan
    assert index.holders(chain(1)[0]) == {"w0", "w1", "w2"}  # maps the blocks (the lazy block map)
    index.check_invariants()
    gc.collect()
    if close:
        index.close()
    del index
    return gc.collect()


def test_close_leaves_the_index_to_reference_counting() -> None:
    # Segment parent <-> child links are cycles; the block map's liveness test is not one (a closure over the LRU).
    assert _cyclic_garbage_after_dropping(close=False) > 0
    assert _cyclic_garbage_after_dropping(close=True) == 0
