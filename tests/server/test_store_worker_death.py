"""A worker process killed in the middle of its saves or while holding a load lease leaves the store node whole: each
put lands entirely or not at all, the lease expires, and every invariant holds (block accounting after the fact)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvbaton.core.cluster_secret import SECRET_ENV, ClusterSecret
from kvbaton.server.store_node import StoreNodeState
from kvbaton.server.store_server import StoreServer
from kvbaton.transfer.store_disk import DiskBlockFiles

pytestmark = pytest.mark.timeout(120)

SECRET = ClusterSecret(b"k" * 32)
BLOCK_BYTES = 4096

_WORKER = textwrap.dedent("""
    import sys, time
    from kvbaton.core.cluster_secret import ClusterSecret
    from kvbaton.server.store_client import StoreClient
    client = StoreClient(sys.argv[1], ClusterSecret(b"k" * 32))
    client.hello()  # the handshake is done: puts reach the node from here on
    if sys.argv[2] == "save":
        parent, i = 0, 1
        while True:  # chains of 4 blocks, as fast as it can
            hashes = list(range(i, i + 4))
            client.put(("r", "l", ""), parent, hashes, [memoryview(bytes([h % 256]) * 4096) for h in hashes])
            parent, i = hashes[-1], i + 4
            print(i, flush=True)
    else:
        lease, slots, _ = client.acquire(("r", "l", ""), [1, 2, 3, 4])
        print(lease, len(slots), flush=True)
        time.sleep(600)
""")


def _start(address: str, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", _WORKER, address, mode], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, SECRET_ENV: SECRET.to_hex()})


@pytest.fixture
def server(tmp_path: Path, store_node) -> StoreServer:  # noqa: ANN001 - tests/conftest.py's
    state = StoreNodeState(BLOCK_BYTES, 16, dram_blocks=64, disk=DiskBlockFiles(tmp_path / "d", 256), lease_s=1.0)
    return store_node(state, SECRET).server


def test_a_worker_killed_mid_save_leaves_whole_puts(server: StoreServer) -> None:
    worker = _start(server.address, "save")
    try:
        deadline = time.monotonic() + 30
        while True:  # let it get well into its saves
            assert worker.stdout.readline()  # type: ignore[union-attr]
            with server.locked():
                if server.state.num_put_blocks >= 40:
                    break
            assert time.monotonic() < deadline, "no put reached the store node"
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(10)
        time.sleep(0.3)
        with server.locked():
            state = server.state
            state.check_invariants()
            entries = state.store.nodes[state.NODE].entries
            assert state.num_put_blocks >= 4 and state.num_put_blocks % 4 == 0  # whole chains only
            assert state.store.num_blocks == min(state.num_put_blocks, 64 + 256)
            assert all(e.num_pins == 0 for e in entries.values()) and server.num_errors == 0
    finally:
        if worker.poll() is None:
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait(10)


def test_a_worker_killed_holding_a_load_lease_lets_go_of_it(server: StoreServer) -> None:
    with server.locked():
        server.state.put(("r", "l", ""), 0, [1, 2, 3, 4], [bytes([h]) * BLOCK_BYTES for h in (1, 2, 3, 4)])
    worker = _start(server.address, "load")
    try:
        lease, num = worker.stdout.readline().split()  # type: ignore[union-attr]
        assert int(lease) > 0 and int(num) == 4
        with server.locked():
            assert server.state.num_leases == 1
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(10)
        deadline = time.monotonic() + 10
        while True:
            with server.locked():
                if server.state.num_leases == 0:
                    server.state.check_invariants()
                    break
            assert time.monotonic() < deadline, "the dead worker's lease never expired"
            time.sleep(0.05)
        with server.locked():
            entries = server.state.store.nodes[server.state.NODE].entries
            assert server.state.num_expired_leases == 1 and all(e.num_pins == 0 for e in entries.values())
    finally:
        if worker.poll() is None:
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait(10)
