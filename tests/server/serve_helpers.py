"""`kvbaton serve` as a test subprocess: start it, read its banner, and stop it and its workers by pid."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

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
