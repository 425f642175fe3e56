"""Regressions of `kvbaton serve`'s lifecycle: flags refused as one line, a worker that fails after
registering names why, a stop or a failure during startup ends every worker promptly, and a second signal
exits without a traceback. Every process is started here and killed by pid on the way out."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvbaton.server.cluster import ClusterManager
from tests.server.serve_helpers import child_pids, cmdline, kill_pid, serve_process
from tests.server.test_worker_process import run_with_worker

SERVE = [sys.executable, "-m", "kvbaton.cli", "serve", "--model", "tiny-random", "--port", "0"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def _children(pid: int) -> list[int]:
    """`pid`'s child processes but its KV store node (its own tests cover how it ends with the launcher)."""
    return [child for child in child_pids(pid) if "kvbaton.server.store_server" not in cmdline(child)]


@contextlib.contextmanager
def _serve_starting(*args: str) -> Iterator[tuple[subprocess.Popen[str], list[int]]]:
    """`kvbaton serve ARGS` once both of its workers were spawned (they are still loading); kills all by pid."""
    process = subprocess.Popen([*SERVE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 30
        while len(workers) < 2 and process.poll() is None and time.monotonic() < deadline:
            workers = _children(process.pid)
            time.sleep(0.01)
        assert len(workers) == 2, workers
        yield process, workers
    finally:
        kill_pid(process.pid)
        process.communicate(timeout=10)
        for pid in workers:
            kill_pid(pid)


def _run_serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SERVE, *args], capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags", [["--port", "70000"], ["--port", "-1"], ["--block-size", "0"],
                                   ["--num-blocks", "1"]])
def test_bad_serve_flags_are_one_line_errors_before_any_worker_starts(flags: list[str]) -> None:
    done = _run_serve("--workers", "1", *flags)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "kvbaton worker" not in done.stderr, done.stderr
    assert done.stderr.startswith("kvbaton: error: ") and flags[0] in done.stderr, done.stderr


@pytest.mark.timeout(60)
def test_a_worker_failing_after_registration_tells_the_router_why() -> None:
    async def body(cluster: ClusterManager, process: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + 40
        while "w0" not in cluster.lost_workers and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert "queue_policy must be one of" in cluster.lost_workers["w0"], cluster.lost_workers

    process = run_with_worker(body, "--policy", "nosuch")
    assert process.returncode == 2


@pytest.mark.timeout(60)
def test_sigterm_during_startup_stops_the_loading_workers_at_once() -> None:
    with _serve_starting("--workers", "2") as (process, workers):
        process.send_signal(signal.SIGTERM)
        assert process.wait(8) == 0  # was ~10.5 s: workers not yet registered were waited for, then SIGKILLed
        assert "kvbaton: stopped" in process.stdout.read()  # type: ignore[union-attr]
        deadline = time.monotonic() + 3
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [pid for pid in workers if _alive(pid)] == []


@pytest.mark.timeout(60)
def test_a_worker_killed_during_startup_fails_the_launch_at_once_and_names_the_signal() -> None:
    with _serve_starting("--workers", "2") as (process, workers):
        kill_pid(workers[0])
        assert process.wait(8) == 2  # was ~10.5 s: the other worker, still registering, was waited for
        stderr = process.stderr.read()  # type: ignore[union-attr]
        assert f"worker w0 (pid {workers[0]}) was killed by signal 9 during startup" in stderr, stderr
        deadline = time.monotonic() + 3
        while _alive(workers[1]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(workers[1])


@pytest.mark.timeout(90)
def test_a_second_signal_aborts_the_drain_without_a_traceback() -> None:
    with serve_process(["--model", "tiny-random", "--workers", "1", "--num-blocks", "256", "--drain-timeout", "30"],
                       60, stderr=subprocess.PIPE) as served:
        lines: list[str] = []

        def stream() -> None:
            body = {"model": "tiny-random", "prompt": "hi", "max_tokens": 2000, "stream": True, "ignore_eos": True}
            with httpx.Client(timeout=30) as client, client.stream("POST", served.url + "/v1/completions",
                                                                   json=body) as response:
                lines.extend(line for line in response.iter_lines() if line)

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        deadline = time.monotonic() + 20
        while httpx.get(served.url + "/cluster", timeout=5).json()["num_in_flight"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        served.process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        served.process.send_signal(signal.SIGTERM)
        assert served.process.wait(15) == 0
        reader.join(10)
        assert lines[-1] == "data: [DONE]" and '"finish_reason": "abort"' in lines[-2], lines[-2:]
        stderr = served.process.stderr.read()  # type: ignore[union-attr]
        assert "Traceback" not in stderr and "CancelledError" not in stderr, stderr
        assert not _alive(served.worker_pids[0])


# Was a bug: a stream still running at the drain deadline was cut off: uvicorn cancelled its handler, and the client
# read an incomplete chunked body with no final event. Fixed: the launcher aborts what still runs a second before
# the deadline, so every stream ends with finish reason "abort" and [DONE]. (--drain-timeout was also rounded down
# to whole seconds, and a negative one was accepted.)
def test_a_stream_still_running_at_the_drain_deadline_ends_with_abort() -> None:
    with serve_process(["--model", "tiny-random", "--workers", "1", "--num-blocks", "8192", "--drain-timeout", "2.5"],
                       120.0) as served, httpx.Client(timeout=60.0) as http:
        body = {"model": "tiny-random", "prompt": ["drain me", "and me"], "max_tokens": 2000, "n": 16,
                "temperature": 0, "ignore_eos": True, "stream": True}
        with http.stream("POST", served.url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            next(lines)
            stopped_at = time.monotonic()
            served.process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]  # raises on an incomplete chunked read
        assert rest[-1] == "data: [DONE]" and any('"finish_reason":"abort"' in line.replace(" ", "") for line in rest)
        assert served.process.wait(60) == 0
        assert time.monotonic() - stopped_at < 2.5 + 8.0


def test_a_negative_drain_timeout_is_refused() -> None:
    done = subprocess.run([*SERVE, "--workers", "1", "--drain-timeout", "-1"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "--drain-timeout" in done.stderr and "Traceback" not in done.stderr
