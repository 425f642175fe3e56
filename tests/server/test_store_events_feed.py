"""A router's store directory fed live: `StoreEventFeed` reads a store node's events over its authenticated socket and
the placement's directory then knows what the node holds, in which tier."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from kvbaton.cache.kv_store import StoreEvent
from kvbaton.cache.store_directory import StoreDirectory
from kvbaton.core.cluster_secret import ClusterSecret
from kvbaton.server.store_client import StoreEventFeed
from kvbaton.server.store_node import StoreNodeState
from kvbaton.server.store_server import StoreServer
from kvbaton.transfer.store_disk import DiskBlockFiles

pytestmark = pytest.mark.timeout(60)

SECRET = ClusterSecret(b"f" * 32)
NS = ("rev", "layout", "")


def test_the_feed_keeps_a_directory_of_the_node(tmp_path: Path) -> None:
    state = StoreNodeState(32, 16, dram_blocks=2, disk=DiskBlockFiles(tmp_path / "d", 8), max_log_events=3)
    server = StoreServer(state, SECRET)
    thread = server.start_thread()
    directory = StoreDirectory()
    lock = threading.Lock()
    snapshots: list[bool] = []

    def deliver(events: list[StoreEvent], snapshot: bool) -> None:
        with lock:
            snapshots.append(snapshot)
            if snapshot:
                directory.apply_snapshot("host", events)
            else:
                assert directory.on_events("host", events)

    with server.locked():
        state.put(NS, 0, [1, 2, 3], [b"x" * 32] * 3)  # 3 in DRAM of 2: block 1 moves to disk; 4 events, log of 3
    feed = StoreEventFeed(server.address, SECRET, deliver, interval_s=0.02).start()
    try:
        deadline = time.monotonic() + 20
        while True:
            with lock:
                if directory.match([1, 2, 3]) == 3:
                    break
            assert time.monotonic() < deadline, "the directory never learnt the node's blocks"
            time.sleep(0.02)
        with lock:
            assert snapshots[0] is True  # the log no longer reached back to seq 1: a snapshot
            entries = state.store.nodes[state.NODE].entries
            assert {h: directory.locations(h) for h in (1, 2, 3)} == {h: {"host": entries[h].tier} for h in (1, 2, 3)}
            assert sorted(entries[h].tier for h in (1, 2, 3)) == ["disk", "dram", "dram"]
        with server.locked():
            state.put(NS, 3, [4], [b"y" * 32])
        while True:
            with lock:
                if directory.match([1, 2, 3, 4]) == 4:
                    break
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with lock:
            directory.check_invariants()
    finally:
        feed.stop()
        server.stop()
        thread.join(timeout=10)


def test_the_feed_hands_on_the_node_s_disk_reads(tmp_path: Path) -> None:
    """A node with a disk answers each poll with what its disk reads moved and took so far; the feed hands each new
    pair to `on_disk_reads` (the router prices the node's disk from them)."""
    state = StoreNodeState(4096, 16, dram_blocks=2, disk=DiskBlockFiles(tmp_path / "d", 8))
    server = StoreServer(state, SECRET)
    thread = server.start_thread()
    reads: list[tuple[int, float]] = []
    with server.locked():
        state.put(NS, 0, [1, 2], [b"x" * 4096] * 2)
        state.put(NS, 0, [11, 12], [b"y" * 4096] * 2)  # DRAM holds 2: the first chain moves to disk
    feed = StoreEventFeed(server.address, SECRET, lambda events, snapshot: None, interval_s=0.02,
                          on_disk_reads=lambda num_bytes, seconds: reads.append((num_bytes, seconds))).start()
    try:
        deadline = time.monotonic() + 20
        while not reads:  # nothing read yet: (0, 0.0), which is what the feed starts from, is not handed on
            assert time.monotonic() < deadline
            time.sleep(0.02)
            if feed.num_polls >= 3:
                break
        assert reads == []
        with server.locked():
            assert state.disk.num_files() == 2
            lease, slots = state.acquire(NS, [1, 2], now=0.0)  # the chain comes back from disk: two file reads
            state.release(lease)
            expected = (state.disk.num_read_bytes, state.disk.read_s)
        assert len(slots) == 2 and expected[0] > 2 * 4096 and expected[1] > 0
        while not reads:
            assert time.monotonic() < deadline, "the feed never handed on the disk read"
            time.sleep(0.02)
        time.sleep(0.1)
        assert reads == [expected]  # handed on once: later polls answer the same pair
    finally:
        feed.stop()
        server.stop()
        thread.join(timeout=10)


def test_a_node_restarted_at_once_leaves_no_stale_block_in_the_directory() -> None:
    """Restarted on the same address well within `lost_after_s` (the feed never sees it silent): its new epoch tells
    the feed; the blocks the old node held leave the directory and the new node's come in from its seq 1."""
    first = StoreNodeState(32, 16, dram_blocks=8)
    server = StoreServer(first, SECRET)
    thread = server.start_thread()
    port = int(server.address.rsplit(":", 1)[1])
    directory = StoreDirectory()
    lock = threading.Lock()
    lost: list[bool] = []

    def deliver(events: list[StoreEvent], snapshot: bool) -> None:
        with lock:
            if snapshot:
                directory.apply_snapshot("host", events)
            else:
                assert directory.on_events("host", events)

    def on_lost() -> None:
        with lock:
            lost.append(True)
            directory.remove_node("host")

    def wait_for(check) -> None:  # noqa: ANN001
        deadline = time.monotonic() + 20
        while True:
            with lock:
                if check():
                    return
            assert time.monotonic() < deadline, "the directory never got there"
            time.sleep(0.02)

    with server.locked():
        first.put(NS, 0, [1, 2, 3, 4, 5], [b"x" * 32] * 5)  # seqs past what the new node will have
    feed = StoreEventFeed(server.address, SECRET, deliver, interval_s=0.02, on_lost=on_lost,
                          lost_after_s=30.0).start()
    second_server = second_thread = None
    try:
        wait_for(lambda: directory.match([1, 2, 3, 4, 5]) == 5)
        server.stop()
        thread.join(timeout=10)
        second = StoreNodeState(32, 16, dram_blocks=8)
        second.put(NS, 0, [7], [b"y" * 32])  # one block: its seq (1) is below what the feed had read
        second_server = StoreServer(second, SECRET, port=port)
        second_thread = second_server.start_thread()
        wait_for(lambda: directory.match([7]) == 1)
        with lock:
            assert lost == [True]  # once, for the restart (the node was never silent for 30 s)
            assert directory.match([1]) == 0  # none of the old node's blocks is left to plan a load from
            directory.check_invariants()
    finally:
        feed.stop()
        if second_server is not None:
            second_server.stop()
            second_thread.join(timeout=10)
