"""`kvbaton serve --kv-store-gb`: the launcher starts this host's store node, and a prompt one worker computed is
served by the other from the store (usage reports the cached tokens), with the same text; every router of
`--routers N` reads the store's events; flags are checked first."""

from __future__ import annotations

import random
import re
import time

import httpx
import pytest

from kvbaton.cli import main
from tests.server.serve_helpers import read_banner, serve_process

pytestmark = pytest.mark.timeout(300)


def _complete(http: httpx.Client, url: str, prompt: list[int]) -> dict:
    body = {"model": "tiny-random", "prompt": prompt, "max_tokens": 5, "temperature": 0}
    response = http.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_second_worker_loads_the_prompt_from_the_store() -> None:
    prompt = [random.Random(0).randrange(1, 200) for _ in range(300)]
    args = ["--model", "tiny-random", "--workers", "2", "--policy", "round_robin", "--kv-store-gb", "0.05",
            "--threads-per-worker", "1"]
    with serve_process(args) as served, httpx.Client() as http:
        first = _complete(http, served.url, prompt)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        deadline = time.monotonic() + 30
        while True:  # the write-through is asynchronous: ask again (on the other worker) until it has landed
            second = _complete(http, served.url, prompt)
            cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
            if cached == 288 or time.monotonic() > deadline:
                break
            _complete(http, served.url, [7] * 20)  # keep round robin's turn on the worker that did not compute it
        assert cached == 288  # 18 of 19 blocks: the worker that did not compute the prompt loaded them
        assert second["choices"][0]["text"] == first["choices"][0]["text"]


@pytest.mark.parametrize(("extra", "error"), [
    (["--kv-store-gb", "-1"], "--kv-store-gb must be a positive number"),
    (["--kv-store-gb", "1", "--host-num-blocks", "8"], "replaces the host tier"),
    (["--kv-store-disk-gb", "/tmp/x:1"], "needs --kv-store-gb"),
    (["--kv-store-gb", "1", "--kv-store-disk-gb", "nodir"], "DIR:GB"),
])
def test_bad_store_flags_are_refused_before_anything_starts(monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str], extra: list[str],
                                                            error: str) -> None:
    started: list[object] = []
    monkeypatch.setattr("kvbaton.server.launcher.serve", lambda config: started.append(config) or 0)
    assert main(["serve", "--model", "tiny-random", *extra]) == 2
    assert started == [] and error in capsys.readouterr().err


def test_every_router_of_serve_routers_reads_the_store() -> None:
    """`serve --routers 2 --kv-store-gb`: the second router reads the store node too (its /cluster directory counts the
    blocks the first router's request wrote through), so either router prices store hits."""
    prompt = [random.Random(1).randrange(1, 200) for _ in range(300)]
    args = ["--model", "tiny-random", "--workers", "2", "--policy", "conductor", "--kv-store-gb", "0.05",
            "--threads-per-worker", "1", "--routers", "2"]
    with serve_process(args, 240.0) as served, httpx.Client() as http:
        # After the banner: the store's line, and the second router's banner and store line beside the launcher's
        # note on that router, in any order (the note may come before the second router's store line).
        lines: list[str] = []
        router = None
        while (router is None or not any("(read by this router)" in line for line in lines)) and len(lines) < 6:
            lines.append(read_banner(served.process, 120.0))
            router = router or re.search(r"router at (http://127\.0\.0\.1:\d+) \(pid \d+\)", lines[-1])
        store = next((m for m in (re.search(r"KV store node at (tcp://\S+) \(pid \d+\)", line) for line in lines)
                      if m), None)
        assert store and router, lines
        assert any("KV store node at " + store.group(1) + " (read by this router)" in line for line in lines), lines
        _complete(http, served.url, prompt)
        deadline = time.monotonic() + 30
        while True:  # write-through and the routers' event polls are asynchronous
            infos = [http.get(url + "/cluster", timeout=10).json()["kv_store"] for url in (served.url, router.group(1))]
            if all(info["num_blocks"] >= 19 for info in infos) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert [info["address"] for info in infos] == [store.group(1)] * 2
        # 19 full blocks of 16 tokens: the prompt's 300 and 4 of the output's 5 (its last token is not computed)
        assert [info["num_blocks"] for info in infos] == [19, 19], infos
        second = _complete(http, router.group(1), prompt)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 288


def test_the_router_prices_store_loads_at_the_speed_it_measured() -> None:
    """/cluster's kv_store shows the nominal DRAM speed until a worker's loads from the store add up to a MiB, then
    the speed the router measured from the workers' heartbeats (their bytes loaded and the seconds it took)."""
    args = ["--model", "tiny-random", "--workers", "2", "--policy", "round_robin", "--kv-store-gb", "0.05",
            "--threads-per-worker", "1"]
    rng = random.Random(2)
    with serve_process(args) as served, httpx.Client() as http:
        def kv_store() -> dict:
            return http.get(f"{served.url}/cluster", timeout=10).json()["kv_store"]

        info = kv_store()
        assert info["host_speed"] == "nominal" and info["host_bytes_per_s"] == 3e9, info
        assert info["disk_speed"] == "nominal"
        num_loaded = 0
        for _ in range(10):  # each prompt's load moves ~0.4-0.8 MiB (93 blocks), so a few add up to a MiB
            prompt = [rng.randrange(1, 200) for _ in range(1500)]
            num_blocks = kv_store()["num_blocks"]
            assert _complete(http, served.url, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            deadline = time.monotonic() + 30
            while kv_store()["num_blocks"] < num_blocks + 93 and time.monotonic() < deadline:
                time.sleep(0.05)  # the write-through has landed in the store, and the router heard of it
            second = _complete(http, served.url, prompt)  # round robin's turn: the worker that did not compute it
            num_loaded += second["usage"]["prompt_tokens_details"]["cached_tokens"] == 1488
            deadline = time.monotonic() + 5
            while kv_store()["host_speed"] == "nominal" and time.monotonic() < deadline:
                time.sleep(0.05)  # its heartbeat carries the load's counters
            info = kv_store()
            if info["host_speed"] == "measured":
                break
        assert num_loaded >= 2, num_loaded
        assert info["host_speed"] == "measured", info
        assert info["host_bytes_per_s"] != 3e9 and info["host_bytes_per_s"] == info["links"]["shm"]["bytes_per_s"]
        assert info["links"]["shm"]["num_samples"] >= 1 and info["links"]["tcp"]["num_samples"] == 0
        print(f"measured DRAM load speed: {info['host_bytes_per_s'] / 1e9:.3f} GB/s after {num_loaded} loads")
