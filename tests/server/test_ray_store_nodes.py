"""`kvbaton serve --ray --kv-store-gb`: one KV store node per Ray node that holds workers.

The per-node start logic (which nodes get one, what each worker is told), then end to end on a two-node Ray
cluster (two raylets on this host, both on 127.0.0.1, standing in for two machines; tiny-random): each worker runs
on its own node and is told that node's store as its own, the second node's store runs under a `StoreHost` actor
there, the router reads both nodes, and a prompt computed on one worker is loaded by the other from the first
one's node over TCP (cached tokens, the same greedy text). ~60 s (one two-node Ray start).
"""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import httpx

from kvbaton.server.ray_workers import stores_to_start, with_store_nodes
from tests.server.serve_helpers import read_banner, serve_process


def test_every_node_holding_workers_but_the_launchers_gets_a_store_node_once() -> None:
    assert stores_to_start(["head", "b", "b", "c", "head"], own_node="head") == ["b", "c"]
    assert stores_to_start(["head", "head"], own_node="head") == []  # one node: the launcher's store serves it
    assert stores_to_start(["b"], own_node="head") == ["b"]  # the launcher's node holds no worker
    args = with_store_nodes(("--router", "tcp://1.2.3.4:5"), "tcp://10.0.0.2:7", ["tcp://10.0.0.1:7", "tcp://10.0.0.2:7"])
    assert args == ("--router", "tcp://1.2.3.4:5", "--kv-store", "tcp://10.0.0.2:7",
                    "--kv-store-nodes", "tcp://10.0.0.1:7,tcp://10.0.0.2:7")


def test_two_ray_nodes_get_a_store_node_each_and_load_each_others_blocks_over_tcp(tmp_path: Path) -> None:
    from kvbaton.core.cluster_secret import ClusterSecret
    from kvbaton.server.ray_workers import LOCAL, import_ray
    from kvbaton.server.store_client import StoreClient

    import_ray(LOCAL)  # loopback binding, set before Ray is first imported
    from ray.cluster_utils import Cluster

    secret_file = tmp_path / "secret"
    prompt = [random.Random(1).randrange(1, 200) for _ in range(300)]
    body = {"model": "tiny-random", "prompt": prompt, "max_tokens": 5, "temperature": 0}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        with serve_process(["--ray", cluster.address, "--model", "tiny-random", "--workers", "2", "--policy",
                            "round_robin", "--threads-per-worker", "1", "--num-blocks", "256", "--kv-store-gb",
                            "0.05", "--cluster-secret-file", str(secret_file), "--drain-timeout", "5"],
                           startup_timeout_s=240.0) as server:
            lines = [read_banner(server.process, 60.0) for _ in range(2)]
            assert "KV store node at tcp://127.0.0.1:" in lines[0] and "(Ray node 127.0.0.1's)" in lines[1], lines
            addresses = {line.split(" at ")[1].split()[0] for line in lines}
            assert len(addresses) == 2
            with httpx.Client(timeout=120) as http:
                nodes = {node["address"]: node["workers"] for node in
                         http.get(server.url + "/cluster").json()["kv_store"]["nodes"]}
                assert set(nodes) == addresses and sorted(map(len, nodes.values())) == [1, 1], nodes  # one worker each
                first = http.post(server.url + "/v1/completions", json=body).json()
                deadline = time.monotonic() + 60
                while True:  # the write-through is asynchronous: ask again, on the other worker, until it has landed
                    second = http.post(server.url + "/v1/completions", json=body).json()
                    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
                    if cached == 288 or time.monotonic() > deadline:
                        break
                    http.post(server.url + "/v1/completions", json={**body, "prompt": [7] * 20})  # keep the turn
                assert cached == 288 and second["choices"][0]["text"] == first["choices"][0]["text"]
                deadline = time.monotonic() + 10
                while True:  # the router's directory has the prompt's blocks on the node that computed them
                    held = {node["address"]: node["num_blocks"] for node in
                            http.get(server.url + "/cluster").json()["kv_store"]["nodes"]}
                    if max(held.values()) >= 18 or time.monotonic() > deadline:
                        break
                    time.sleep(0.1)
            writer = max(held, key=lambda address: held[address])
            assert held[writer] >= 18, held
            secret = ClusterSecret.read_file(str(secret_file))
            reads = {}
            for address in addresses:
                client = StoreClient(address, secret, timeout_s=10.0)
                try:
                    reads[address] = client.stats()["num_tcp_reads"]
                finally:
                    client.close()
            assert reads[writer] >= 1, reads  # the other node's worker read it over TCP: no shared memory across nodes
            server.process.send_signal(signal.SIGTERM)
            assert server.process.wait(60) == 0
    finally:
        cluster.shutdown()
