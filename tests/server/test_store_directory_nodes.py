"""The router over several live store nodes: it reads the events of every node its workers name as their host's into
one directory, prices a worker's load from its own node over the host link and from another over the NIC, shows every
node in /cluster's kv_store, tells every worker every node (after its acknowledgement, and again when a worker names
a new one), and takes a node that stops answering out of the directory."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import zmq.asyncio

from kvbaton.core.cluster_secret import ClusterSecret
from kvbaton.router.conductor import store_tiers
from kvbaton.router.base import RouteRequest
from kvbaton.server.cluster import ClusterManager
from kvbaton.server.store_node import StoreNodeState
from kvbaton.server import rpc
from tests.server.test_cluster_manager import ScriptedWorker, register, run_cluster

pytestmark = pytest.mark.timeout(60)

SECRET = ClusterSecret(b"d" * 32)
NS = ("rev1", "layout", "")


async def _until(condition, timeout_s: float = 10.0) -> None:  # noqa: ANN001
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "not within the time"
        await asyncio.sleep(0.02)


def test_the_router_reads_every_workers_node_and_forgets_a_lost_one(store_node) -> None:  # noqa: ANN001
    first = store_node(StoreNodeState(256, 4, 16), SECRET)
    second = store_node(StoreNodeState(256, 4, 16), SECRET)
    with first.server.locked():
        first.state.put(NS, 0, [11, 12, 13], [b"a" * 256] * 3)
    with second.server.locked():
        second.state.put(NS, 0, [21], [b"b" * 256])

    async def body(cluster: ClusterManager, context: zmq.asyncio.Context) -> None:
        workers = []
        for worker_id, node in (("w0", first), ("w1", second)):  # registered over the wire: it carries the node
            worker = ScriptedWorker(context, cluster, worker_id)
            workers.append(worker)
            await worker.send(dataclasses.replace(register(worker_id), store_node=node.address))
            await worker.expect(rpc.RegisterAck)
            told = await worker.expect(rpc.StoreNodesKnown)  # the router's host's node first, then the workers'
            assert told.addresses == f"{second.address},{first.address}", told  # type: ignore[attr-defined]
            await worker.heartbeat()
        third = store_node(StoreNodeState(256, 4, 16), SECRET)  # a worker on a third host: the others hear of it
        late = ScriptedWorker(context, cluster, "w2")
        await late.send(dataclasses.replace(register("w2"), store_node=third.address))
        await late.expect(rpc.RegisterAck)
        every = f"{second.address},{first.address},{third.address}"
        assert (await late.expect(rpc.StoreNodesKnown)).addresses == every  # type: ignore[attr-defined]
        for worker in workers:
            assert (await worker.expect(rpc.StoreNodesKnown)).addresses == every  # type: ignore[attr-defined]
        cluster.pool.remove("w2", "test")
        late.close()
        store = cluster.state.store
        await _until(lambda: store.num_blocks(first.address) == 3 and store.num_blocks(second.address) == 1)
        info = cluster.cluster_info()["kv_store"]
        assert info["address"] == second.address and info["num_blocks"] == 4  # the router's host's node first
        assert [(n["address"], n["num_blocks"], n["workers"]) for n in info["nodes"]] == [
            (second.address, 1, ["w1"]), (first.address, 3, ["w0"]), (third.address, 0, [])]
        # w0 reads node 1 as its own (host link), w1 the same blocks from another node (NIC)
        request = RouteRequest("r", (11, 12, 13, 14), 20)
        assert store_tiers(cluster.state, request, "w0", 0, 3) == {
            "num_store_dram_blocks": 3, "num_store_disk_blocks": 0, "num_store_remote_blocks": 0}
        assert store_tiers(cluster.state, request, "w1", 0, 3)["num_store_remote_blocks"] == 3
        for feed in cluster._store_feeds.values():
            feed.lost_after_s = 1.0
        first.stop()  # node 1 dies: its blocks leave the directory once it has not answered for lost_after_s
        await _until(lambda: store.num_blocks(first.address) == 0, timeout_s=15.0)
        assert store.match([11]) == 0 and store.num_blocks(second.address) == 1
        store.check_invariants()
        cluster.pool.remove("w0", "test")
        assert "w0" not in cluster.state.store_node_of
        for worker in workers:
            worker.close()

    run_cluster(body, kv_store_address=second.address, kv_store_block_bytes=256, cluster_secret=SECRET)
