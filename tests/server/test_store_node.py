"""A live store node's state: the policy core's decisions followed by real slots and files, leases, invariants."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbaton.server.store_node import StoreNodeState
from kvbaton.transfer.store_disk import DiskBlockFiles

pytestmark = pytest.mark.timeout(120)

NS = ("rev", "layout", "")
BLOCK_BYTES = 64


def _payload(block_hash: int) -> bytes:
    return (block_hash % 251).to_bytes(1, "little") * BLOCK_BYTES


def _chain(first: int, num: int) -> list[int]:
    return list(range(first, first + num))


@pytest.fixture
def node(tmp_path: Path) -> Iterator[StoreNodeState]:
    state = StoreNodeState(BLOCK_BYTES, 16, dram_blocks=4, disk=DiskBlockFiles(tmp_path / "disk", 4), lease_s=5.0)
    yield state
    state.close()


def _put(node: StoreNodeState, hashes: list[int], parent: int = 0, ns: tuple[str, ...] = NS) -> int:
    return node.put(ns, parent, hashes, [_payload(h) for h in hashes])


def _read(node: StoreNodeState, slots: list[int]) -> list[bytes]:
    return [node.slots.read(slot) for slot in slots]


def test_put_then_acquire_reads_the_payloads(node: StoreNodeState) -> None:
    assert _put(node, _chain(10, 3)) == 3
    assert _put(node, _chain(10, 3)) == 0  # one copy
    lease, slots = node.acquire(NS, _chain(10, 4), now=0.0)
    assert lease > 0 and _read(node, slots) == [_payload(h) for h in _chain(10, 3)]
    node.check_invariants()
    assert node.release(lease) and not node.release(lease)
    node.check_invariants()


def test_clear_frees_every_slot_and_file_but_a_leased_blocks(node: StoreNodeState) -> None:
    _put(node, _chain(10, 6))  # four in DRAM, two on disk
    assert (node.num_dram_blocks, node.num_disk_blocks) == (4, 2)
    lease, slots = node.acquire(NS, _chain(10, 1), now=0.0)
    assert node.clear() == 5
    assert (node.num_dram_blocks, node.num_disk_blocks) == (1, 0) and node.slots.num_free_slots == 3
    assert node.disk is not None and not any(path.is_file() for path in node.disk.directory.rglob("*"))
    assert _read(node, slots) == [_payload(10)]  # the leased block is still there for its reader
    events, _ = node.events_since(0)
    assert events[-1].kind == "evicted" and sorted(events[-1].block_hashes) == _chain(11, 5)
    node.check_invariants()
    assert node.release(lease) and node.clear() == 1 and node.acquire(NS, _chain(10, 6), now=0.0) == (0, [])
    node.check_invariants()


def test_another_tenant_never_hits(node: StoreNodeState) -> None:
    _put(node, _chain(10, 2))
    assert node.acquire(("rev", "layout", "tenant-b"), _chain(10, 2), now=0.0) == (0, [])


def test_dram_overflow_goes_to_disk_and_comes_back_checked(node: StoreNodeState) -> None:
    _put(node, _chain(10, 4))
    _put(node, _chain(20, 4))  # DRAM holds 4: the first chain moves to disk
    assert node.disk.num_files() == 4
    lease, slots = node.acquire(NS, _chain(10, 4), now=0.0)
    assert _read(node, slots) == [_payload(h) for h in _chain(10, 4)]
    node.check_invariants()
    node.release(lease)


def test_a_corrupt_disk_block_is_a_miss_from_there_on(node: StoreNodeState) -> None:
    _put(node, _chain(10, 4))
    _put(node, _chain(20, 4))
    path = node.disk.path_of(12)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    lease, slots = node.acquire(NS, _chain(10, 4), now=0.0)
    assert _read(node, slots) == [_payload(10), _payload(11)]  # stops before the corrupt block
    assert node.disk.num_corrupt_blocks == 1 and 12 not in node.store.nodes[node.NODE].entries
    node.check_invariants()
    node.release(lease)
    node.check_invariants()


def test_pinned_blocks_stay_and_expired_leases_unpin(node: StoreNodeState) -> None:
    _put(node, _chain(10, 4))
    lease, slots = node.acquire(NS, _chain(10, 4), now=0.0)
    _put(node, _chain(20, 4))  # DRAM is all pinned: the new chain goes nowhere in DRAM
    assert _read(node, slots) == [_payload(h) for h in _chain(10, 4)]
    node.check_invariants()
    assert node.expire(now=4.0) == 0 and node.expire(now=5.0) == 1 and node.num_leases == 0
    assert not node.release(lease)
    node.check_invariants()


def test_a_wrong_payload_size_refuses_the_whole_put(node: StoreNodeState) -> None:
    with pytest.raises(Exception, match="payload"):
        node.put(NS, 0, [1, 2], [_payload(1), b"short"])
    assert node.store.num_blocks == 0
    node.check_invariants()


def test_events_since_a_seq_or_a_snapshot(node: StoreNodeState) -> None:
    _put(node, _chain(10, 2))
    events, snapshot = node.events_since(0)
    assert not snapshot and [e.block_hashes for e in events] == [(10,), (11,)]
    assert node.events_since(events[-1].seq) == ([], False)


_OPS = st.lists(st.one_of(
    st.tuples(st.just("put"), st.integers(0, 5), st.integers(1, 4)),
    st.tuples(st.just("acquire"), st.integers(0, 5), st.integers(1, 5)),
    st.tuples(st.just("release"), st.integers(0, 6), st.just(0)),
    st.tuples(st.just("corrupt"), st.integers(0, 5), st.integers(0, 4)),
    st.tuples(st.just("expire"), st.integers(0, 3), st.just(0)),
), max_size=30)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS)
def test_random_operations_keep_every_invariant(tmp_path: Path, ops: list[tuple[str, int, int]]) -> None:
    state = StoreNodeState(BLOCK_BYTES, 16, dram_blocks=3, disk=DiskBlockFiles(tmp_path / "prop", 4), lease_s=2.0)
    leases: list[int] = []
    now = 0.0
    try:
        for op, a, b in ops:
            chain = _chain(100 * a, 5)
            if op == "put":
                _put(state, chain[:b])
            elif op == "acquire":
                lease, slots = state.acquire(NS, chain[:b], now)
                assert _read(state, slots) == [_payload(h) for h in chain[: len(slots)]]  # never a wrong byte
                if lease:
                    leases.append(lease)
            elif op == "release" and leases:
                state.release(leases.pop(a % len(leases)))
            elif op == "corrupt":
                path = state.disk.path_of(chain[b])
                if path.exists():
                    path.write_bytes(path.read_bytes()[:-1])
            elif op == "expire":
                now += a
                state.expire(now)
            state.check_invariants()
        for lease in leases:
            state.release(lease)
        state.check_invariants()
        assert all(entry.num_pins == 0 for entry in state.store.nodes[state.NODE].entries.values())
    finally:
        state.close()


def test_an_acquire_whose_uses_wait_for_settle_ends_as_an_eager_one(tmp_path: Path) -> None:
    """The server answers an all-DRAM acquire before counting its uses (`defer_uses`): once settled, the core's
    uses, events and later choices (which block goes to disk) are those of eager acquires; a disk block is
    promoted at once either way, as its slot must exist before the answer."""
    states = [StoreNodeState(BLOCK_BYTES, 16, dram_blocks=4, disk=DiskBlockFiles(tmp_path / f"disk{i}", 8),
                             lease_s=5.0) for i in range(2)]
    try:
        for state in states:
            _put(state, _chain(10, 4))
        eager, deferred = states
        for first, num in ((10, 2), (10, 4), (12, 1)):
            lease_e, slots_e = eager.acquire(NS, _chain(first, num), now=0.0)
            lease_d, slots_d = deferred.acquire(NS, _chain(first, num), now=0.0, defer_uses=True)
            assert slots_d == slots_e and _read(deferred, slots_d) == _read(eager, slots_e)
            assert deferred._unsettled  # its uses not counted yet, its pins taken
            assert all(deferred.store.nodes["local"].entries[h].num_pins for h in _chain(first, num))
            deferred.settle()
            assert eager.release(lease_e) and deferred.release(lease_d)
        entries = [{h: (e.uses, e.tier) for h, e in s.store.nodes["local"].entries.items()} for s in states]
        assert entries[0] == entries[1]
        for state in states:  # a new chain pushes out the block GDSF values least: the same one on both
            _put(state, _chain(20, 2), parent=13)
            state.check_invariants()
        assert eager._on_disk == deferred._on_disk and eager._on_disk
        lease_e, slots_e = eager.acquire(NS, _chain(10, 4), now=1.0)  # disk blocks among them: promoted at once
        lease_d, slots_d = deferred.acquire(NS, _chain(10, 4), now=1.0, defer_uses=True)
        assert not deferred._unsettled and _read(deferred, slots_d) == _read(eager, slots_e)
        for state in states:
            state.check_invariants()
    finally:
        for state in states:
            state.close()


def test_lease_ids_start_apart_on_each_start_of_a_node() -> None:
    """A worker releasing a lease it got from a node's previous start (the node restarted at its address) must not
    let go of a lease the new start gave another worker."""
    leases = []
    for _ in range(2):
        state = StoreNodeState(32, 16, dram_blocks=4)
        state.put(("rev", "layout", ""), 0, [1], [b"x" * 32])
        lease, slots = state.acquire(("rev", "layout", ""), [1], now=0.0)
        assert len(slots) == 1
        leases.append(lease)
        state.close()
    assert leases[0] != leases[1] and all(0 < lease < 2**63 for lease in leases)


def test_reads_from_another_node_grant_one_copy_on_the_second_as_the_simulators_store_does(
        node: StoreNodeState) -> None:
    """The replication rule of `KVStore.on_loaded`, decided by the source node alone: the second read by a worker on
    another store node grants its node a copy of the blocks read (no more after: two copies at most); reads by a
    worker of its own node's host count for nothing; a copy written as a replica grants none in turn."""
    from kvbaton.cache.kv_store import KVStore, StoreConfig
    _put(node, _chain(10, 3))
    for _ in range(3):
        node.release(node.acquire(NS, _chain(10, 3), now=0.0)[0])  # the own host's worker: no remote read
    granted: list[int] = []
    node.release(node.acquire(NS, _chain(10, 3), now=0.0, granted=granted)[0])
    assert granted == []
    node.release(node.acquire(NS, _chain(10, 2), now=0.0, granted=granted)[0])
    assert granted == _chain(10, 2)  # the blocks read that second time (block 12 has been read across once)
    for _ in range(3):
        node.release(node.acquire(NS, _chain(10, 3), now=0.0, granted=granted)[0])
    assert granted == [10, 11, 12]  # block 12's second read; 10 and 11 have their copy
    node.check_invariants()
    # The simulator's one store over both nodes makes the same decisions for the same reads
    store = KVStore(StoreConfig(8), ["n0", "n1"])
    store.put("n0", _chain(10, 3), 0, NS, 0, lambda depth: 1.0)
    made = [store.on_loaded("n1", [(h, "n0") for h in chain]) for chain in
            (_chain(10, 3), _chain(10, 2), *[_chain(10, 3)] * 3)]
    assert [h for hashes in made for h in hashes] == granted
    copy = StoreNodeState(BLOCK_BYTES, 16, dram_blocks=4)
    try:
        copy.put(NS, 0, _chain(10, 2), [_payload(h) for h in _chain(10, 2)], replica=True)
        more: list[int] = []
        for _ in range(3):
            copy.release(copy.acquire(NS, _chain(10, 2), now=0.0, granted=more)[0])
        assert more == []  # a replica grants no copy of its own
        copy.check_invariants()
    finally:
        copy.close()


@pytest.mark.parametrize("with_disk", [False, True])
def test_a_chain_stored_or_promoted_on_a_full_node_takes_ascending_slots(tmp_path: Path, with_disk: bool) -> None:
    """On a full node each block's room is freed by a victim first, a chain's victims in eviction order: the new
    chain still takes its slots in ascending order (one copy per row for a worker), whether put or promoted back
    from disk, and its bytes are its own."""
    disk = DiskBlockFiles(tmp_path / "disk", 16) if with_disk else None
    node = StoreNodeState(BLOCK_BYTES, 16, dram_blocks=8, disk=disk, lease_s=5.0)
    try:
        _put(node, _chain(100, 8))
        _put(node, _chain(200, 8))  # DRAM full: the first chain's blocks make room, one a block
        lease, slots = node.acquire(NS, _chain(200, 8), now=0.0)
        assert slots == sorted(slots) and slots == list(range(slots[0], slots[0] + 8))
        assert _read(node, slots) == [_payload(h) for h in _chain(200, 8)]
        node.release(lease)
        if with_disk:  # the first chain back from disk, pushing the second out block by block
            lease, slots = node.acquire(NS, _chain(100, 8), now=0.0)
            assert slots == list(range(slots[0], slots[0] + 8))
            assert _read(node, slots) == [_payload(h) for h in _chain(100, 8)]
            node.release(lease)
        node.check_invariants()
    finally:
        node.close()
