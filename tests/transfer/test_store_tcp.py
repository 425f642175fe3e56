"""The KV store's TCP data path (a worker on another host reads leased slots over the node's TCP port), on 127.0.0.1:
the bytes land rows first in the right device blocks, only holders of the secret connect, a read names a live
lease only, a read in flight keeps its lease pinned, and the transport follows the node's host id."""

from __future__ import annotations

import socket
import time
import numpy as np
import pytest

from kvbaton.core.cluster_secret import ClusterSecret
from kvbaton.engine.store_io import StoreUnavailable
from kvbaton.server import store_client
from kvbaton.server.store_client import StoreClient
from kvbaton.server.store_node import StoreNodeState
from kvbaton.server.store_server import StoreServer
from kvbaton.transfer.store_tcp import StoreLinkError, StoreTcpLink, row_views
from tests.store_nodes import wait_unpinned

pytestmark = pytest.mark.timeout(60)

SECRET = ClusterSecret(b"t" * 32)
ROWS, ROW_BYTES = 4, 64
NS = ("rev", "layout", "tenant")


@pytest.fixture
def server(store_node) -> StoreServer:  # noqa: ANN001 - tests/conftest.py's
    return store_node(StoreNodeState(ROWS * ROW_BYTES, 16, 16, block_rows=ROWS), SECRET).server


def _payload(block: int) -> bytes:
    """Block `block`'s bytes on the wire (its rows in order): row r of it is filled with 16 * block + r."""
    return b"".join(bytes([16 * block + row]) * ROW_BYTES for row in range(ROWS))


def _put(server: StoreServer, num_blocks: int) -> list[int]:
    hashes = [1000 + i for i in range(num_blocks)]
    with server.locked():
        server.state.put(NS, 0, hashes, [_payload(i) for i in range(num_blocks)])
    return hashes


def test_a_lease_read_over_tcp_lands_rows_first_in_its_device_blocks(server: StoreServer) -> None:
    hashes = _put(server, 3)
    client = StoreClient(server.address, SECRET, transport="tcp")
    try:
        assert client.hello()["transport"] == "tcp"
        lease, slots, _ = client.acquire(NS, hashes)
        assert len(slots) == 3
        pool = np.zeros((ROWS, 8, ROW_BYTES), dtype=np.uint8)  # [rows, device blocks, row bytes]
        device_ids = [5, 2, 3]  # out of order: a run (2, 3) and a single block
        client.read_into(lease, row_views(pool, device_ids))
        client.release(lease)
        for block, device_id in enumerate(device_ids):
            assert pool[:, device_id].tobytes() == _payload(block)
        assert not pool[:, [0, 1, 4, 6, 7]].any()  # nothing else written
        assert client.stats()["num_tcp_reads"] == 1
        wait_unpinned(server)
    finally:
        client.close()


def test_a_peer_without_the_secret_is_refused(server: StoreServer) -> None:
    _put(server, 1)
    with pytest.raises(StoreLinkError):
        StoreTcpLink("127.0.0.1", server.tcp.port, ClusterSecret(b"x" * 32), timeout_s=2.0)
    # Garbage instead of a hello: closed, nothing else happens.
    with socket.create_connection(("127.0.0.1", server.tcp.port), timeout=5) as sock:
        sock.recv(1 << 16)
        sock.sendall(b"\xff" * 64)
        sock.settimeout(5)
        try:
            assert sock.recv(1 << 16) == b""
        except ConnectionResetError:
            pass  # closed with our bytes unread
    deadline = time.monotonic() + 5
    while server.tcp.num_refused < 2:
        assert time.monotonic() < deadline, server.tcp.num_refused
        time.sleep(0.01)
    assert server.tcp.num_reads == 0


def test_a_read_names_a_live_lease_only(server: StoreServer) -> None:
    hashes = _put(server, 2)
    client = StoreClient(server.address, SECRET, transport="tcp", retry_after_s=0.0)
    try:
        client.hello()
        pool = np.zeros((ROWS, 2, ROW_BYTES), dtype=np.uint8)
        with pytest.raises(StoreUnavailable, match="no lease"):
            client.read_into(12345, row_views(pool, [0, 1]))
        lease, _, _ = client.acquire(NS, hashes)
        client.release(lease)
        client.stats()  # the release went first: the node has let it go
        with pytest.raises(StoreUnavailable, match="no lease"):
            client.read_into(lease, row_views(pool, [0, 1]))
        assert not pool.any()
        lease, _, _ = client.acquire(NS, hashes)  # the node serves on after refusals
        client.read_into(lease, row_views(pool, [0, 1]))
        assert pool[:, 1].tobytes() == _payload(1)
    finally:
        client.close()


def test_a_lease_being_read_neither_expires_nor_is_released_under_the_read() -> None:
    state = StoreNodeState(ROWS * ROW_BYTES, 16, 16, block_rows=ROWS, lease_s=1.0)
    try:
        state.put(NS, 0, [7, 8], [_payload(0), _payload(1)])
        lease, slots = state.acquire(NS, [7, 8], now=0.0)
        assert state.begin_read(lease) == slots
        assert state.expire(now=100.0) == 0 and state.num_leases == 1  # mid-read: its slots stay pinned
        assert state.release(lease) and state.num_leases == 1  # the worker gave up: let go when the read ends
        assert state.begin_read(lease) is None  # no new read of a released lease
        state.end_read(lease)
        assert state.num_leases == 0
        state.check_invariants()
        lease, _ = state.acquire(NS, [7, 8], now=0.0)
        assert state.begin_read(lease) is not None
        state.end_read(lease)
        assert state.expire(now=100.0) == 1 and state.num_leases == 0
        state.check_invariants()
    finally:
        state.close()  # its slots' file in /dev/shm goes with it


def test_the_transport_follows_the_node_host_id(server: StoreServer, monkeypatch: pytest.MonkeyPatch) -> None:
    clients = []
    try:
        for transport in ("auto", "shm", "tcp"):
            clients.append(StoreClient(server.address, SECRET, transport=transport))
        assert [c.hello()["transport"] for c in clients] == ["shm", "shm", "tcp"]
        monkeypatch.setattr(store_client, "host_id", lambda: "another-host/boot")
        assert clients[0].hello()["transport"] == "tcp"
        with pytest.raises(StoreUnavailable, match="another host"):
            clients[1].hello()
        monkeypatch.undo()  # this host again; the environment forces tcp
        monkeypatch.setenv(store_client.TRANSPORT_ENV, "tcp")
        clients.append(StoreClient(server.address, SECRET))
        assert clients[-1].transport == "tcp" and clients[-1].hello()["transport"] == "tcp"
        with pytest.raises(ValueError):
            StoreClient(server.address, SECRET, transport="rdma")
    finally:
        for client in clients:
            client.close()


def test_a_load_acquires_streams_and_releases_in_one_trip(server: StoreServer) -> None:
    hashes = _put(server, 3)
    client = StoreClient(server.address, SECRET, transport="tcp", retry_after_s=0.0)
    try:
        client.hello()
        pool = np.zeros((ROWS, 8, ROW_BYTES), dtype=np.uint8)
        asked = []

        def buffers_for(num: int) -> list[memoryview]:
            asked.append(num)
            return row_views(pool, [6, 7, 1][:num])
        # The chain goes on past what the node holds: the leading three come, nothing else is written.
        assert client.load_into(NS, [*hashes, 77, 78], buffers_for) == 3 and asked == [3]
        for block, device_id in enumerate([6, 7, 1]):
            assert pool[:, device_id].tobytes() == _payload(block)
        assert not pool[:, [0, 2, 3, 4, 5]].any()
        assert client.load_into(("rev", "layout", "tenant-b"), hashes, buffers_for) == 0  # another tenant: none
        with pytest.raises(StoreUnavailable, match="refused the load"):
            client.load_into(["not", "a namespace"], hashes, buffers_for)
        assert client.stats()["num_loaded_blocks"] == 3
        wait_unpinned(server)  # the node lets the load's pin go itself once the bytes are sent
    finally:
        client.close()


def test_a_same_host_acquire_and_release_ride_the_tcp_link_not_the_control_socket(server: StoreServer) -> None:
    hashes = _put(server, 3)
    client = StoreClient(server.address, SECRET, transport="shm", retry_after_s=0.0)
    try:
        assert client.hello()["transport"] == "shm"
        lease, slots, shm_path = client.acquire(NS, [*hashes, 77])  # the leading three held, the fourth not
        assert lease and len(slots) == 3 and shm_path == server.state.slots.path
        rows = server.state.slots.rows
        assert [rows[:, slot].tobytes() for slot in slots] == [_payload(i) for i in range(3)]  # the slots hold them
        with server.locked():
            assert server.state.num_leases == 1
        assert client.acquire(("rev", "layout", "tenant-b"), hashes) == (0, [], shm_path)  # another tenant: none
        assert client._tcp is not None  # the TCP link carried them
        client.release(lease)
        client.release(lease)  # twice, or a lease the node never gave: no error, nothing changes
        client.release(424242)
        wait_unpinned(server)
        stats = client.stats()  # the control socket still answers; the pins were counted as loads, uses settled
        assert stats["num_loaded_blocks"] == 3 and stats["num_errors"] == 0 and stats["num_tcp_reads"] == 0
        with pytest.raises(StoreUnavailable, match="refused the acquire"):
            client.acquire(["not", "a namespace"], hashes)
    finally:
        client.close()


def test_a_release_after_the_tcp_link_broke_goes_on_the_control_socket(server: StoreServer) -> None:
    hashes = _put(server, 2)
    client = StoreClient(server.address, SECRET, transport="shm", retry_after_s=0.0)
    try:
        client.hello()
        lease, slots, _ = client.acquire(NS, hashes)
        assert len(slots) == 2
        client._tcp._sock.close()  # the link dies under the worker (a node restart, a reset)
        assert client.release(lease)
        assert client._tcp is None
        wait_unpinned(server)
    finally:
        client.close()


def test_held_says_how_much_of_a_chain_the_node_holds_and_pins_nothing(server: StoreServer) -> None:
    hashes = _put(server, 3)
    client = StoreClient(server.address, SECRET, transport="tcp", retry_after_s=0.0)
    try:
        client.hello()
        assert client.held(NS, [*hashes, 77, hashes[0]]) == 3  # the leading run only
        assert client.held(NS, [77, *hashes]) == 0
        assert client.held(("rev", "layout", "tenant-b"), hashes) == 0  # another tenant's: none
        with server.locked():
            assert server.state.num_leases == 0 and server.state.num_loaded_blocks == 0  # no pin, no use counted
        with pytest.raises(StoreUnavailable, match="refused the held"):
            client.held(["not", "a namespace"], hashes)
    finally:
        client.close()
