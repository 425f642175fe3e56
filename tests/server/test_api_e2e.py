"""The HTTP layer end to end: the official openai client against `kvbaton serve --model tiny-random --workers 2
--speculative-tokens 3 --tool-call-parser hermes --scheduling-policy priority` (and its KV store node, on by default) in a subprocess (killed by pid at the end). Slow-ish: one server start plus two `kvbaton generate` runs,
about 30-60 s on a loaded 2-core machine.

Checks: greedy output through the server equals `kvbaton generate`'s (completion and chat); a second request
sharing a long prefix reports cached_tokens > 0; bad inputs and a client disconnect mid-stream leave every
worker's block accounting at its idle baseline (only the prefix cache holds blocks, invariants pass).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Literal

import httpx
import openai
import pydantic
import pytest

from tests.server.serve_helpers import Served, serve_process

MODEL = "tiny-random"
STARTUP_TIMEOUT_S = 180.0
PROMPT = "The quick brown fox jumps over the lazy dog. Then"


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    # Workers speculate (prompt lookup, 3 drafts): greedy answers must still equal `kvbaton generate`'s.
    with serve_process(["--model", MODEL, "--workers", "2", "--num-blocks", "256", "--drain-timeout", "5",
                        "--speculative-tokens", "3", "--tool-call-parser", "hermes", "--scheduling-policy", "priority"],
                       STARTUP_TIMEOUT_S) as server:
        yield server


@pytest.fixture(scope="module")
def client(served: Served) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120) as oa:
        yield oa


def _generate(*args: str) -> dict[str, object]:
    command = [sys.executable, "-m", "kvbaton.cli", "generate", "--model", MODEL, "--json", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, check=True)
    return json.loads(done.stdout)


def _wait_idle_baseline(url: str, timeout_s: float = 20.0, num_workers: int = 2) -> list[dict[str, object]]:
    """Polls /cluster until every worker is idle with only cached blocks in use; returns the workers."""
    deadline = time.monotonic() + timeout_s
    info: dict[str, object] = {}
    while time.monotonic() < deadline:
        info = httpx.get(url + "/cluster", timeout=10).json()
        workers = info["workers"]
        if info["num_in_flight"] == 0 and len(workers) == num_workers and all(
            w.get("num_running") == 0 and w.get("num_waiting") == 0 and w.get("invariant_error") == ""
            and w.get("num_used_blocks") == w.get("num_cached_blocks") for w in workers
        ):
            return workers
        time.sleep(0.1)
    raise AssertionError(f"workers did not return to the idle baseline: {info}")


def test_greedy_output_equals_kvbaton_generate(client: openai.OpenAI) -> None:
    expected = _generate("--prompt", PROMPT, "--max-tokens", "24")
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert resp.choices[0].text == expected["text"]
    assert resp.usage.prompt_tokens == len(expected["prompt_token_ids"])
    assert resp.usage.completion_tokens == len(expected["token_ids"])
    expected_chat = _generate("--chat", "--prompt", "Hi there!", "--max-tokens", "16")
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi there!"}],
                                          max_tokens=16, temperature=0)
    assert chat.choices[0].message.content == expected_chat["text"]
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi there!"}],
                                            max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected_chat["text"]


def test_speculating_workers_report_their_drafts(client: openai.OpenAI, served: Served) -> None:
    # Drafts come from n-grams of the prompt and the output that recur. The random model's greedy output falls
    # into repeated tokens within 48 (16 were too few: run first, on a fresh server, it drafted nothing).
    prompt = "one two three four five six " * 8
    expected = _generate("--prompt", prompt, "--max-tokens", "48")
    assert client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0).choices[0].text == (
        expected["text"])
    # /cluster shows each worker's last heartbeat, which may predate this request (on a fresh server, the idle
    # baseline holds before the request's step is reported): wait for the drafts to show.
    deadline = time.monotonic() + 20.0
    workers = _wait_idle_baseline(served.url)
    while sum(w["spec_decode"]["num_draft_tokens"] for w in workers) == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
        workers = _wait_idle_baseline(served.url)
    assert sum(w["spec_decode"]["num_draft_tokens"] for w in workers) > 0
    assert all(0 <= w["spec_decode"]["num_accepted_tokens"] <= w["spec_decode"]["num_draft_tokens"] for w in workers)
    metrics = httpx.get(served.url + "/metrics", timeout=10).text
    drafts = sum(w["spec_decode"]["num_draft_tokens"] for w in workers)
    assert f"kvbaton:spec_decode_num_draft_tokens_total {float(drafts)}" in metrics


def test_shared_prefix_reports_cached_tokens(client: openai.OpenAI) -> None:
    system = "You are a meticulous assistant who answers in one short sentence. " * 4
    first = client.completions.create(model=MODEL, prompt=system + "What is 2+2?", max_tokens=4, temperature=0)
    second = client.completions.create(model=MODEL, prompt=system + "Name a colour.", max_tokens=4,
                                       temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= len(system) // 16 * 16 - 16


class Order(pydantic.BaseModel):
    paid: bool
    quantity: int = pydantic.Field(ge=1, le=9)
    size: Literal["small", "large"]


def test_priority_scheduling_takes_the_priority_field(client: openai.OpenAI, served: Served) -> None:
    info = httpx.get(served.url + "/cluster", timeout=10).json()
    assert info["worker_queue_policy"] == "priority"
    expected = _generate("--prompt", PROMPT, "--max-tokens", "8")
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"priority": -2})
    assert resp.choices[0].text == expected["text"]


def test_the_store_brings_an_evicted_prefix_back() -> None:
    """One worker with a 256-block pool and its host's KV store node, given room for every prompt (`auto`'s twice the
    pool holds four; its own server: over two workers, how preble spread the prompts decided whether the first one's
    worker evicted it at all): eight ~2,000-token prompts of distinct words push the first out of the pool; sent
    again, it is loaded from the store (cached tokens, blocks loaded) with the same answer."""
    args = ["--model", MODEL, "--workers", "1", "--num-blocks", "256", "--kv-store-gb", "0.05", "--drain-timeout", "5"]
    with serve_process(args, STARTUP_TIMEOUT_S) as served, openai.OpenAI(
            base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        prompts = [" ".join(f"w{group}x{i}" for i in range(300)) for group in range(8)]
        first = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=8, temperature=0)
        for prompt in prompts[1:]:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        again = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=8, temperature=0)
        assert first.usage.prompt_tokens > 1024  # the pool keeps under two such prompts
        assert again.choices[0].text == first.choices[0].text
        assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 32
        workers = _wait_idle_baseline(served.url, num_workers=1)
        loaded = sum(w["kv_store"]["num_loaded_blocks"] for w in workers)
        assert loaded > 0 and sum(w["kv_store"]["num_saved_blocks"] for w in workers) >= loaded
        metrics = httpx.get(served.url + "/metrics", timeout=10).text
        assert f"kvbaton:kv_store_num_loaded_blocks {float(loaded)}" in metrics


def test_openai_clients_structured_parse_gets_a_valid_object(client: openai.OpenAI, served: Served) -> None:
    # The client sends the pydantic model as a strict JSON schema (response_format json_schema) and parses the
    # answer into it: the grammar makes tiny-random's output fit, sampled or greedy.
    for temperature in (0.0, 1.0):
        parsed = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "One order."}],
                                               response_format=Order, max_tokens=48, temperature=temperature)
        choice = parsed.choices[0]
        assert isinstance(choice.message.parsed, Order) and choice.finish_reason == "stop"
    regex = client.completions.create(model=MODEL, prompt="Code:", max_tokens=16, temperature=1.0,
                                      extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}})
    assert re.fullmatch("[A-Z]{3}-[0-9]{2}", regex.choices[0].text)
    _wait_idle_baseline(served.url)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1,
                                                                                 "maximum": 7}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}


def _check_weather(arguments: str) -> None:
    args = json.loads(arguments)
    assert args["city"] in ("Paris", "Oslo") and 1 <= args["days"] <= 7


def test_forced_tool_calls_through_the_openai_client(client: openai.OpenAI, served: Served) -> None:
    messages = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for temperature in (0.0, 1.0):
        resp = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice=named,
                                              max_tokens=48, temperature=temperature)
        choice = resp.choices[0]
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("call_") and choice.message.content is None
        _check_weather(call.function.arguments)
        assert choice.finish_reason == "stop"  # as OpenAI answers a forced call
    # Streamed, the client's deltas add up to one call.
    stream = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice=named,
                                            max_tokens=48, temperature=0, stream=True)
    name, arguments, ids = "", "", set()
    for chunk in stream:
        for delta_call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            name += delta_call.function.name or ""
            arguments += delta_call.function.arguments or ""
            ids.add(delta_call.id) if delta_call.id else None
    assert name == "get_weather" and len(ids) == 1
    _check_weather(arguments)
    # "required": one or more calls of the given tools (one when parallel calls are off).
    for parallel in (True, False):
        resp = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME],
                                              tool_choice="required", parallel_tool_calls=parallel, max_tokens=96,
                                              temperature=1.0, seed=5)
        calls = resp.choices[0].message.tool_calls
        assert resp.choices[0].finish_reason == "tool_calls" and calls and (parallel or len(calls) == 1)
        for call in calls:
            assert call.function.name in ("get_weather", "get_time")
            if call.function.name == "get_weather":
                _check_weather(call.function.arguments)
            else:
                assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    # A conversation that carries the call and its result goes on as a chat.
    history = [*messages, {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    follow = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                            max_tokens=8, temperature=0)
    assert follow.choices[0].message.tool_calls is None and follow.usage.completion_tokens == 8
    # "auto" (the default with tools) reads the model's own <tool_call> blocks (--tool-call-parser hermes):
    # tiny-random writes none, so its answer is content.
    auto = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=8,
                                          temperature=0)
    assert auto.choices[0].message.tool_calls is None and auto.choices[0].finish_reason == "length"
    _wait_idle_baseline(served.url)


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(client: openai.OpenAI, served: Served) -> None:
    # lm-evaluation-harness's loglikelihood request (max_tokens 1, echo, logprobs 1) through the cluster: the
    # prompt's logprobs equal the in-process engine's, though the first request already cached the prompt.
    from kvbaton import LLM, SamplingParams

    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0)
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=1)
    logprobs = resp.choices[0].logprobs
    expected = LLM(MODEL, num_blocks=64).generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    num_prompt = len(expected.prompt_token_ids)
    assert len(logprobs.tokens) == num_prompt + 1 and logprobs.token_logprobs[0] is None
    assert logprobs.token_logprobs[1:num_prompt] == pytest.approx(
        [entry.logprob for entry in expected.prompt_logprobs[1:]], abs=1e-4)
    assert resp.choices[0].text.startswith(PROMPT) and resp.usage.prompt_tokens_details.cached_tokens == 0
    _wait_idle_baseline(served.url)


def test_prompt_logprobs_through_the_cluster_equal_the_engines(served: Served) -> None:
    # vLLM's prompt_logprobs over the worker RPC: each prompt token's logprob, rank and top alternatives equal the
    # in-process engine's.
    from kvbaton import LLM, SamplingParams

    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}
    scored = httpx.post(served.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["prompt_logprobs"]
    expected = LLM(MODEL, num_blocks=64).generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    assert scored[0] is None and len(scored) == len(expected.prompt_token_ids)
    for got, entry in zip(scored[1:], expected.prompt_logprobs[1:]):
        own = got[str(entry.token_id)]
        assert own["rank"] == entry.rank >= 1 and own["logprob"] == pytest.approx(entry.logprob, abs=1e-4)
        assert {int(t) for t in got} == {entry.token_id, *(t for t, _ in entry.top_logprobs)}
    assert any(entry.rank > 1 for entry in expected.prompt_logprobs[1:])
    _wait_idle_baseline(served.url)


def test_reset_prefix_cache_empties_every_workers_cache_its_store_node_and_the_router_index(client: openai.OpenAI,
                                                                            served: Served) -> None:
    # vLLM's POST /reset_prefix_cache: every worker drops its cached blocks and empties its store node, and the
    # router's index and store directory follow their events, so the same prompt again finds nothing cached.
    prompt = PROMPT + " reset " * 12
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert client.completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                     temperature=0).usage.prompt_tokens_details.cached_tokens > 0
    _wait_idle_baseline(served.url)
    reset = httpx.post(served.url + "/reset_prefix_cache", timeout=10)
    assert reset.status_code == 200 and sorted(reset.json()["workers"]) == sorted(
        w["worker_id"] for w in httpx.get(served.url + "/cluster", timeout=10).json()["workers"])
    deadline = time.monotonic() + 20.0
    while True:
        info = httpx.get(served.url + "/cluster", timeout=10).json()
        workers = info["workers"]
        emptied = all(w["num_cached_blocks"] == 0 and w["num_used_blocks"] == 0 and w["indexed_blocks"] == 0
                      for w in workers) and info["kv_store"]["num_blocks"] == 0
        if emptied:
            break
        assert time.monotonic() < deadline, workers
        time.sleep(0.1)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    _wait_idle_baseline(served.url)


def test_bad_inputs_and_disconnect_leave_block_accounting_at_baseline(served: Served) -> None:
    _wait_idle_baseline(served.url)
    bad_bodies = [
        b"{not json", b'{"prompt": "hi", "max_tokens": "ten"}', b'{"prompt": "hi", "temperature": -1}',
        b'{"prompt": ""}', b'{"prompt": "hi", "max_tokens": 5000}', b'{"model": "gpt-9", "prompt": "hi"}',
    ]
    for raw in bad_bodies:
        r = httpx.post(served.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code in (400, 404) and set(r.json()["error"]) == {"message", "type", "param", "code"}
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, "stream": True, "n": 2}
    started_at = time.monotonic()
    with httpx.Client(timeout=60) as http, http.stream("POST", served.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert any(next(lines).startswith("data: {") for _ in range(6))
    _wait_idle_baseline(served.url)
    metrics = httpx.get(served.url + "/metrics", timeout=10).text
    assert 'kvbaton:request_success_total{finished_reason="abort"} 2.0' in metrics
    assert time.monotonic() - started_at < 60  # aborted, not run to 1,500 tokens
