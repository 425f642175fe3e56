"""Regressions of `kvbaton serve --ray`: an address where no Ray cluster answers is refused in seconds
(Ray itself retries it for many minutes); `--ray local` starts its own instance even where RAY_ADDRESS names
another cluster; workers no single node can hold (a parallel worker's ranks counted) are refused at once, not
waited for until the startup timeout;
and a stop signal while Ray is still placing the workers ends the launch promptly, removing its own actors only.

One Ray instance at a time: the serve under RAY_ADDRESS starts (and stops) its own, then a two-node cluster (two
raylets on this host, one CPU each) serves the last two tests. Every process started here is killed by pid on the
way out. ~60 s.
"""

from __future__ import annotations

import contextlib
import importlib.util
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import pytest

from tests.server.serve_helpers import cmdline, generate_text, kill_pid, serve_process
from tests.server.test_ray_serve import _alive, _descendants

# Ray is not imported here: `import_ray` sets how it binds before its first import.
pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs pip install 'kvbaton[ray]'")]

SERVE = [sys.executable, "-m", "kvbaton.cli", "serve", "--model", "tiny-random", "--port", "0", "--num-blocks", "256",
         "--drain-timeout", "5"]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def _serving(args: Sequence[str]) -> Iterator[subprocess.Popen[str]]:
    """`kvbaton serve ARGS` in its own session; on the way out it, and everything it started, killed by pid."""
    process = subprocess.Popen([*SERVE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        yield process
    finally:
        started = _descendants(process.pid)
        kill_pid(process.pid)
        process.communicate(timeout=10)
        for pid in started:
            kill_pid(pid)


def _wait_gone(pids: set[int], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, {pid: cmdline(pid) for pid in pids if _alive(pid)}
        time.sleep(0.2)


def test_a_ray_address_where_nothing_answers_is_refused_in_seconds() -> None:
    began = time.monotonic()
    with _serving(["--ray", f"127.0.0.1:{_closed_port()}"]) as process:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(45)  # Ray alone retries it for ~20 attempts of ~40 s each
        assert process.poll() == 2, f"still trying after {time.monotonic() - began:.0f} s"
        stderr = process.stderr.read()  # type: ignore[union-attr]
    assert "kvbaton: error: cannot join the Ray cluster at '127.0.0.1:" in stderr and "Traceback" not in stderr, stderr


def test_ray_local_starts_its_own_instance_even_where_ray_address_names_another(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{_closed_port()}")  # Ray's own default for ray.init()
    started: set[int] = set()
    try:
        with serve_process(["--ray", "local", "--model", "tiny-random", "--workers", "2", "--num-blocks", "256",
                            "--drain-timeout", "5"], startup_timeout_s=60.0) as server:
            started = _descendants(server.process.pid)
            assert "with 2 mixed + 0 prefill + 0 decode worker(s) on Ray node(s) 127.0.0.1" in server.banner
            prompt = "The quick brown fox jumps over the lazy dog. Then"
            with httpx.Client(timeout=60) as http:
                got = http.post(server.url + "/v1/completions", json={"model": "tiny-random", "prompt": prompt,
                                                                       "max_tokens": 8, "temperature": 0}).json()
            assert got["choices"][0]["text"] == generate_text("tiny-random", prompt, 8)
            server.process.send_signal(signal.SIGTERM)
            assert server.process.wait(60) == 0
        _wait_gone(started)  # the Ray instance it started went with it
    finally:
        for pid in started:
            kill_pid(pid)


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[Any]:
    """A Ray cluster of two one-CPU nodes on this host, and this process connected to it as a driver."""
    from kvbaton.server.ray_workers import LOCAL, import_ray

    ray = import_ray(LOCAL)  # loopback binding, set before Ray is first imported
    from ray.cluster_utils import Cluster

    try:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    except Exception as exc:  # noqa: BLE001 - whatever keeps Ray from starting here
        pytest.skip(f"Ray cannot start here: {exc}")
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_workers_no_single_node_can_hold_are_refused_at_once(two_nodes: Any) -> None:
    began = time.monotonic()
    # Two CPUs in the cluster, but one on each node: a worker holding two fits nowhere.
    with _serving(["--ray", two_nodes.address, "--workers", "1", "--threads-per-worker", "2"]) as process:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(45)  # the startup timeout is 300 s
        assert process.poll() == 2, f"still waiting after {time.monotonic() - began:.0f} s"
        stderr = process.stderr.read()  # type: ignore[union-attr]
    assert "nodes can hold 0 of the 1 workers with 2 CPUs each" in stderr and "Traceback" not in stderr, stderr


def test_a_parallel_worker_holds_a_cpu_per_rank_and_one_no_node_can_hold_is_refused(two_nodes: Any) -> None:
    # One thread per rank, but a TP2 worker has two ranks: two CPUs, on one node (each node has one).
    with _serving(["--ray", two_nodes.address, "--workers", "1", "-tp", "2", "--threads-per-worker", "1"]) as process:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(45)
        assert process.poll() == 2, "still waiting for a node that can hold the TP2 worker"
        stderr = process.stderr.read()  # type: ignore[union-attr]
    assert "nodes can hold 0 of the 1 workers with 2 CPUs each" in stderr and "Traceback" not in stderr, stderr


def _free_cpus(ray: Any) -> float:
    return float(ray.available_resources().get("CPU", 0.0))


def _wait_free_cpus(ray: Any, num_cpus: float, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _free_cpus(ray) != num_cpus:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.1)


def test_a_stop_while_ray_places_the_workers_ends_the_launch_and_only_its_actors(two_nodes: Any) -> None:
    import ray

    @ray.remote(num_cpus=1)
    class Holder:
        def ready(self) -> bool:
            return True

    holder = Holder.remote()  # someone else's actor: one of the two CPUs is taken
    assert ray.get(holder.ready.remote(), timeout=30)
    try:
        _wait_free_cpus(ray, 1.0)
        with _serving(["--ray", two_nodes.address, "--workers", "2", "--threads-per-worker", "1"]) as process:
            _wait_free_cpus(ray, 0.0)  # its first worker placed, the second waiting for a CPU
            process.send_signal(signal.SIGTERM)
            began = time.monotonic()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(30)
            assert process.poll() == 0, f"still placing {time.monotonic() - began:.0f} s after SIGTERM"
            assert process.stdout.read().strip().endswith("kvbaton: stopped")  # type: ignore[union-attr]
            stderr = process.stderr.read()  # type: ignore[union-attr]
            assert "Traceback" not in stderr and "never retrieved" not in stderr, stderr
        _wait_free_cpus(ray, 1.0)  # its actors are gone ...
        assert ray.get(holder.ready.remote(), timeout=30)  # ... and the other driver's actor is not
    finally:
        ray.kill(holder)
