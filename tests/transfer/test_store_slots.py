"""The store's DRAM slots: the host id that decides who maps them, the streaming-copy environment a worker with a
store runs under, the sweep of slots a killed node left, and the slot index a same-host worker reads unleased."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvbaton.cache.hashing import namespace_tag
from kvbaton.transfer.store_slots import STREAMING_COPIES, StoreSlots, host_id, with_streaming_copies

LOADER = "/lib64/ld-linux-x86-64.so.2"


def test_the_host_id_is_the_same_in_every_process_of_this_host() -> None:
    child = subprocess.run([sys.executable, "-c", "from kvbaton.transfer.store_slots import host_id; print(host_id())"],
                           capture_output=True, text=True, timeout=60, check=True,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert child.stdout.strip() == host_id() and host_id().startswith(os.uname().nodename + "/")


def test_streaming_copies_join_the_tunables_without_overriding_a_threshold_set() -> None:
    assert with_streaming_copies({})["GLIBC_TUNABLES"] == STREAMING_COPIES
    joined = with_streaming_copies({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "X": "1"})
    assert joined == {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{STREAMING_COPIES}", "X": "1"}
    own = {"GLIBC_TUNABLES": "glibc.cpu.x86_non_temporal_threshold=0x100000"}
    assert with_streaming_copies(own) == own


@pytest.mark.skipif(platform.machine() != "x86_64" or not Path(LOADER).exists(), reason="glibc's x86-64 loader")
def test_glibc_applies_the_threshold_in_a_process_started_with_them() -> None:
    """glibc's loader lists the tunables it would run a program with: 256 KiB with them, its own default without (on
    this host 0x28e0000, 43 MB: a load's 768 KB rows would copy with ordinary stores)."""
    def threshold(environment: dict[str, str]) -> str:
        listed = subprocess.run([LOADER, "--list-tunables"], capture_output=True, text=True, timeout=60,
                                env=environment).stdout
        return next(line for line in listed.splitlines() if "x86_non_temporal_threshold" in line).split()[1]
    plain = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    assert threshold(with_streaming_copies(plain)) == "0x40000"
    assert threshold(plain) != "0x40000"


def test_a_new_node_removes_the_slots_a_killed_node_left(tmp_path: Path) -> None:
    """A node killed before it could unlink its DRAM file (SIGKILL) leaves it in /dev/shm, memory no one frees; the
    next node created on the host removes it, and leaves the live ones (this process's) and the KV links' alone."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    stale = tmp_path / f"kvbaton-store-{dead.pid}-0a1b2c3d"
    live = tmp_path / f"kvbaton-store-{os.getpid()}-0a1b2c3d"
    other = tmp_path / f"kvbaton-kv-{dead.pid}-0a1b2c3d"  # a KV link's: its own sweep's
    for path in (stale, live, other):
        path.write_bytes(b"")
    slots = StoreSlots.create(64, 4, directory=str(tmp_path))
    try:
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name, Path(slots.path).name])
    finally:
        slots.close()


NS = ("rev", "layout", "")


@contextlib.contextmanager
def _node_and_reader(directory: str, num_slots: int) -> Iterator[tuple[StoreSlots, StoreSlots]]:
    """A node's slots of 64-byte blocks in `directory` and a reader attached to them, both closed after."""
    slots = StoreSlots.create(64, num_slots, directory=directory)
    reader = StoreSlots.attach(slots.path, 64, num_slots)
    try:
        yield slots, reader
    finally:
        reader.close()
        slots.close()


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 2**64 - 1)), min_size=1, max_size=80))
def test_the_slot_index_finds_exactly_what_is_published(tmp_path_factory: pytest.TempPathFactory,
                                                        ops: list[tuple[bool, int]]) -> None:
    """Publish and free in any order (hashes crowding into few buckets among them): every held block is found at its
    slot from its hash, under its namespace only, a freed one never is, and a slot freed (or freed and reused)
    after a lookup fails `still_held` from there on."""
    held: dict[int, int] = {}
    with _node_and_reader(str(tmp_path_factory.mktemp("slots")), 8) as (slots, reader):
        for publish, value in ops:
            block_hash = (value % 2**64) - 2**63 if value % 3 else (value % 7) * reader.num_buckets  # collisions too
            if publish and slots.num_free_slots and block_hash not in held:
                slot = slots.allocate()
                slots.write(slot, bytes([slot]) * 64)
                slots.publish(slot, block_hash, NS)
                held[block_hash] = slot
            elif held:
                victim = sorted(held)[value % len(held)]
                found, generations = reader.lookup([victim], NS)
                assert found == [held[victim]]
                slots.free(held.pop(victim))
                assert reader.still_held(found, generations) == 0 and reader.lookup([victim], NS) == ([], [])
            slots.check_index(held)
            for block_hash, slot in held.items():
                assert reader.lookup([block_hash], NS)[0] == [slot]
                assert reader.lookup([block_hash], ("rev", "layout", "other tenant")) == ([], [])
        chain = sorted(held)
        found, generations = reader.lookup(chain, NS)
        assert found == [held[h] for h in chain] and reader.still_held(found, generations) == len(chain)


@settings(max_examples=80, deadline=None)
@example(layout=["ours"], picks=[0, 0], freed=[1])  # a chain naming one block twice: CI found it
@given(layout=st.lists(st.sampled_from(["ours", "other tenant", "free"]), min_size=1, max_size=12),
       picks=st.lists(st.integers(0, 40), min_size=1, max_size=14), freed=st.lists(st.integers(0, 11), max_size=4))
def test_a_chain_is_found_as_far_as_its_blocks_are_held_wherever_its_slots_lie(
        tmp_path_factory: pytest.TempPathFactory, layout: list[str], picks: list[int], freed: list[int]) -> None:
    """Slots filled in order with blocks of this namespace, of another tenant, or left free; a chain of any of those
    blocks in any order, and of blocks never stored: the lookup (its consecutive-slot run first, then the general
    probe) finds exactly the leading blocks held under this namespace, at their slots, as the general probe alone
    does; and `still_held` of it, consecutive or not, fails from the first position whose slot was freed after the
    lookup."""
    num_slots = len(layout)
    with _node_and_reader(str(tmp_path_factory.mktemp("chain")), num_slots) as (slots, reader):
        where: dict[int, int] = {}  # block hash -> slot, this namespace's only
        for index, kind in enumerate(layout):
            slot = slots.allocate()
            if kind != "free":
                block_hash = 1000 + index * 17 * reader.num_buckets  # one home bucket for all: probes collide
                slots.publish(slot, block_hash, NS if kind == "ours" else ("rev", "layout", "other tenant"))
                if kind == "ours":
                    where[block_hash] = slot
        chain = [1000 + (pick % 20) * 17 * reader.num_buckets for pick in picks]  # 20 > slots: some never stored
        expected = []
        for block_hash in chain:
            if block_hash not in where:
                break
            expected.append(where[block_hash])
        found, generations = reader.lookup(chain, NS)
        assert found == expected
        assert reader._probe_chain(np.array(chain, dtype=np.int64), namespace_tag(NS)) == (found, generations)
        assert reader.still_held(found, generations) == len(found)
        gone = {found[i % len(found)] for i in freed} if found else set()  # slots, each freed once
        for slot in gone:
            slots.free(slot)
        # A chain may name a block twice (picks repeat): it stops at the first position whose slot was freed.
        first_gone = next((position for position, slot in enumerate(found) if slot in gone), len(found))
        assert reader.still_held(found, generations) == first_gone


def test_still_held_reads_each_slot_of_a_chain_whose_slots_span_a_range_out_of_order(tmp_path: Path) -> None:
    with _node_and_reader(str(tmp_path), 4) as (slots, reader):
        for block_hash in (10, 11, 12, 13):
            slots.publish(slots.allocate(), block_hash, NS)
        found, generations = reader.lookup([10, 12, 11, 13], NS)
        assert found == [0, 2, 1, 3]  # first and last four apart: not a run for all that
        slots.free(2)
        assert reader.still_held(found, generations) == 1


def test_a_reader_sees_a_closed_or_dead_node_and_a_chain_stops_at_its_first_gap(tmp_path: Path) -> None:
    slots = StoreSlots.create(64, 4, directory=str(tmp_path))
    reader = StoreSlots.attach(slots.path, 64, 4)
    try:
        for block_hash in (11, 12, 14):
            slots.publish(slots.allocate(), block_hash, NS)
        assert reader.lookup([11, 12, 13, 14], NS)[0] == [0, 1]  # 13 missing: the chain stops before it
        found, generations = reader.lookup([11, 12], NS)
        slots.free(1)
        assert reader.still_held(found, generations) == 1  # the first still, the second freed since
        slots.publish(slots.allocate(), 12, NS)  # the same block again, in the same slot: a new generation
        assert reader.still_held(found, generations) == 1
        assert reader.node_alive()
        slots.num_disk_blocks = 3
        assert reader.num_disk_blocks == 3
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait(timeout=30)
        pid, slots._header[2] = slots._header[2], dead.pid  # as if its node had been killed
        assert not reader.node_alive()
        slots._header[2] = pid
        assert reader.node_alive()
        slots._header[0] = 0
        with pytest.raises(ValueError, match="no slot index"):
            StoreSlots.attach(slots.path, 64, 4)
    finally:
        slots.close()
    assert not reader.node_alive()  # closed by its owner
    reader.close()
