"""`kvbaton serve --kv-store-gb`: the launcher starts this host's store node, and a prompt one worker computed is
served by the other from the store (usage reports the cached tokens), with the same text; every router of
`--routers N` reads the store's events; flags are checked first."""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from kvbaton.cli import main
from kvbaton.core.cluster_secret import SECRET_ENV, ClusterSecret
from kvbaton.core.errors import KvbatonError
from kvbaton.model.registry import read_model_header, resolve_model_source
from kvbaton.server.launcher import ServeConfig, auto_store_gb, store_node_args
from kvbaton.cache.kv_store import capacity_blocks
from kvbaton.server.store_client import StoreClient
from kvbaton.server.store_server import dram_gb
from kvbaton.server.store_server import start_process as start_store_process
from kvbaton.server.store_server import stop_process as stop_store_process
from kvbaton.server.store_server import main as store_main
from kvbaton.transfer.store_slots import SHM_DIRECTORY, SHM_PREFIX
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
    (["--host-num-blocks", "8"], "--host-num-blocks is gone: the KV store's DRAM tier took the host tier's place"),
    (["--kv-store-gb", "0", "--kv-store-disk-gb", "/tmp/x:1"], "needs --kv-store-gb"),
    (["--kv-store-gb", "some"], "a number of GB or auto"),
    (["--kv-store-gb", "1", "--kv-store-disk-gb", "nodir"], "DIR:GB"),
])
def test_bad_store_flags_are_refused_before_anything_starts(monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str], extra: list[str],
                                                            error: str) -> None:
    started: list[object] = []
    monkeypatch.setattr("kvbaton.server.launcher.serve", lambda config: started.append(config) or 0)
    with pytest.raises(SystemExit) if "some" in extra else contextlib.nullcontext():  # argparse's own refusal
        assert main(["serve", "--model", "tiny-random", *extra]) == 2
    assert started == [] and error in capsys.readouterr().err


def test_a_worker_asked_for_the_old_host_tier_is_refused_before_it_loads_or_registers(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    started: list[object] = []
    monkeypatch.setattr("kvbaton.server.worker.Worker", lambda *args, **kwargs: started.append(args))
    monkeypatch.setattr("signal.signal", lambda *args: None)  # `kvbaton worker` installs a SIGTERM handler
    assert main(["worker", "--router", "tcp://127.0.0.1:1", "--host-num-blocks", "8"]) == 2
    assert started == [] and "--kv-store ADDRESS" in capsys.readouterr().err


def test_a_ray_nodes_store_is_sized_by_that_node_for_its_own_workers(tmp_path, monkeypatch: pytest.MonkeyPatch  # noqa: ANN001
                                                                    ) -> None:
    """`--kv-store-gb auto` on another Ray node: the launcher asks for twice the KV pools of the workers placed there
    (`--kv-store-auto-bytes`), and the node caps that at half of its own /dev/shm's free space; a number stays a
    number on every node, and a bad value or auto without the bytes is refused at the node's start."""
    block = 4096
    model_config, _ = read_model_header(resolve_model_source("tiny-random"))
    args = store_node_args(model_config, "float32", 16, None, "", 3 * block)
    assert args[args.index("--kv-store-gb") + 1 : args.index("--kv-store-gb") + 4] == \
        ["auto", "--kv-store-auto-bytes", str(3 * block)]
    assert "auto" not in store_node_args(model_config, "float32", 16, 0.5)
    assert dram_gb("0.5", 0, block, str(tmp_path)) == 0.5
    assert dram_gb("auto", 300 * block, block, str(tmp_path)) == round(300 * block / 1e9, 3)
    free = shutil.disk_usage(tmp_path).free
    assert dram_gb("auto", 4 * free, block, str(tmp_path)) == round(free // 2 / 1e9, 3)
    for text, auto_bytes in (("auto", 0), ("lots", 0)):
        with pytest.raises(KvbatonError):
            dram_gb(text, auto_bytes, block, str(tmp_path))
    monkeypatch.setenv(SECRET_ENV, ClusterSecret.generate().to_hex())
    assert store_main(["--block-bytes", str(block), "--block-tokens", "16", "--kv-store-gb", "auto"]) == 2


def test_a_store_node_process_has_the_dram_and_disk_it_was_given(tmp_path) -> None:  # noqa: ANN001
    """DRAM and disk sized apart (the disk's GB never the DRAM's), a node of auto bytes within this host's /dev/shm."""
    secret, block = ClusterSecret.generate(), 4096
    for dram, expected in ((["--kv-store-gb", "0.001"], capacity_blocks(0.001, block)),
                           (["--kv-store-gb", "auto", "--kv-store-auto-bytes", str(1000 * block)],
                            capacity_blocks(round(1000 * block / 1e9, 3), block))):  # GB to the MB, as auto's are
        process, address = start_store_process(["--block-bytes", str(block), "--block-tokens", "16", *dram,
                                                "--kv-store-disk-gb", f"{tmp_path}/disk:0.01"], secret, "127.0.0.1")
        client = StoreClient(address, secret)
        try:
            assert client.hello()["num_slots"] == expected
        finally:
            client.close()
            stop_store_process(process)


def test_serve_starts_a_store_node_by_default_sized_from_the_workers_pools(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path) -> None:  # noqa: ANN001
    """Every worker host is a store node unless told otherwise: `kvbaton serve` asks for `auto`, twice the workers' KV
    pools within half of /dev/shm's free space; none with --kv-store-gb 0 or with no worker (a joined router)."""
    configs: list[ServeConfig] = []
    monkeypatch.setattr("kvbaton.server.launcher.serve", lambda config: configs.append(config) or 0)
    for extra in ([], ["--kv-store-gb", "auto"], ["--kv-store-gb", "0"]):
        assert main(["serve", "--model", "tiny-random", *extra]) == 0
    assert [config.kv_store_gb for config in configs] == [None, None, 0.0]
    block = 4096
    two = ServeConfig(model="tiny-random", num_workers=2, num_blocks=100, kv_store_gb=None)
    assert auto_store_gb(two, block, str(tmp_path)) == round(2 * 2 * 100 * block / 1e9, 3)
    assert auto_store_gb(replace(two, num_workers=0, num_prefill=1, num_decode=2), block, str(tmp_path)) == \
        round(2 * 3 * 100 * block / 1e9, 3)
    assert auto_store_gb(replace(two, num_workers=0), block, str(tmp_path)) == 0.0
    assert auto_store_gb(two, block, str(tmp_path / "absent")) == 0.0
    free = shutil.disk_usage(tmp_path).free
    assert auto_store_gb(replace(two, num_blocks=free), block, str(tmp_path)) == round(free // 2 / 1e9, 3)


def test_a_plain_serve_has_its_store_node() -> None:
    with serve_process(["--model", "tiny-random", "--workers", "1", "--threads-per-worker", "1"]) as served, \
            httpx.Client() as http:
        store = http.get(f"{served.url}/cluster", timeout=10).json()["kv_store"]
        assert store is not None and store["address"].startswith("tcp://127.0.0.1:")
    with serve_process(["--model", "tiny-random", "--workers", "1", "--threads-per-worker", "1",
                        "--kv-store-gb", "0"]) as served, httpx.Client() as http:
        assert http.get(f"{served.url}/cluster", timeout=10).json()["kv_store"] is None


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
        print(f"measured DRAM load speed: {info['host_bytes_per_s'] / 1e9:.3f} GB/s, round trip "
              f"{info['load_latency_s'] * 1e3:.3f} ms ({info['load_latency']}) after {num_loaded} loads")


def test_a_store_node_whose_starter_died_stops_and_removes_its_shared_memory(tmp_path) -> None:  # noqa: ANN001
    """A launcher killed (SIGKILL) before it could stop its store node: the node sees it gone and leaves too."""
    script = (
        "import os, sys\n"
        "from kvbaton.core.cluster_secret import ClusterSecret\n"
        "from kvbaton.server.store_server import start_process\n"
        "process, address = start_process(['--block-bytes', '64', '--block-tokens', '16', '--kv-store-gb', '0.001'],"
        " ClusterSecret.generate(), '127.0.0.1')\n"
        "print(process.pid, flush=True)\n"
        "os._exit(0)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    pid = int(done.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError("the store node outlived its starter")
        time.sleep(0.05)
    assert not list(Path(SHM_DIRECTORY).glob(f"{SHM_PREFIX}-{pid}-*"))
