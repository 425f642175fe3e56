"""Several routers over one set of workers (server/worker_links.py): each router gets every worker's registration,
heartbeats and KV events, and only its own calls' deltas; a router that dies costs only its own calls (the workers
abort them and free their blocks), and a router that joins later rebuilds its prefix index from the workers'
snapshots. A router restarted at its old address gets the workers back the same way (they keep registering there).

Routers are ClusterManagers in this process (so the test reads their state); the workers are real `Worker`s in
threads (tests/server/pd_helpers.py), each linked to every router over the real authenticated zmq RPC.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from kvbaton.model.registry import LoadedModel, load_model
from kvbaton.server.base import GenerateCall, TokenDelta
from kvbaton.server.cluster import ClusterConfig, ClusterManager
from kvbaton.server.identity import tokenizer_probe_hash
from tests.server.pd_helpers import BLOCK_SIZE, collect, colocated, greedy, start, tokens_of, wait_clean
from tests.server.test_worker_cluster import SECRET

PROMPT = [(5 * i + 2) % 50 + 3 for i in range(48)]  # three whole blocks


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random")


def router(tiny: LoadedModel, **fields: object) -> ClusterManager:
    return ClusterManager(ClusterConfig(model_name="tiny-random", block_size=BLOCK_SIZE, policy="preble",
                                        tokenizer_probe_hash=tokenizer_probe_hash(tiny.tokenizer),
                                        cluster_secret=SECRET, ping_interval_s=0.1, **fields))  # type: ignore[arg-type]


async def until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def die(cluster: ClusterManager) -> None:
    """The router process dies: its socket closes with no goodbye and its monitor stops (what SIGKILL leaves)."""
    for task in cluster._tasks:
        task.cancel()
    assert cluster.pool.socket is not None
    cluster.pool.socket.close()
    cluster.pool.socket = None


def test_two_routers_share_workers_and_one_dying_costs_only_its_own_calls(tiny: LoadedModel) -> None:
    expected = colocated(tiny, PROMPT, greedy(200))

    async def main() -> None:
        first, second = router(tiny), router(tiny)
        first_address, second_address = await first.start(), await second.start()
        workers = {w: start(tiny, first_address, w, "mixed", more_router_addresses=(second_address,),
                            router_link_timeout_s=1.0, router_timeout_s=10.0) for w in ("w0", "w1")}
        third: ClusterManager | None = None
        try:
            await first.wait_for_workers(2, 20.0)
            await second.wait_for_workers(2, 20.0)
            # Each router's call completes; the deltas of each go to its own router only.
            for cluster, request_id in ((first, "a-0"), (second, "b-0")):
                deltas = await collect(cluster, GenerateCall(request_id, tuple(PROMPT), greedy(8), 0.0))
                assert tokens_of(deltas) == expected[:8] and deltas[-1].finish_reason == "length"
            # Both routers hear every worker's KV events: each indexes the blocks the other router's call stored.
            await until(lambda: all(c.state.index.num_blocks >= 3 for c in (first, second)), 10.0, "KV events")

            # A long call on each router; the second router dies mid-stream.
            kept = asyncio.ensure_future(collect(first, GenerateCall("a-1", tuple(PROMPT[:20]), greedy(200), 0.0)))
            lost_deltas: list[TokenDelta] = []

            async def lost_stream() -> None:
                async for delta in second.generate(GenerateCall("b-1", tuple(PROMPT[:30]), greedy(200), 0.0)):
                    lost_deltas.append(delta)

            lost = asyncio.ensure_future(lost_stream())
            await until(lambda: len(lost_deltas) >= 5, 20.0, "the second router's stream")
            lost_on = second._calls["b-1"].worker_id
            die(second)
            lost.cancel()  # its HTTP client loses its connection with the router process
            deltas = await asyncio.wait_for(kept, 60.0)
            assert deltas[-1].finish_reason == "length" and len(tokens_of(deltas)) == 200
            assert not any(d.error for d in deltas)
            # The workers give the dead router up (abort its call, free its blocks) and keep serving the first.
            await until(lambda: all(not link.registered for w in workers.values()
                                    for link in w.worker._links.links if link.address == second_address),
                        10.0, "the workers to give up the dead router")
            await wait_clean(first, ["w0", "w1"])
            assert sorted(first.workers) == ["w0", "w1"] and first.lost_workers == {}
            assert all(w.thread.is_alive() for w in workers.values())
            assert not workers[lost_on].worker._links.owner, "the dead router's call is still owned"

            # A new router joins through the first: the workers register with it and send their snapshots, so its
            # index holds the cached prefix and it routes a repeat of the prompt to a worker that has it.
            third = router(tiny)
            await third.start()
            await third.join(first_address, 20.0)
            await third.wait_for_workers(2, 20.0)
            await until(lambda: third.state.index.num_blocks >= 3, 10.0, "the snapshots")
            deltas = await collect(third, GenerateCall("c-0", tuple(PROMPT), greedy(8), 0.0))
            assert tokens_of(deltas) == expected[:8]
            assert deltas[-1].num_cached_tokens >= 2 * BLOCK_SIZE, deltas[-1]
            assert first_address in third.pool.peer_routers and third.address in first.pool.peer_routers
        finally:
            for cluster in (third, first):  # the first router is the last: its shutdown stops the workers
                if cluster is not None:
                    await cluster.shutdown(timeout_s=5.0)
            for w in workers.values():
                await asyncio.to_thread(w.thread.join, 10.0)
        for worker_id, w in workers.items():
            assert not w.thread.is_alive() and w.error is None, f"{worker_id}: {w.error!r}"

    asyncio.run(main())


def test_a_router_that_shuts_down_leaves_the_workers_to_the_others(tiny: LoadedModel) -> None:
    async def main() -> None:
        first, second = router(tiny), router(tiny)
        first_address, second_address = await first.start(), await second.start()
        worker = start(tiny, first_address, "w0", "mixed", more_router_addresses=(second_address,))
        try:
            await first.wait_for_workers(1, 20.0)
            await second.wait_for_workers(1, 20.0)
            await second.shutdown(timeout_s=5.0)  # its worker says goodbye to it alone
            assert second.lost_workers == {"w0": "left: its router shut down; serving the others"}
            deltas = await collect(first, GenerateCall("a-0", tuple(PROMPT), greedy(4), 0.0))
            assert deltas[-1].finish_reason == "length" and worker.thread.is_alive()
        finally:
            await first.shutdown(timeout_s=5.0)
            await asyncio.to_thread(worker.thread.join, 10.0)
        assert not worker.thread.is_alive() and worker.error is None, repr(worker.error)

    asyncio.run(main())


def test_a_router_that_comes_back_at_its_address_gets_the_workers_and_their_cache_again(tiny: LoadedModel) -> None:
    async def main() -> None:
        first, second = router(tiny), router(tiny)
        first_address, second_address = await first.start(), await second.start()
        worker = start(tiny, first_address, "w0", "mixed", more_router_addresses=(second_address,),
                       router_link_timeout_s=1.0, router_timeout_s=10.0)
        back: ClusterManager | None = None
        try:
            await second.wait_for_workers(1, 20.0)
            deltas = await collect(first, GenerateCall("a-0", tuple(PROMPT), greedy(4), 0.0))
            assert deltas[-1].finish_reason == "length"
            die(second)
            await until(lambda: not worker.worker._links.links[1].registered, 10.0, "the worker to give it up")
            # The router restarts at the same address (no --join): the worker, still registering there, comes back
            # with a snapshot of its prefix cache.
            back = router(tiny, bind_address=second_address)
            await back.start()
            await back.wait_for_workers(1, 20.0)
            await until(lambda: back.state.index.num_blocks >= 3, 10.0, "the snapshot")
            deltas = await collect(back, GenerateCall("b-0", tuple(PROMPT), greedy(4), 0.0))
            assert deltas[-1].num_cached_tokens >= 2 * BLOCK_SIZE, deltas[-1]
        finally:
            if back is not None:
                await back.shutdown(timeout_s=5.0)
            await first.shutdown(timeout_s=5.0)
            await asyncio.to_thread(worker.thread.join, 10.0)
        assert not worker.thread.is_alive() and worker.error is None, repr(worker.error)

    asyncio.run(main())


def test_routers_gossip_new_routers_so_a_worker_of_any_router_hears_of_every_one(tiny: LoadedModel) -> None:
    async def main() -> None:
        first, second, third = router(tiny), router(tiny), router(tiny)
        first_address = await first.start()
        second_address, third_address = await second.start(), await third.start()
        options = {"router_link_timeout_s": 1.0, "router_timeout_s": 10.0}
        workers = [start(tiny, first_address, "w0", "mixed", **options)]
        try:
            await first.wait_for_workers(1, 20.0)
            await second.join(first_address, 20.0)
            await third.join(second_address, 20.0)  # through the second: the first hears of it from the second
            everyone = {first_address, second_address, third_address}
            await until(lambda: all(set(c.pool.peer_routers) == everyone - {c.address}
                                    for c in (first, second, third)), 10.0, "every router to know every other")
            # The router the third joined through dies; a worker that knows only the first still reaches the third,
            # which it hears of from the first.
            die(second)
            workers.append(start(tiny, first_address, "w1", "mixed", **options))
            await until(lambda: "w1" in third.workers, 20.0, "the new worker to register with the third router")
            await third.wait_for_workers(2, 20.0)
            deltas = await collect(third, GenerateCall("c-0", tuple(PROMPT), greedy(4), 0.0))
            assert deltas[-1].finish_reason == "length"
            # (A worker leaves a router that shuts down while another may still come back: the dead one is given up
            # first, so the first router's shutdown below is the last and stops the workers.)
            await until(lambda: not any(link.registered for w in workers for link in w.worker._links.links
                                        if link.address == second_address), 10.0, "the dead router to be given up")
        finally:
            await third.shutdown(timeout_s=5.0)
            await first.shutdown(timeout_s=5.0)  # the last live router: its shutdown stops the workers
            for w in workers:
                await asyncio.to_thread(w.thread.join, 10.0)
        for w in workers:
            assert not w.thread.is_alive() and w.error is None, repr(w.error)

    asyncio.run(main())


def test_a_workers_kv_events_ride_in_its_heartbeat_frame(tiny: LoadedModel) -> None:
    """One frame per heartbeat, events and stats together (rpc.Heartbeat): a router reads one frame where it read
    two, and applies the events."""
    async def main() -> None:
        cluster = router(tiny)
        kinds: list[str] = []
        handle = cluster.pool.handle

        def recording(sender: str, message: object) -> None:
            kinds.append(type(message).__name__)
            handle(sender, message)  # type: ignore[arg-type]

        cluster.pool.handle = recording  # type: ignore[method-assign]
        await cluster.start()
        worker = start(tiny, cluster.address, "w0", "mixed")
        try:
            await cluster.wait_for_workers(1, 20.0)
            deltas = await collect(cluster, GenerateCall("a-0", tuple(PROMPT), greedy(4), 0.0))
            assert deltas[-1].finish_reason == "length"
            # The stored blocks' events applied (the index's seq for the worker moved), from a heartbeat's frame.
            await until(lambda: cluster.state.index.last_seq("w0") > 0, 10.0, "the prompt's KV events")
            assert "Heartbeat" in kinds and "Stats" in kinds  # with events, and without
            assert "KVEvents" not in kinds, kinds
        finally:
            await cluster.shutdown(timeout_s=5.0)
            await asyncio.to_thread(worker.thread.join, 10.0)
        assert not worker.thread.is_alive() and worker.error is None, repr(worker.error)

    asyncio.run(main())
