"""A store node per host without Ray: `kvbaton serve --kv-store-gb` runs the first host's node, `kvbaton store-node`
another "host"'s (here on 127.0.0.1 too), and a `kvbaton worker` started by hand with that node as its own and no
node list registers: the router reads both nodes and tells each worker both (`rpc.StoreNodesKnown`), and a prompt one
worker computed is loaded by the other from the first one's node over TCP (the path between hosts) with the same
greedy text. `kvbaton store-node` sizes its blocks as serve's; without a secret it refuses. ~40 s (tiny-random)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvbaton.core.cluster_secret import ClusterSecret, SECRET_ENV
from kvbaton.model.registry import read_model_header, resolve_model_source
from kvbaton.server.store_client import StoreClient
from tests.server.serve_helpers import kill_pid, read_banner, serve_process, wait_pd_idle


def _store_node(secret_file: Path) -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen([sys.executable, "-m", "kvbaton.cli", "store-node", "--model", "tiny-random",
                                "--kv-store-gb", "0.05", "--cluster-secret-file", str(secret_file)],
                               stdout=subprocess.PIPE, text=True, start_new_session=True)
    line = read_banner(process, 60.0)  # type: ignore[arg-type]
    assert line.startswith("store node ready tcp://127.0.0.1:"), line
    return process, line.split()[-1]


def test_store_node_without_a_secret_is_refused() -> None:
    environment = {key: value for key, value in os.environ.items() if key != SECRET_ENV}
    done = subprocess.run([sys.executable, "-m", "kvbaton.cli", "store-node", "--model", "tiny-random",
                           "--kv-store-gb", "0.05"], capture_output=True, text=True, timeout=60, env=environment)
    assert done.returncode == 2 and "no cluster secret" in done.stderr and "Traceback" not in done.stderr


def test_a_worker_on_another_hosts_node_is_told_every_node_and_loads_over_tcp(tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    prompt = [random.Random(3).randrange(1, 200) for _ in range(300)]
    body = {"model": "tiny-random", "prompt": prompt, "max_tokens": 5, "temperature": 0}
    worker: subprocess.Popen[bytes] | None = None
    node: subprocess.Popen[str] | None = None
    with serve_process(["--model", "tiny-random", "--workers", "1", "--policy", "round_robin", "--threads-per-worker",
                        "1", "--num-blocks", "256", "--kv-store-gb", "0.05", "--cluster-secret-file", str(secret_file),
                        "--drain-timeout", "5"]) as server:
        first_node = read_banner(server.process, 60.0).split(" at ")[1].split()[0]
        try:
            node, second_node = _store_node(secret_file)
            secret = ClusterSecret.read_file(str(secret_file))
            client = StoreClient(second_node, secret, timeout_s=10.0)
            try:  # sized as serve sizes its own: tiny-random's KV bytes a token (bf16 by default) x 16 tokens
                model_config, _ = read_model_header(resolve_model_source("tiny-random"))
                assert client.hello()["block_bytes"] == model_config.kv_bytes_per_token(2) * 16
            finally:
                client.close()
            with httpx.Client(timeout=120) as http:
                rpc_address = http.get(server.url + "/cluster").json()["router_address"]
                worker = subprocess.Popen([sys.executable, "-m", "kvbaton.cli", "worker", "--router", rpc_address,
                                           "--model", "tiny-random", "--worker-id", "w1", "--num-blocks", "256",
                                           "--threads", "1", "--kv-store", second_node, "--cluster-secret-file",
                                           str(secret_file)], start_new_session=True, stderr=subprocess.DEVNULL)
                deadline = time.monotonic() + 120
                while True:
                    info = http.get(server.url + "/cluster").json()
                    if len(info["workers"]) == 2:
                        break
                    assert worker.poll() is None and time.monotonic() < deadline, info
                    time.sleep(0.2)
                assert [(n["address"], n["workers"]) for n in info["kv_store"]["nodes"]] == [
                    (first_node, ["w0"]), (second_node, ["w1"])]
                first = http.post(server.url + "/v1/completions", json=body).json()
                deadline = time.monotonic() + 30
                while True:  # the write-through is asynchronous: until the router's directory has all 18 blocks
                    held = [n["num_blocks"] for n in http.get(server.url + "/cluster").json()["kv_store"]["nodes"]]
                    if max(held) >= 18:
                        break
                    assert time.monotonic() < deadline, held
                    time.sleep(0.05)
                second = http.post(server.url + "/v1/completions", json=body).json()  # round robin: the other worker
                cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert cached == 288 and second["choices"][0]["text"] == first["choices"][0]["text"]
                wait_pd_idle(http, server.url)
            reads = 0
            for address in (first_node, second_node):  # same-host loads map the slots: a TCP read is a remote one
                client = StoreClient(address, secret, timeout_s=10.0)
                try:
                    reads += client.stats()["num_tcp_reads"]
                finally:
                    client.close()
            assert reads >= 1
            server.process.send_signal(signal.SIGTERM)
            assert server.process.wait(60) == 0
            assert worker.wait(30) == 0  # its router shut it down
        finally:
            if worker is not None:
                kill_pid(worker.pid)
                worker.wait(10)
            if node is not None:
                node.send_signal(signal.SIGTERM)
                assert node.wait(30) == 0
