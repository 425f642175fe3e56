"""The agents' API and the operator's view on a live cluster: `kvbaton serve` with two tiny-random workers and API
keys. The official `openai` client's Responses calls (multi-turn through `previous_response_id`, the second turn
finding the first's tokens cached; structured output; a forced function call and its output sent back), vLLM's
metric names per worker as prometheus-client parses them, against the list in vLLM's documentation, and the
dashboard rendered by Debian's headless `chromium`, its worker rows checked and a screenshot written to
out/dashboard.png. Without chromium the browser test is skipped locally and fails in CI (env CI, or
KVBATON_REQUIRE_BROWSER as `.ci/run` sets it; `make browser` installs chromium, and `make test` runs it first)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import httpx
import openai
import pydantic
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.serve_helpers import Served, serve_process

MODEL = "tiny-random"
ADMIN_KEY = "sk-e2e-admin-0123456789"
USER_KEY = "sk-e2e-user-9876543210"
OUT = Path(__file__).resolve().parents[2] / "out"

# docs.vllm.ai "Production Metrics" (v1 engine): name -> type; every series carries model_name and engine.
VLLM_DOCUMENTED = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps([{"key": ADMIN_KEY, "tenant": "ops", "role": "admin"},
                                {"key": USER_KEY, "tenant": "acme", "role": "user"}]))
    with serve_process(["--model", MODEL, "--workers", "2", "--num-blocks", "256", "--drain-timeout", "5",
                        "--threads-per-worker", "1", "--api-key-file", str(keys)], 180.0) as server:
        yield server


@pytest.fixture(scope="module")
def client(served: Served) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=served.url + "/v1", api_key=USER_KEY, max_retries=0, timeout=120) as oa:
        yield oa


def _admin(served: Served, path: str) -> httpx.Response:
    return httpx.get(served.url + path, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)


def test_a_second_turn_finds_the_first_turns_tokens_cached(client: openai.OpenAI, served: Served) -> None:
    block_size = _admin(served, "/cluster").json()["identity"]["block_size"]
    instructions = "You are a careful assistant. Answer in one short sentence. " * 2
    first = client.responses.create(model=MODEL, instructions=instructions, max_output_tokens=8, temperature=0,
                                    input="The quick brown fox jumps over the lazy dog. What did the fox do?")
    second = client.responses.create(model=MODEL, instructions=instructions, max_output_tokens=8, temperature=0,
                                     previous_response_id=first.id, input="And what did the dog do?")
    third = client.responses.create(model=MODEL, instructions=instructions, max_output_tokens=8, temperature=0,
                                    previous_response_id=second.id, input="Who was faster?")
    assert first.usage.input_tokens // block_size >= 2
    cached = [r.usage.input_tokens_details.cached_tokens for r in (first, second, third)]
    # Placed where the previous turn's KV is (its prompt is that turn's ids and more): all of its whole blocks hit.
    assert cached[1] >= first.usage.input_tokens // block_size * block_size
    assert cached[2] >= second.usage.input_tokens // block_size * block_size > cached[1]
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


class Order(pydantic.BaseModel):
    paid: bool
    quantity: int = pydantic.Field(ge=1, le=9)
    size: Literal["small", "large"]


def test_structured_output_and_a_function_call_round_trip(client: openai.OpenAI) -> None:
    parsed = client.responses.parse(model=MODEL, input="One order, please.", text_format=Order,
                                    max_output_tokens=48)
    assert isinstance(parsed.output_parsed, Order) and parsed.status == "completed"
    weather = {"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"enum": ["Paris", "Oslo"]}}}}
    first = client.responses.create(model=MODEL, input="Weather in Oslo?", tools=[weather], max_output_tokens=32,
                                    tool_choice={"type": "function", "name": "get_weather"})
    (call,) = first.output
    assert call.type == "function_call" and json.loads(call.arguments)["city"] in ("Paris", "Oslo")
    # No tool-call parser on this server: the answer to the call's output is text (tool_choice "none").
    second = client.responses.create(model=MODEL, tools=[weather], tool_choice="none", previous_response_id=first.id,
                                     max_output_tokens=8,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "sunny"}])
    assert second.status in ("completed", "incomplete") and second.output[0].type == "message"
    assert second.usage.input_tokens_details.cached_tokens > 0


def test_vllms_metric_names_types_and_labels_per_worker(client: openai.OpenAI, served: Served) -> None:
    for _ in range(2):  # the same prompt twice: the second hits the prefix cache
        client.completions.create(model=MODEL, prompt="Metrics " * 40, max_tokens=4)
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(served.url + "/metrics").text)}
    workers = sorted(w["worker_id"] for w in _admin(served, "/cluster").json()["workers"])
    assert len(workers) == 2
    for name, kind in VLLM_DOCUMENTED.items():
        family = families[name]
        assert family.type == kind, (name, family.type)
        assert family.samples, name
        for sample in family.samples:
            assert sample.labels["model_name"] == MODEL and sample.labels["engine"] in workers, sample
        if kind == "histogram":
            assert name.endswith("_seconds")
            assert {s.name for s in family.samples} >= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        if kind == "counter":
            assert all(s.name in (f"{name}_total", f"{name}_created") for s in family.samples), name
    gauges = {(s.name, s.labels["engine"]) for s in families["vllm:num_requests_running"].samples}
    assert gauges == {("vllm:num_requests_running", w) for w in workers}  # one series per worker
    hits = sum(s.value for s in families["vllm:prefix_cache_hits"].samples if s.name.endswith("_total"))
    assert hits > 0 and all(0 <= s.value <= 1 for s in families["vllm:kv_cache_usage_perc"].samples)
    assert {s.labels["finished_reason"] for s in families["vllm:request_success"].samples} >= {"length"}
    # Every other family is kvbaton's own, under its prefix (the text parser reads prometheus-client's `_created`
    # timestamps of the documented ones as families of their own).
    assert [name for name in families if name not in VLLM_DOCUMENTED and not name.startswith("kvbaton:")
            and name.removesuffix("_created") not in VLLM_DOCUMENTED] == []


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        message = "Debian's chromium is not installed (make browser installs it)"
        if os.environ.get("CI") or os.environ.get("KVBATON_REQUIRE_BROWSER"):
            pytest.fail(message)
        pytest.skip(message)
    return found


def _render(chromium: str, url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                               "--no-first-run", f"--user-data-dir={profile}", "--virtual-time-budget=6000",
                               "--window-size=1400,520", *extra, url],
                              capture_output=True, text=True, timeout=180, check=False)


def test_the_dashboard_renders_every_worker_in_chromium(client: openai.OpenAI, served: Served) -> None:
    chromium = _chromium()
    client.completions.create(model=MODEL, prompt="Dashboard traffic", max_tokens=4)
    workers = sorted(w["worker_id"] for w in _admin(served, "/cluster").json()["workers"])
    url = f"{served.url}/dashboard#key={ADMIN_KEY}"  # the fragment never reaches the server
    dom = _render(chromium, url, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    rows = re.findall(r'<tr data-worker-id="([^"]+)">(.*?)</tr>', dom.stdout, re.DOTALL)
    assert sorted(worker for worker, _ in rows) == workers, dom.stdout[-3000:]
    assert all("<td>mixed</td>" in cells or 'class="text">mixed<' in cells for _, cells in rows)
    assert 'id="status" class="muted">updated' in dom.stdout
    OUT.mkdir(exist_ok=True)
    screenshot = OUT / "dashboard.png"
    screenshot.unlink(missing_ok=True)
    shot = _render(chromium, url, f"--screenshot={screenshot}")
    assert shot.returncode == 0 and screenshot.stat().st_size > 10_000, shot.stderr[-2000:]
    # Without the key, the page says how to give one instead of showing data.
    keyless = _render(chromium, f"{served.url}/dashboard", "--dump-dom")
    assert "HTTP 401 (open /dashboard#key=ADMIN_KEY)" in keyless.stdout and "data-worker-id" not in keyless.stdout


def test_without_chromium_ci_fails_rather_than_skips(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("KVBATON_REQUIRE_BROWSER", "1")
    with pytest.raises(pytest.fail.Exception, match="make browser"):
        _chromium()
    monkeypatch.delenv("KVBATON_REQUIRE_BROWSER")
    with pytest.raises(pytest.skip.Exception):
        _chromium()
