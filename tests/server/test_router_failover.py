"""Router failover with real processes: `kvbaton serve` and a `kvbaton router --join` over the same two workers; the
joined router is SIGKILLed (by pid) mid-stream. Its client's stream breaks, the other router's stream completes, the
workers stay and free the dead router's blocks, and a new router that joins routes to the prefixes they cached. A lone
router SIGKILLed and started again at its RPC address gets its worker back, with the index rebuilt from a snapshot."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from kvbaton.core.cluster_secret import load_or_create_secret
from tests.server.serve_helpers import kill_pid, read_banner, serve_process

URL = re.compile(r"serving tiny-random at (http://127\.0\.0\.1:\d+) ")
PROMPT = "the router keeps a prefix index of every worker " * 6


def start_router(mode: list[str], secret_file: Path) -> tuple[subprocess.Popen[str], str, str]:
    """`kvbaton router` with `mode` (`--join ADDRESS`, or `--rpc-address ADDRESS` to restart one there) on tiny-random;
    returns the process, its HTTP URL and its banner."""
    command = [sys.executable, "-m", "kvbaton.cli", "router", *mode, "--port", "0", "--model", "tiny-random",
               "--num-blocks", "256", "--cluster-secret-file", str(secret_file), "--drain-timeout", "2"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               start_new_session=True)
    banner = read_banner(process, 120.0)
    match = URL.search(banner)
    assert match, banner
    return process, match.group(1), banner


def join(rpc_address: str, secret_file: Path) -> tuple[subprocess.Popen[str], str]:
    process, url, _ = start_router(["--join", rpc_address], secret_file)
    return process, url


def stream(url: str, prompt: str, max_tokens: int, lines: list[str], errors: list[BaseException], n: int = 1) -> None:
    body = {"model": "tiny-random", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "n": n}
    try:
        with httpx.Client(timeout=120.0) as http, http.stream("POST", url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line:
                    lines.append(line)
    except BaseException as exc:  # noqa: BLE001 - handed to the test thread
        errors.append(exc)


def cluster(url: str) -> dict[str, object]:
    return httpx.get(url + "/cluster", timeout=10.0).json()


@pytest.mark.timeout(300)
def test_a_killed_router_ends_only_its_own_streams_and_a_new_one_joins(tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    routers: list[subprocess.Popen[str]] = []
    log_path = tmp_path / "serve.log"  # the launcher's and its workers' stderr
    with open(log_path, "wb") as log, serve_process(["--model", "tiny-random", "--workers", "2", "--num-blocks", "256",
                                                     "--router-link-timeout", "1", "--cluster-secret-file", str(secret_file)], 180.0,
                                                    stderr=log.fileno()) as served:
        try:
            rpc_address = str(cluster(served.url)["router_address"])
            doomed, doomed_url = join(rpc_address, secret_file)
            routers.append(doomed)
            doomed_rpc = str(cluster(doomed_url)["router_address"])
            # A prompt the first router caches on some worker, for the router that joins last.
            first = httpx.post(served.url + "/v1/completions", timeout=60.0, json={
                "model": "tiny-random", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}).json()
            assert first["choices"][0]["finish_reason"] == "length"

            kept_lines: list[str] = []
            kept_errors: list[BaseException] = []
            lost_lines: list[str] = []
            lost_errors: list[BaseException] = []
            kept = threading.Thread(target=stream, args=(served.url, "a stream that survives", 400, kept_lines,
                                                         kept_errors))
            lost = threading.Thread(target=stream, args=(doomed_url, "a stream that breaks", 1900, lost_lines,
                                                         lost_errors, 4))
            kept.start()
            lost.start()
            deadline = time.monotonic() + 60.0
            while len(lost_lines) < 5 and time.monotonic() < deadline and lost.is_alive():
                time.sleep(0.02)
            assert len(lost_lines) >= 5, (lost_lines, lost_errors)
            # Under load a worker may give a slow router up (and register again) before it dies: count after it.
            log_offset = len(log_path.read_text(errors="replace"))
            kill_pid(doomed.pid)
            doomed.wait(10)
            lost.join(30.0)
            kept.join(120.0)
            assert not lost.is_alive() and not kept.is_alive()
            assert lost_errors or lost_lines[-1] != "data: [DONE]", "the dead router's stream ended cleanly"
            assert not kept_errors, kept_errors
            assert kept_lines[-1] == "data: [DONE]"
            assert json.loads(kept_lines[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"

            # The workers stay, give the dead router up (the one streaming its call aborts it, long before the
            # 4 x 1,900 tokens could have run out) and free what its stream held.
            deadline = time.monotonic() + 30.0
            while True:
                info = cluster(served.url)
                workers = info["workers"]
                assert isinstance(workers, list) and len(workers) == 2 and info["lost_workers"] == {}
                gave_up = re.findall(rf"gives up router {re.escape(doomed_rpc)} .*; (\d+) request",
                                     log_path.read_text(errors="replace")[log_offset:])
                if len(gave_up) == 2 and all(w["num_running"] == 0 and w["num_waiting"] == 0 and
                                             w["invariant_error"] == "" and w["num_used_blocks"] == w["num_cached_blocks"]
                                             for w in workers):
                    break
                assert time.monotonic() < deadline, (workers, gave_up)
                time.sleep(0.2)
            assert sum(map(int, gave_up)) == 4, gave_up  # every sample of the dead router's stream was aborted
            assert served.process.poll() is None

            # A new router joins: the workers register with it and send their snapshots; it routes the cached
            # prompt to the worker holding it.
            fresh, fresh_url = join(rpc_address, secret_file)
            routers.append(fresh)
            again = httpx.post(fresh_url + "/v1/completions", timeout=60.0, json={
                "model": "tiny-random", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}).json()
            assert again["choices"][0]["text"] == first["choices"][0]["text"]
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, again["usage"]
        finally:
            for process in routers:
                if process.poll() is None:
                    process.terminate()
                    try:
                        process.wait(30)
                    except subprocess.TimeoutExpired:
                        kill_pid(process.pid)
                        process.wait(10)


def test_serve_with_two_routers_answers_on_both_and_stops_every_process() -> None:
    with serve_process(["--model", "tiny-random", "--workers", "2", "--num-blocks", "256", "--routers", "2"],
                       180.0) as served:
        assert served.process.stdout is not None
        # The second router's own banner, the launcher's note on it and both routers' lines naming the KV store node
        # share stdout, in any order: read until the note.
        lines: list[str] = []
        match = None
        while match is None and len(lines) < 6:
            lines.append(read_banner(served.process, 120.0))
            match = re.search(r"router at (http://127\.0\.0\.1:\d+) \(pid (\d+)\)", lines[-1])
        assert match, lines
        second_url, second_pid = match.group(1), int(match.group(2))
        first_info, second_info = cluster(served.url), cluster(second_url)
        assert second_info["peer_routers"] == [first_info["router_address"]]
        for info in (first_info, second_info):
            assert sorted(str(w["worker_id"]) for w in info["workers"]) == ["w0", "w1"]  # type: ignore[union-attr]
        for url in (served.url, second_url):
            done = httpx.post(url + "/v1/completions", timeout=60.0, json={
                "model": "tiny-random", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}).json()
            assert done["choices"][0]["finish_reason"] == "length"
        served.process.send_signal(signal.SIGTERM)
        assert served.process.wait(60) == 0
    for pid in (second_pid, *served.worker_pids):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def restart_router(rpc_address: str, secret_file: Path) -> tuple[subprocess.Popen[str], str]:
    """`kvbaton router` without --join at `rpc_address`: it serves once a worker (re-)registered there."""
    process, url, banner = start_router(["--rpc-address", rpc_address], secret_file)
    assert f"came back to {rpc_address}" in banner, banner
    return process, url


@pytest.mark.timeout(300)
def test_a_lone_router_killed_and_restarted_at_its_address_gets_its_worker_and_index_back(tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    load_or_create_secret(str(secret_file))
    rpc_address = f"tcp://127.0.0.1:{free_port()}"
    processes: list[subprocess.Popen[str]] = []
    log_path = tmp_path / "worker.log"
    try:
        with open(log_path, "wb") as log:
            # Its own process, not the launcher's child: it outlives the router; a long --router-timeout leaves the
            # restart time on a loaded host (the worker exits when no router is heard for that long).
            worker = subprocess.Popen(
                [sys.executable, "-m", "kvbaton.cli", "worker", "--router", rpc_address, "--model", "tiny-random",
                 "--worker-id", "w0", "--num-blocks", "256", "--threads", "1", "--router-link-timeout", "1",
                 "--router-timeout", "60", "--cluster-secret-file", str(secret_file)],
                stdout=subprocess.DEVNULL, stderr=log.fileno(), text=True, start_new_session=True)
        processes.append(worker)
        first_router, url = restart_router(rpc_address, secret_file)  # a router that starts with no worker of its own
        processes.append(first_router)
        first = httpx.post(url + "/v1/completions", timeout=60.0, json={
            "model": "tiny-random", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}).json()
        assert first["choices"][0]["finish_reason"] == "length"
        indexed = int(cluster(url)["index_blocks"])  # type: ignore[call-overload]
        assert indexed >= 2

        lines: list[str] = []
        errors: list[BaseException] = []
        lost = threading.Thread(target=stream, args=(url, "a stream that breaks", 1900, lines, errors))
        lost.start()
        deadline = time.monotonic() + 60.0
        while len(lines) < 5 and time.monotonic() < deadline and lost.is_alive():
            time.sleep(0.02)
        assert len(lines) >= 5, (lines, errors)
        kill_pid(first_router.pid)  # SIGKILL: no goodbye, no drain
        first_router.wait(10)
        lost.join(30.0)
        assert not lost.is_alive() and (errors or lines[-1] != "data: [DONE]")

        # A router started again at the same address, with the same secret: the worker (which gave the silent
        # router up, aborting its stream, and kept registering there) comes back and sends its snapshot.
        back, back_url = restart_router(rpc_address, secret_file)
        processes.append(back)
        assert worker.poll() is None
        deadline = time.monotonic() + 30.0
        while True:  # its index holds the prompt's blocks before any call ran through it: the snapshot's
            info = cluster(back_url)
            (w,) = info["workers"]  # type: ignore[misc]
            if (int(info["index_blocks"]) >= indexed and w["num_running"] == 0  # type: ignore[call-overload]
                    and w["num_waiting"] == 0 and w["num_used_blocks"] == w["num_cached_blocks"]):
                break
            assert time.monotonic() < deadline, info
            time.sleep(0.2)
        assert w["invariant_error"] == ""
        log_text = log_path.read_text(errors="replace")
        # 1 request aborted when the broken stream still ran at the worker; 0 when tiny-random wrote its 1,900 tokens
        # before the router was back (a loaded host restarts a router slower than that): no block is held either way
        assert re.search(rf"router {re.escape(rpc_address)} does not know it; registering again, [01] request",
                         log_text), log_text
        again = httpx.post(back_url + "/v1/completions", timeout=60.0, json={
            "model": "tiny-random", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}).json()
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, again["usage"]
        deadline = time.monotonic() + 10.0
        while True:  # the router hears the call's end with the worker's next heartbeat
            (w,) = cluster(back_url)["workers"]  # type: ignore[misc]
            if w["num_running"] == 0 and w["num_used_blocks"] == w["num_cached_blocks"]:
                break
            assert time.monotonic() < deadline, w
            time.sleep(0.1)

        # Its last router stopping stops the worker.
        back.send_signal(signal.SIGTERM)
        assert back.wait(60) == 0
        assert worker.wait(60) == 0
    finally:
        for process in processes:
            if process.poll() is None:
                kill_pid(process.pid)
                process.wait(10)
