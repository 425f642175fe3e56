"""Live KV store nodes on 127.0.0.1 for tests: a `StoreServer` over a `StoreNodeState` on a thread of the test process
(the `store_node` fixture of tests/conftest.py starts them and stops every one at the test's end), and the wait for a
node to let go of every lease."""

from __future__ import annotations

import time

from kvbaton.core.cluster_secret import ClusterSecret
from kvbaton.server.store_node import StoreNodeState
from kvbaton.server.store_server import StoreServer


class RunningNode:
    """One node serving on its own thread. `host_id` names the host it claims to be on: another one than this
    process's makes every worker here read it over TCP, as a worker on another host does."""

    def __init__(self, state: StoreNodeState, secret: ClusterSecret, host_id: str = "", port: int = 0) -> None:
        self.state = state
        self.server = StoreServer(state, secret, port=port)
        if host_id:
            self.server.host_id = host_id
        self.address = self.server.address
        self.thread = self.server.start_thread()

    def check(self) -> None:
        with self.server.locked():
            self.state.check_invariants()

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive(), "a store node did not stop"


def wait_unpinned(server: StoreServer, timeout_s: float = 5.0) -> None:
    """Until the node holds no lease (a worker's release, or a TCP load's own, is on its way), then its invariants."""
    deadline = time.monotonic() + timeout_s
    while server.state.num_leases:
        assert time.monotonic() < deadline, f"{server.state.num_leases} leases left pinned"
        time.sleep(0.01)
    with server.locked():
        server.state.check_invariants()


