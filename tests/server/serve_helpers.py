"""`kvbaton serve` as a test subprocess: start it, read its banner, and stop it and its workers by pid."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

BANNER = re.compile(r"at (http://127\.0\.0\.1:\d+) .*\(pids ([\d ]+)\)")


@dataclass
class Served:
    process: subprocess.Popen[str]
    url: str
    worker_pids: list[int]
    banner: str


def read_banner(process: subprocess.Popen[str], timeout_s: float) -> str:
    """The first stdout line, or fail with what the process said if it dies or stalls."""
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(process.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(timeout_s)
    if not lines or not lines[0]:
        process.kill()
        raise AssertionError(f"kvbaton serve did not start: {process.communicate(timeout=10)}")
    return lines[0]


def child_pids(pid: int) -> list[int]:
    """`pid`'s child processes (none once it is gone)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    try:
        return [int(child) for child in path.read_text().split()]
    except OSError:
        return []


def cmdline(pid: int) -> str:
    """`pid`'s command line, its arguments joined by spaces ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def kill_pid(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def serve_process(args: Sequence[str], startup_timeout_s: float = 180.0,
                  stderr: int = subprocess.DEVNULL) -> Iterator[Served]:
    """`kvbaton serve --port 0 ARGS`; on exit SIGTERM (drain), then SIGKILL the router and any worker left."""
    command = [sys.executable, "-m", "kvbaton.cli", "serve", "--port", "0", *args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True)
    worker_pids: list[int] = []
    try:
        banner = read_banner(process, startup_timeout_s)
        match = BANNER.search(banner)
        assert match, banner
        worker_pids = [int(p) for p in match.group(2).split()]
        yield Served(process, match.group(1), worker_pids, banner)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                kill_pid(process.pid)
                process.wait(10)
        for pid in worker_pids:  # the launcher reaps its workers; this only guards against a broken launcher
            kill_pid(pid)


def generate_text(model: str, prompt: str, max_tokens: int) -> str:
    """`kvbaton generate --json`'s greedy text: what a served completion of `prompt` must equal."""
    command = [sys.executable, "-m", "kvbaton.cli", "generate", "--model", model, "--json", "--prompt", prompt,
               "--max-tokens", str(max_tokens)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=True)
    return str(json.loads(done.stdout)["text"])


def wait_pd_idle(http: httpx.Client, url: str, timeout_s: float = 20.0,
                 handoffs: dict[str, int] | None = None) -> tuple[dict, dict[str, dict]]:
    """Polls /cluster until nothing is in flight and every worker holds only cached blocks (no KV held for a
    transfer) and, if given, each named worker has counted at least that many completed handoffs (its counters
    come with its heartbeat, which may follow the idle view); returns the cluster description and its workers
    by id."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = http.get(url + "/cluster").json()
        workers = {w["worker_id"]: w for w in info["workers"]}
        if info["num_in_flight"] == 0 and all(w["num_used_blocks"] == w["num_cached_blocks"]
                                              and w["transfers"]["num_held_blocks"] == 0 for w in workers.values()) \
                and all(workers[w]["transfers"]["num_completed"] >= n for w, n in (handoffs or {}).items()):
            return info, workers
        assert time.monotonic() < deadline, info
        time.sleep(0.1)
