"""Routers telling each other of routers (`rpc.AddRouter`, server/cluster.py `send_add_router` and
`ClusterManager._tell_router`, server/cluster_workers.py `WorkerPool.check_peers`): a send to a dead router returns
within its bound and holds one executor thread, not one per message; a peer no probe reaches is dropped from the
peers, and one that comes back (it tells this router of itself) is a peer again.

Routers are ClusterManagers in this process over the real authenticated zmq RPC on 127.0.0.1; a dead router is a
port nothing listens on.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable

from kvbaton.core.cluster_secret import ClusterSecret
from kvbaton.server.cluster import ClusterConfig, ClusterManager, send_add_router

SECRET = ClusterSecret.generate()


def free_address() -> str:
    """A loopback TCP address nothing listens on (the port was free a moment ago)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


def router(bind_address: str = "tcp://127.0.0.1:*", **fields: object) -> ClusterManager:
    return ClusterManager(ClusterConfig(bind_address=bind_address, model_name="tiny-random", block_size=4,
                                        cluster_secret=SECRET, **fields))  # type: ignore[arg-type]


async def until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def test_telling_a_dead_router_returns_within_its_bound_and_a_live_one_still_hears() -> None:
    dead = free_address()
    started = time.monotonic()
    assert send_add_router(dead, ("tcp://127.0.0.1:1",), SECRET, timeout_s=0.3) is False
    assert time.monotonic() - started < 1.0

    async def main() -> None:
        teller, listener = router(), router()
        await teller.start()
        listener_address = await listener.start()
        try:
            # Many news for a dead peer: each returns at once, and together they hold one executor thread at a time
            # (the default executor has few), so a send to a live router right after is not queued behind them.
            started = time.monotonic()
            for i in range(40):
                teller.pool.tell_router(dead, (f"tcp://127.0.0.1:{20000 + i}",))  # type: ignore[misc]
            assert time.monotonic() - started < 0.05
            teller.pool.tell_router(listener_address, ("tcp://127.0.0.1:9",))  # type: ignore[misc]
            await until(lambda: "tcp://127.0.0.1:9" in listener.pool.peer_routers, 2.0, "the live router to hear")
            # The dead peer's other 39 news wait, merged into its next send.
            assert len(teller._gossip_pending[dead]) == 39
        finally:
            await teller.shutdown(timeout_s=0.1)
            await listener.shutdown(timeout_s=0.1)

    asyncio.run(main())


def test_a_dead_peer_is_dropped_and_added_again_when_it_comes_back() -> None:
    gone = free_address()

    async def main() -> None:
        first = router(peer_routers=(gone,), peer_probe_interval_s=0.1, peer_router_timeout_s=0.5)
        first_address = await first.start()
        back = None
        try:
            assert first.pool.peer_routers == [gone]
            await until(lambda: not first.pool.peer_routers, 5.0, "the dead peer to be dropped")
            # It comes back at its address, knowing the first router: its probe tells the first of it again.
            back = router(bind_address=gone, peer_routers=(first_address,), peer_probe_interval_s=0.1,
                          peer_router_timeout_s=0.5)
            await back.start()
            await until(lambda: first.pool.peer_routers == [gone], 5.0, "the peer to be added again")
            await asyncio.sleep(1.0)  # twice the timeout: the first router's probes reach it, so it stays
            assert first.pool.peer_routers == [gone] and back.pool.peer_routers == [first_address]
        finally:
            await first.shutdown(timeout_s=0.1)
            if back is not None:
                await back.shutdown(timeout_s=0.1)

    asyncio.run(main())
