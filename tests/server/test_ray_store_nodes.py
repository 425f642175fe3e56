"""`kvbaton serve --ray --kv-store-gb`: one KV store node per Ray node that holds workers.

The per-node start logic (which nodes get one, what each worker is told), then end to end on a two-node Ray
cluster (two raylets on this host, both on 127.0.0.1, standing in for two machines; tiny-random): each worker runs
on its own node and is told that node's store as its own, each node's store (`auto`) sized for the one worker placed
on it, the second node's store runs under a `StoreHost` actor
there, the router reads both nodes, and a prompt computed on one worker is loaded by the other from the first
one's node over TCP (cached tokens, the same greedy text); then the first node is killed holding a prompt the other
worker never saw: that worker recomputes it (same text, bounded time), the node's blocks leave the router's
directory, and every worker's blocks come back. ~60 s (one two-node Ray start).
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import httpx

from kvbaton.cache.kv_store import capacity_blocks
from kvbaton.server.ray_workers import stores_to_start, with_store_nodes
from tests.server.serve_helpers import read_banner, serve_process, wait_pd_idle


def test_every_node_holding_workers_but_the_launchers_gets_a_store_node_once() -> None:
    assert stores_to_start(["head", "b", "b", "c", "head"], own_node="head") == ["b", "c"]
    assert stores_to_start(["head", "head"], own_node="head") == []  # one node: the launcher's store serves it
    assert stores_to_start(["b"], own_node="head") == ["b"]  # the launcher's node holds no worker
    args = with_store_nodes(("--router", "tcp://1.2.3.4:5"), "tcp://10.0.0.2:7", ["tcp://10.0.0.1:7", "tcp://10.0.0.2:7"])
    assert args == ("--router", "tcp://1.2.3.4:5", "--kv-store", "tcp://10.0.0.2:7",
                    "--kv-store-nodes", "tcp://10.0.0.1:7,tcp://10.0.0.2:7")


def test_two_ray_nodes_get_a_store_node_each_load_each_others_blocks_and_survive_one_lost(tmp_path: Path) -> None:
    from kvbaton.core.cluster_secret import ClusterSecret
    from kvbaton.server.ray_workers import LOCAL, import_ray
    from kvbaton.server.store_client import StoreClient

    import_ray(LOCAL)  # loopback binding, set before Ray is first imported
    from ray.cluster_utils import Cluster

    secret_file = tmp_path / "secret"
    prompts = [[random.Random(seed).randrange(1, 200) for _ in range(300)] for seed in (1, 2)]
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        with serve_process(["--ray", cluster.address, "--model", "tiny-random", "--workers", "2", "--policy",
                            "round_robin", "--threads-per-worker", "1", "--num-blocks", "256", "--kv-store-gb",
                            "auto", "--cluster-secret-file", str(secret_file), "--drain-timeout", "5"],
                           startup_timeout_s=240.0) as server:
            lines = [read_banner(server.process, 60.0) for _ in range(2)]
            assert "KV store node at tcp://127.0.0.1:" in lines[0] and "on Ray node 127.0.0.1)" in lines[1], lines
            pids = {line.split(" at ")[1].split()[0]: int(line.split("(pid ")[1].split()[0].rstrip(")"))
                    for line in lines}
            assert len(pids) == 2
            with httpx.Client(timeout=120) as http:
                routed = 0  # round robin: the router's n-th call goes to worker n % 2 (w0, w1)

                def complete(prompt: list[int]) -> dict:
                    nonlocal routed
                    routed += 1
                    return http.post(server.url + "/v1/completions", json={
                        "model": "tiny-random", "prompt": prompt, "max_tokens": 5, "temperature": 0}).json()

                def held() -> dict[str, int]:
                    return {node["address"]: node["num_blocks"] for node in
                            http.get(server.url + "/cluster").json()["kv_store"]["nodes"]}

                nodes = {node["address"]: node["workers"] for node in
                         http.get(server.url + "/cluster").json()["kv_store"]["nodes"]}
                assert set(nodes) == set(pids) and sorted(nodes.values()) == [["w0"], ["w1"]], nodes  # one each
                own = {workers[0]: address for address, workers in nodes.items()}
                secret = ClusterSecret.read_file(str(secret_file))
                slots, block_bytes = [], 0
                for address in nodes:  # auto: each node's DRAM twice the KV pool of the one worker placed on it,
                    client = StoreClient(address, secret, timeout_s=10.0)  # the launcher's node's too (placed first)
                    try:
                        hello = client.hello()
                        slots.append(hello["num_slots"])
                        block_bytes = hello["block_bytes"]
                    finally:
                        client.close()
                one_worker = capacity_blocks(round(2 * 256 * block_bytes / 1e9, 3), block_bytes)  # GB to the MB
                assert slots == [one_worker, one_worker], (slots, one_worker)
                first = complete(prompts[0])  # on w0: written through to w0's node
                deadline = time.monotonic() + 30
                while held()[own["w0"]] < 18:  # asynchronous: until the router's directory has them on w0's node
                    assert time.monotonic() < deadline, held()
                    time.sleep(0.05)
                second = complete(prompts[0])  # on w1, which has never seen it: loaded from w0's node
                cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert cached == 288 and second["choices"][0]["text"] == first["choices"][0]["text"]
                client = StoreClient(own["w0"], secret, timeout_s=10.0)
                try:  # w1 read them over TCP from the other node: no shared memory across nodes
                    assert client.stats()["num_tcp_reads"] >= 1
                finally:
                    client.close()

                # w0's node dies holding a prompt w1 has never seen: w1 recomputes it within a bounded time
                if routed % 2:
                    complete([7] * 20)  # w1's turn
                before = held()[own["w0"]]
                lost = complete(prompts[1])  # on w0
                deadline = time.monotonic() + 30
                while held()[own["w0"]] < before + 18:
                    assert time.monotonic() < deadline, held()
                    time.sleep(0.05)
                os.kill(pids[own["w0"]], signal.SIGKILL)
                started = time.monotonic()
                again = complete(prompts[1])  # on w1
                assert time.monotonic() - started < 30
                assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
                assert again["choices"][0]["text"] == lost["choices"][0]["text"]
                deadline = time.monotonic() + 15
                while held()[own["w0"]]:  # not answering for 3 s: its blocks leave the directory
                    assert time.monotonic() < deadline, held()
                    time.sleep(0.1)
                while held()[own["w1"]] < 18:  # w1's own node still serves: its blocks (written through as w1
                    assert time.monotonic() < deadline, held()  # recomputed, asynchronously) are in the directory
                    time.sleep(0.1)
                complete([9] * 40)  # w0, its own node gone: its saves are dropped, it still serves
                wait_pd_idle(http, server.url)  # every worker's blocks back (only cached ones held), nothing in flight
            server.process.send_signal(signal.SIGTERM)
            assert server.process.wait(60) == 0
    finally:
        cluster.shutdown()
