"""The cluster KV store's policy core and its directory: placement, tiers, GDSF eviction, replication, events."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvbaton.cache.kv_store import DISK, DRAM, KVStore, StoreConfig, capacity_blocks
from kvbaton.cache.store_directory import StoreDirectory

NODES = ("n0", "n1", "n2")


def _flat(depth: int) -> float:
    return 1.0


def _store(dram: int = 4, disk: int = 0, **kwargs) -> KVStore:
    return KVStore(StoreConfig(dram, disk, **kwargs), NODES)


def _put(store: KVStore, writer: str, hashes: list[int], namespace: object = "k", first_depth: int = 0,
         cost=_flat) -> int:
    return len(store.put(writer, hashes, -1 if first_depth == 0 else hashes[0] - 1, namespace, first_depth, cost))


def _feed(directory: StoreDirectory, store: KVStore) -> None:
    for node_id in NODES:
        if not directory.on_events(node_id, store.take_events(node_id)):
            directory.apply_snapshot(node_id, store.snapshot(node_id))


def test_capacity_from_gb():
    assert capacity_blocks(256, 131072 * 64) == 30517
    assert capacity_blocks(0, 10) == 0


def test_one_copy_per_block_on_the_writer_node():
    store = _store()
    assert _put(store, "n1", [1, 2, 3]) == 3
    assert _put(store, "n2", [1, 2, 3]) == 0  # held already: nothing stored again
    assert [store.locations(h) for h in (1, 2, 3)] == [{"n1": DRAM}] * 3
    assert store.match([1, 2, 3, 4], "k") == 3
    store.check_invariants()


def test_another_namespace_never_matches():
    store = _store()
    _put(store, "n0", [1, 2], namespace="tenant-a")
    assert store.match([1, 2], "tenant-b") == 0
    assert store.match([1, 2], "tenant-a") == 2
    assert _put(store, "n0", [1, 2], namespace="tenant-b") == 0  # a colliding hash is not stored twice


def test_dram_victims_move_to_disk_and_a_disk_hit_comes_back():
    store = _store(dram=2, disk=2)
    _put(store, "n0", [1, 2])
    _put(store, "n0", [11, 12])  # DRAM holds 2: the older chain moves to disk, its tail first
    assert store.locations(11) == {"n0": DRAM} and store.locations(1) == {"n0": DISK}
    _put(store, "n0", [21])  # disk full too: its victim leaves the node
    assert store.num_evicted_blocks == 1 and store.num_blocks == 4
    survivor = next(h for h in (1, 2) if store.locations(h))
    store.on_loaded("n0", [(survivor, "n0")])  # a disk copy read is promoted to DRAM
    assert store.locations(survivor) == {"n0": DRAM}
    store.check_invariants()


def test_gdsf_keeps_reused_and_costly_blocks_and_trims_prefixes_from_the_end():
    store = _store(dram=3)
    _put(store, "n0", [1, 2])
    store.on_loaded("n0", [(1, "n0"), (2, "n0")])  # reused: 2 uses each
    _put(store, "n0", [7])
    _put(store, "n0", [8])  # full: the once-used block 7 goes, not the reused chain
    assert store.locations(7) == {} and store.locations(1) and store.locations(2)
    # equal uses: the deepest block of a chain goes first
    store = _store(dram=3)
    _put(store, "n0", [1, 2, 3])
    _put(store, "n0", [9])
    assert store.locations(3) == {} and store.locations(1) and store.locations(2)
    # a block costlier to recompute outlives a cheap one with the same uses
    store = _store(dram=2)
    store.put("n0", [5], 0, "k", 0, lambda depth: 10.0)
    store.put("n0", [6], 0, "k", 0, lambda depth: 1.0)
    store.put("n0", [4], 0, "k", 0, lambda depth: 5.0)
    assert store.locations(6) == {} and store.locations(5)


def test_aging_lets_new_blocks_push_out_old_hot_ones_eventually():
    store = _store(dram=2)
    _put(store, "n0", [1])
    for _ in range(3):
        store.on_loaded("n0", [(1, "n0")])  # 4 uses
    for h in range(100, 112):
        _put(store, "n0", [h])
    assert store.locations(1) == {}  # the inflation clock rose past its old priority


def test_pinned_blocks_are_never_evicted():
    store = _store(dram=2)
    _put(store, "n0", [1, 2])
    store.pin([1, 2])
    assert _put(store, "n0", [3]) == 0 and store.num_dropped_puts == 1
    store.unpin([1, 2])
    assert _put(store, "n0", [3]) == 1
    store.check_invariants()


def test_clear_drops_every_unpinned_block_of_the_node_in_one_event_and_keeps_the_pinned():
    store = _store(dram=2, disk=2)
    _put(store, "n0", [1, 2, 3, 4])  # two in DRAM, two moved to disk
    _put(store, "n1", [9])
    store.take_events("n0")
    store.pin([4])
    assert store.clear("n0") == 3 and store.clear("n2") == 0
    assert [store.locations(h) for h in (1, 2, 3, 9)] == [{}, {}, {}, {"n1": DRAM}]
    assert store.locations(4) and store.num_blocks == 2
    (event,) = store.take_events("n0")
    assert event.kind == "evicted" and sorted(event.block_hashes) == [1, 2, 3]
    store.check_invariants()
    store.unpin([4])
    assert store.clear("n0") == 1 and _put(store, "n0", [1, 2]) == 2  # room again, nothing stale in the heaps
    store.check_invariants()


def test_hot_blocks_replicate_on_the_reader_node_after_two_remote_loads():
    store = _store(replicate_after_remote_loads=2, max_replicas=2)
    _put(store, "n0", [1])
    assert store.best_source(1, "n1") == ("n0", DRAM)
    store.on_loaded("n1", [(1, "n0")])
    assert store.locations(1) == {"n0": DRAM}
    store.on_loaded("n1", [(1, "n0")])
    assert store.locations(1) == {"n0": DRAM, "n1": DRAM} and store.num_replicated_blocks == 1
    assert store.best_source(1, "n1") == ("n1", DRAM)
    for _ in range(3):
        store.on_loaded("n2", [(1, "n0")])
    assert len(store.locations(1)) == 2  # at most max_replicas copies
    store.check_invariants()


def test_node_loss_drops_its_blocks_and_the_directory_follows():
    store, directory = _store(), StoreDirectory()
    _put(store, "n0", [1, 2])
    _put(store, "n1", [3])
    _feed(directory, store)
    assert directory.match([1, 2, 9]) == 2 and directory.sources([3], "n0") == [("n1", DRAM)]
    assert sorted(store.remove_node("n0")) == [1, 2]
    assert store.match([1], "k") == 0
    _feed(directory, store)
    assert directory.match([1]) == 0 and directory.num_blocks("n0") == 0
    store.add_node("n0")  # back, empty, numbering on from its CLEARED
    _put(store, "n0", [5])
    _feed(directory, store)
    assert directory.locations(5) == {"n0": DRAM}
    store.check_invariants()
    directory.check_invariants()


def test_a_missed_event_is_a_gap_and_a_snapshot_resyncs():
    store, directory = _store(), StoreDirectory()
    _put(store, "n0", [1])
    store.take_events("n0")  # lost on the way
    _put(store, "n0", [2])
    assert not directory.on_events("n0", store.take_events("n0"))
    directory.apply_snapshot("n0", store.snapshot("n0"))
    assert directory.match([1, 2]) == 2
    # two directories read the same streams independently (several routers)
    other = StoreDirectory()
    other.apply_snapshot("n0", store.snapshot("n0"))
    assert other.locations(1) == directory.locations(1)


_OPS = st.lists(st.one_of(
    st.tuples(st.just("put"), st.sampled_from(NODES), st.integers(0, 5), st.integers(1, 4)),
    st.tuples(st.just("load"), st.sampled_from(NODES), st.integers(0, 5), st.integers(1, 4)),
    st.tuples(st.just("pin"), st.sampled_from(NODES), st.integers(0, 5), st.integers(1, 3)),
    st.tuples(st.just("unpin"), st.sampled_from(NODES), st.integers(0, 5), st.integers(1, 3)),
    st.tuples(st.just("lose"), st.sampled_from(NODES), st.just(0), st.just(0)),
    st.tuples(st.just("drop_events"), st.sampled_from(NODES), st.just(0), st.just(0)),
    st.tuples(st.just("clear"), st.sampled_from(NODES), st.just(0), st.just(0)),
), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=_OPS, dram=st.integers(0, 4), disk=st.integers(0, 3), replicate=st.integers(0, 3))
def test_random_put_get_evict_and_node_loss_keep_the_invariants(ops, dram, disk, replicate):
    store = KVStore(StoreConfig(dram, disk, replicate_after_remote_loads=replicate, max_replicas=2), NODES)
    directory = StoreDirectory()
    pins: list[list[int]] = []
    for op, node, chain, length in ops:
        hashes = [chain * 100 + i for i in range(length)]  # chain c's blocks: c*100, c*100+1, ...
        if op == "put":
            store.put(node, hashes, -chain - 1, "k", 0, lambda depth: 1.0 + depth)
        elif op == "load":
            num = store.match(hashes, "k")
            sources = [(h, store.best_source(h, node)[0]) for h in hashes[:num]]
            store.on_loaded(node, sources)
        elif op == "pin":
            store.pin(hashes)
            pins.append(hashes)
        elif op == "unpin" and pins:
            store.unpin(pins.pop())
        elif op == "lose":
            store.remove_node(node)
            store.add_node(node)
        elif op == "drop_events":
            store.take_events(node)
        elif op == "clear":
            store.clear(node)
            held = store.nodes[node].entries.values()
            assert all(entry.num_pins for entry in held), "clear left an unpinned block"
        store.check_invariants()
        if op != "drop_events":
            _feed(directory, store)
            directory.check_invariants()
            for c in range(6):
                for i in range(4):
                    assert directory.locations(c * 100 + i) == store.locations(c * 100 + i)
        assert all(len(store.locations(h)) <= 2 for c in range(6) for h in range(c * 100, c * 100 + 4))
