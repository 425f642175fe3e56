"""`kvbaton serve --ray local`: workers placed by Ray (server/ray_workers.py), end to end on tiny-random.

One prefill and one decode worker, each a child process of its own Ray actor on a single-node Ray
instance bound to 127.0.0.1, KV over TCP as between two nodes. Checks: greedy output equals
`kvbaton generate`'s and every block is back after; a worker killed under the actor is noticed through
the actor and dropped with its exit code; SIGTERM stops the router, the workers and the whole Ray
instance (every process the launcher started, found by walking /proc, is gone). Then the actor handle
alone: a worker's exit code, and an actor killed under its worker; and a two-node Ray cluster (two
raylets on this host) that gets one worker per node and KV over TCP unasked; and a TP2 prefill worker whose
actor holds a CPU per rank; and the KV store on Ray, read over its TCP path. ~100 s (five Ray starts).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from tests.server.serve_helpers import Served, cmdline, generate_text, kill_pid, serve_process, wait_pd_idle

PROMPTS = ["The quick brown fox jumps over the lazy dog. Then",
           "You are a careful assistant. Answer in one short sentence. " * 3 + "Question: what is a fox?"]


def _parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[1])


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                children.setdefault(_parent(int(entry)), []).append(int(entry))
    found: set[int] = set()
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            found.add(child)
            stack.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z"):
            return False  # exited, not yet reaped by its parent
    return True


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Served, set[int]]]:
    started: set[int] = set()
    with serve_process(["--ray", "local", "--model", "tiny-random", "--prefill", "1", "--decode", "1",
                        "--kv-transport", "tcp", "--num-blocks", "256", "--drain-timeout", "5",
                        "--local-prefill-threshold", "0"], startup_timeout_s=240.0) as server:
        try:
            started = _descendants(server.process.pid)  # Ray's own processes, the actors, the workers
            yield server, started
        finally:
            if server.process.poll() is None:
                server.process.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    server.process.wait(60)
            for pid in started:  # only if the launcher failed to stop them
                kill_pid(pid)


def test_ray_placed_1p1d_serves_like_generate_and_returns_every_block(served: tuple[Served, set[int]]) -> None:
    server, _ = served
    assert "with 0 mixed + 1 prefill + 1 decode worker(s) on Ray node(s) 127.0.0.1" in server.banner, server.banner
    for pid in server.worker_pids:  # each worker is the child of its own Ray actor, not of the launcher
        actor = _parent(pid)
        assert actor != server.process.pid and cmdline(actor).startswith("ray::WorkerHost"), cmdline(actor)
    assert len({_parent(pid) for pid in server.worker_pids}) == 2
    with httpx.Client(timeout=300) as http:
        for prompt in PROMPTS:
            body = {"model": "tiny-random", "prompt": prompt, "max_tokens": 10, "temperature": 0}
            got = http.post(server.url + "/v1/completions", json=body).json()
            assert got["choices"][0]["text"] == generate_text("tiny-random", prompt, 10), prompt
        info, workers = wait_pd_idle(http, server.url)
    assert workers["d0"]["kv_address"].startswith("tcp://127.0.0.1:")
    assert {w["host"] for w in workers.values()} == {socket.gethostname()}  # pids are per host: /cluster names it
    assert info["transfers"]["num_completed"] == 2 * len(PROMPTS) and info["transfers"]["num_recomputed"] == 0


def test_worker_killed_under_its_actor_is_dropped_then_sigterm_stops_everything(
        served: tuple[Served, set[int]]) -> None:
    server, started = served
    with httpx.Client(timeout=30) as http:
        info = http.get(server.url + "/cluster").json()
        decode_pid = next(w["pid"] for w in info["workers"] if w["worker_id"] == "d0")
        os.kill(decode_pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        # Dropped as soon as the router notices (its process exit, or its connection gone); the exit code that
        # the actor reports is in the reason either way.
        while "exited with code -9" not in info["lost_workers"].get("d0", ""):
            assert time.monotonic() < deadline, info
            time.sleep(0.1)
            info = http.get(server.url + "/cluster").json()
    assert [w["worker_id"] for w in info["workers"]] == ["p0"]
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(60) == 0
    assert server.process.stdout.read().strip().endswith("kvbaton: stopped")  # type: ignore[union-attr]
    deadline = time.monotonic() + 20
    while any(_alive(pid) for pid in started):
        assert time.monotonic() < deadline, {pid: cmdline(pid) for pid in started if _alive(pid)}
        time.sleep(0.2)


def test_actor_handle_reports_the_exit_code_and_an_actor_killed_under_its_worker() -> None:
    from kvbaton.core.cluster_secret import ClusterSecret
    from kvbaton.server.ray_workers import LOCAL, RayPlacement, RayWorker

    async def start(placement: RayPlacement) -> dict[str, object]:
        # `kvbaton worker --help` exits 0 at once; a bad flag exits 2 (argparse); a worker whose router never
        # answers runs until its register timeout (60 s), long after this test killed its actor.
        return await placement.start([RayWorker("ok", ("--help",)), RayWorker("bad", ("--no-such-flag",)),
                                      RayWorker("hung", ("--router", "tcp://127.0.0.1:9", "--model", "tiny-random"))],
                                     timeout_s=120, secret=ClusterSecret.generate())

    before = _descendants(os.getpid())
    placement = RayPlacement(LOCAL)
    try:
        handles = asyncio.run(start(placement))
        assert handles["ok"].wait(60) == 0 and handles["bad"].wait(60) == 2  # type: ignore[attr-defined]
        hung = handles["hung"]
        assert hung.poll() is None  # type: ignore[attr-defined]
        with pytest.raises(subprocess.TimeoutExpired):
            hung.wait(0.2)  # type: ignore[attr-defined]
        placement.ray.kill(hung.actor)  # type: ignore[attr-defined]
        assert hung.wait(60) == -signal.SIGKILL  # type: ignore[attr-defined]
        worker_pid = hung.pid  # type: ignore[attr-defined]
    finally:
        placement.close()
    kill_pid(worker_pid)  # orphaned with its actor: it would exit at its register timeout
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in _descendants(os.getpid()) - before):
        assert time.monotonic() < deadline, [cmdline(p) for p in _descendants(os.getpid()) - before]
        time.sleep(0.2)


def test_gpus_per_worker_without_ray_is_refused_with_a_message() -> None:
    done = subprocess.run([sys.executable, "-m", "kvbaton.cli", "serve", "--model", "tiny-random", "--gpus-per-worker",
                           "1"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--gpus-per-worker takes a non-negative number, with --ray" in done.stderr
    assert "Traceback" not in done.stderr


def test_two_node_ray_cluster_spreads_the_workers_and_moves_kv_over_tcp() -> None:
    """Two Ray nodes (two raylets on this host, both on 127.0.0.1) stand in for two machines: the workers land on
    different nodes, KV moves over TCP without being asked, and the answer is still `kvbaton generate`'s."""
    from kvbaton.server.ray_workers import LOCAL, import_ray

    import_ray(LOCAL)  # loopback binding, set before Ray is first imported
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        with serve_process(["--ray", cluster.address, "--model", "tiny-random", "--prefill", "1", "--decode", "1",
                            "--threads-per-worker", "1", "--num-blocks", "256", "--drain-timeout", "5",
                            "--local-prefill-threshold", "0"], startup_timeout_s=240.0) as server:
            raylets = {_parent(_parent(pid)) for pid in server.worker_pids}  # worker -> its actor -> the node's raylet
            assert len(raylets) == 2 and all("raylet" in cmdline(pid) for pid in raylets), raylets
            prompt = PROMPTS[1]
            with httpx.Client(timeout=300) as http:
                got = http.post(server.url + "/v1/completions", json={"model": "tiny-random", "prompt": prompt,
                                                                       "max_tokens": 10, "temperature": 0}).json()
                deadline = time.monotonic() + 20
                info = http.get(server.url + "/cluster").json()
                while info["transfers"]["num_completed"] < 2:  # the workers' counters come with their heartbeats
                    assert time.monotonic() < deadline, info
                    time.sleep(0.1)
                    info = http.get(server.url + "/cluster").json()
            assert got["choices"][0]["text"] == generate_text("tiny-random", prompt, 10)
            decode = next(w for w in info["workers"] if w["worker_id"] == "d0")
            assert decode["kv_address"].startswith("tcp://127.0.0.1:") and info["transfers"]["num_completed"] == 2
            server.process.send_signal(signal.SIGTERM)
            assert server.process.wait(60) == 0
            deadline = time.monotonic() + 20
            while any(_alive(pid) for pid in server.worker_pids):  # the cluster stays; the workers are gone
                assert time.monotonic() < deadline
                time.sleep(0.2)
    finally:
        cluster.shutdown()


def test_a_tp2_prefill_worker_on_ray_holds_a_cpu_per_rank_and_hands_off_to_a_tp1_decode_worker() -> None:
    """One 3-CPU Ray node, joined here as a driver to watch what is held: the TP2 prefill worker's actor holds two
    CPUs (one thread per rank), the decode worker's one; the ranks run under the actor's worker, the handoff from
    TP2 to TP1 gives `LLM`'s float32 output, and /cluster shows each worker's degrees."""
    from kvbaton import LLM, SamplingParams
    from kvbaton.server.ray_workers import LOCAL, import_ray

    ray = import_ray(LOCAL)  # loopback binding, set before Ray is first imported
    from ray.cluster_utils import Cluster

    prompt = PROMPTS[1]
    with LLM("tiny-random", dtype="float32", num_blocks=64) as llm:
        want = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0))[0].outputs[0].text
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "include_dashboard": False})
    try:
        ray.init(address=cluster.address)
        with serve_process(["--ray", cluster.address, "--model", "tiny-random", "--dtype", "float32", "--prefill", "1",
                            "--decode", "1", "--prefill-tp", "2", "--threads-per-worker", "1", "--num-blocks", "128",
                            "--drain-timeout", "5", "--local-prefill-threshold", "0"],
                           startup_timeout_s=240.0) as server:
            deadline = time.monotonic() + 30
            while ray.available_resources().get("CPU", 0.0) != 0.0:  # 2 + 1 of the 3 (1 + 1 before: one was free)
                assert time.monotonic() < deadline, ray.available_resources()
                time.sleep(0.1)
            with httpx.Client(timeout=300) as http:
                got = http.post(server.url + "/v1/completions", json={"model": "tiny-random", "prompt": prompt,
                                                                       "max_tokens": 8, "temperature": 0}).json()
                _, workers = wait_pd_idle(http, server.url, handoffs={"p0": 1})
            assert got["choices"][0]["text"] == want
            assert workers["p0"]["transfers"]["num_completed"] == 1
            assert {w: (workers[w]["tensor_parallel_size"], workers[w]["pipeline_parallel_size"])
                    for w in workers} == {"p0": (2, 1), "d0": (1, 1)}
            prefill_pid = workers["p0"]["pid"]
            assert cmdline(_parent(prefill_pid)).startswith("ray::WorkerHost")  # the worker runs under its actor
            ranks = {pid for pid in _descendants(prefill_pid) if "kvbaton.engine.rank_process" in cmdline(pid)}
            assert len(ranks) == 2, [cmdline(pid) for pid in _descendants(prefill_pid)]
            server.process.send_signal(signal.SIGTERM)
            assert server.process.wait(60) == 0
            deadline = time.monotonic() + 20
            while any(_alive(pid) for pid in {*server.worker_pids, *ranks}):  # workers and ranks gone with them
                assert time.monotonic() < deadline
                time.sleep(0.2)
    finally:
        ray.shutdown()
        cluster.shutdown()


class _Nodes:
    """The part of `RayPlacement` the launcher's config change reads."""

    def __init__(self, node_ip: str, num_nodes: int) -> None:
        self.node_ip = node_ip
        self.num_nodes = num_nodes


def test_ray_config_binds_the_router_on_its_node_and_moves_kv_over_tcp_between_nodes() -> None:
    from kvbaton.server.launcher import Launcher, ServeConfig

    pd = ServeConfig(num_workers=0, num_prefill=1, num_decode=1, ray_address="auto")
    spread = Launcher.placed_on_ray(pd, _Nodes("10.1.2.3", 2))  # type: ignore[arg-type]
    assert spread.rpc_address == "tcp://10.1.2.3:*" and spread.kv_transport == "tcp"
    one_node = Launcher.placed_on_ray(pd, _Nodes("10.1.2.3", 1))  # type: ignore[arg-type]
    assert one_node.rpc_address == "tcp://10.1.2.3:*" and one_node.kv_transport == "shm"
    given = replace(pd, rpc_address="tcp://10.9.9.9:5557")
    assert Launcher.placed_on_ray(given, _Nodes("10.1.2.3", 2)).rpc_address == "tcp://10.9.9.9:5557"  # type: ignore[arg-type]
    mixed = replace(pd, num_workers=2, num_prefill=0, num_decode=0)  # no handoff: nothing to move
    assert Launcher.placed_on_ray(mixed, _Nodes("10.1.2.3", 2)).kv_transport == "shm"  # type: ignore[arg-type]


def test_the_kv_store_on_ray_serves_workers_over_its_tcp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    """`--ray local --kv-store-gb`: the launcher's node holds the store node, on its IP; with the transport forced to
    TCP (as for workers on another node) the second worker loads the prompt the first computed over the node's TCP
    data path, with the same text, and the node counts the reads."""
    import random

    from kvbaton.core.cluster_secret import ClusterSecret
    from kvbaton.server.store_client import TRANSPORT_ENV, StoreClient
    from tests.server.serve_helpers import read_banner

    monkeypatch.setenv(TRANSPORT_ENV, "tcp")  # the launcher hands it to the actors, as it does the streaming copies
    secret_file = tmp_path / "secret"
    prompt = [random.Random(0).randrange(1, 200) for _ in range(300)]
    body = {"model": "tiny-random", "prompt": prompt, "max_tokens": 5, "temperature": 0}
    with serve_process(["--ray", "local", "--model", "tiny-random", "--workers", "2", "--policy", "round_robin",
                        "--threads-per-worker", "1", "--kv-store-gb", "0.05", "--cluster-secret-file",
                        str(secret_file), "--drain-timeout", "5"], startup_timeout_s=240.0) as server:
        store_line = read_banner(server.process, 60.0)
        assert "KV store node at tcp://127.0.0.1:" in store_line, store_line
        store_address = store_line.split(" at ")[1].split()[0]
        with httpx.Client(timeout=120) as http:
            first = http.post(server.url + "/v1/completions", json=body).json()
            deadline = time.monotonic() + 60
            while True:  # the write-through is asynchronous: ask again, on the other worker, until it has landed
                second = http.post(server.url + "/v1/completions", json=body).json()
                cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
                if cached == 288 or time.monotonic() > deadline:
                    break
                http.post(server.url + "/v1/completions", json={**body, "prompt": [7] * 20})  # keep the turn
        assert cached == 288 and second["choices"][0]["text"] == first["choices"][0]["text"]
        client = StoreClient(store_address, ClusterSecret.read_file(str(secret_file)), timeout_s=10.0)
        try:
            assert client.stats()["num_tcp_reads"] >= 1
        finally:
            client.close()
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(60) == 0
