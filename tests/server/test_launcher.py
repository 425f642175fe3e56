"""`kvbaton serve` end to end on tiny-random: the official openai client, a prefix hit, draining on SIGTERM,
and no process left behind. One server start for the whole module (about 10-30 s on a loaded 2-core machine).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import openai
import pytest

from tests.server.serve_helpers import Served, serve_process

STARTUP_TIMEOUT_S = 120.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serve_process(["--model", "tiny-random", "--workers", "2", "--policy", "preble", "--num-blocks", "256",
                        "--drain-timeout", "20"], STARTUP_TIMEOUT_S, stderr=subprocess.PIPE) as server:
        yield server


def _get(url: str) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_ready_and_cluster_describe_both_workers(served: Served) -> None:
    status, _ = _get(served.url + "/ready")
    assert status == 200
    status, info = _get(served.url + "/cluster")
    assert status == 200 and info["policy"] == "preble" and info["worker_queue_policy"] == "preble"
    assert sorted(w["pid"] for w in info["workers"]) == sorted(served.worker_pids)  # type: ignore[union-attr, index]


def test_openai_client_completions_chat_and_prefix_hit(served: Served) -> None:
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    prompt = "A long shared system prompt that both requests start with. " * 4
    first = client.completions.create(model="tiny-random", prompt=prompt, max_tokens=5, temperature=0)
    assert first.choices[0].finish_reason in ("length", "stop")
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    time.sleep(0.3)  # KV events reach the router, so preble exploits the cached prefix
    second = client.completions.create(model="tiny-random", prompt=prompt + "Then more.", max_tokens=5,
                                       temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens > 0  # type: ignore[union-attr]
    batch = client.completions.create(model="tiny-random", prompt=[prompt, "Another prompt"], max_tokens=5,
                                      temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == first.choices[0].text  # greedy: a batch answers each prompt as alone
    chunks = list(client.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, temperature=0, stream=True))
    assert chunks[-1].choices[-1].finish_reason in ("length", "stop") if chunks[-1].choices else True


def test_sigterm_drains_the_open_stream_then_stops_every_process(served: Served) -> None:
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    stream = client.completions.create(model="tiny-random", prompt="drain me", max_tokens=30, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    served.process.send_signal(signal.SIGTERM)
    rest = list(stream)
    finish = [c.choices[0].finish_reason for c in [first, *rest] if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]  # the in-flight request ran to completion during the drain
    assert served.process.wait(60) == 0
    assert served.process.stdout.read().strip().endswith("kvbaton: stopped")  # type: ignore[union-attr]
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in served.worker_pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in served.worker_pids if _alive(pid)] == []


def test_late_reservation_reaches_the_prefill_workers_command_line() -> None:
    from kvbaton.server.launcher import ServeConfig, worker_command

    late = ServeConfig(num_workers=0, num_prefill=1, num_decode=1, reserve_ahead_tokens=512)
    command = worker_command(late, "tcp://127.0.0.1:1", "p0", "prefill")
    assert command[command.index("--reserve-ahead-tokens") + 1] == "512"
    assert "--reserve-ahead-tokens" not in worker_command(ServeConfig(), "tcp://127.0.0.1:1", "w0")


def test_the_startup_heap_is_frozen_out_of_the_collectors_reach() -> None:
    # In a fresh interpreter, so this test process's collector is left as it was.
    code = ("import gc; from kvbaton.server.launcher import freeze_startup_heap; "
            "before = gc.get_freeze_count(); freeze_startup_heap(); print(before, gc.get_freeze_count())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    before, after = map(int, done.stdout.split())
    assert before == 0 and after > 10_000  # the imported router stack alone is tens of thousands of objects
