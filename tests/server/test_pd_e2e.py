"""Must-show 1 end to end: `kvbaton serve --prefill 1 --decode 1` answers exactly like `kvbaton generate`.

Real processes (router, one prefill and one decode worker, KV over shared memory), the OpenAI API,
greedy decoding; prompts include two that share a long prefix, so the second hits the prefill
worker's prefix cache and still hands the whole prompt over. tiny-random runs in the fast suite
(~20 s: one server start plus `kvbaton generate` runs); SmolLM2 is marked `smollm2`.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.server.serve_helpers import generate_text, serve_process, wait_pd_idle

SYSTEM = "You are a careful assistant. Answer every question in one short, precise sentence. " * 3
PROMPTS = ["The quick brown fox jumps over the lazy dog. Then", SYSTEM + "Question: what is a fox?",
           SYSTEM + "Question: where do dogs sleep?", "Hi"]


@pytest.fixture
def served_pd(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    model = request.param
    with serve_process(["--model", model, "--prefill", "1", "--decode", "1", "--num-blocks", "256",
                        "--drain-timeout", "5", "--local-prefill-threshold", "0"], startup_timeout_s=300.0) as server:
        assert "with 0 mixed + 1 prefill + 1 decode" in server.banner, server.banner
        yield model, server.url


def _check(model: str, url: str, max_tokens: int) -> None:
    with httpx.Client(timeout=300) as http:
        for prompt in PROMPTS:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            got = http.post(url + "/v1/completions", json=body).json()
            assert got["choices"][0]["text"] == generate_text(model, prompt, max_tokens), prompt
        # min_tokens = max_tokens, as `kvbaton bench` sends every request: the prefill leg's one-token sampling once
        # refused it and the prefill worker died (test_regressions_handoff.py has the engine-level test).
        body = {"model": model, "prompt": PROMPTS[1], "max_tokens": max_tokens, "min_tokens": max_tokens,
                "temperature": 0}
        got = http.post(url + "/v1/completions", json=body).json()
        assert got["usage"]["completion_tokens"] == max_tokens, got
        deadline_s = time.monotonic() + 10.0
        info, workers = wait_pd_idle(http, url)
        while info["transfers"]["num_completed"] < 2 * (len(PROMPTS) + 1) and time.monotonic() < deadline_s:
            time.sleep(0.1)  # the counters come with the workers' next heartbeats
            info, workers = wait_pd_idle(http, url)
        assert workers["p0"]["role"] == "prefill" and workers["d0"]["role"] == "decode"
        assert workers["p0"]["prefix_cache_hits_tokens"] >= 32  # the third prompt reused the second's system prompt
        assert info["router_decisions"] == {"pair": len(PROMPTS) + 1}
        assert info["transfers"]["num_completed"] == 2 * (len(PROMPTS) + 1)
        assert info["transfers"]["num_recomputed"] == 0
        metrics = http.get(url + "/metrics").text
        assert re.search(r"^kvbaton:kv_transfer_bytes [1-9]", metrics, re.MULTILINE)


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0,
                                                                             "maximum": 150}}}


def _check_structured(model: str, url: str) -> dict[str, object]:
    """A JSON-schema chat request through the handoff (stream and not): the prefill worker's grammar picks the
    first token, the decode worker's goes on from it; the JSON parses and fits, and every block comes back."""
    body = {"model": model, "max_tokens": 64, "temperature": 0,
            "messages": [{"role": "user", "content": "Describe Ann, who is 31 years old, as JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}}
    with httpx.Client(timeout=300) as http:
        got = http.post(url + "/v1/chat/completions", json=body).json()
        with http.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        wait_pd_idle(http, url)
    text = got["choices"][0]["message"]["content"]
    assert got["choices"][0]["finish_reason"] == "stop", got
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == text
    person = json.loads(text)
    assert set(person) == {"name", "age"} and isinstance(person["name"], str) and 0 <= person["age"] <= 150
    return person


def _check_tool_call(model: str, url: str) -> dict[str, object]:
    """A forced tool call through the handoff: its arguments parse and fit the function's parameters."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 30}}}}}
    body = {"model": model, "max_tokens": 64, "temperature": 0, "tools": [weather],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}]}
    with httpx.Client(timeout=300) as http:
        got = http.post(url + "/v1/chat/completions", json=body).json()
        wait_pd_idle(http, url)
    (call,) = got["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and got["choices"][0]["finish_reason"] == "stop"
    arguments = json.loads(call["function"]["arguments"])
    assert set(arguments) == {"city"}
    return arguments


def _check_prompt_logprobs(model: str, url: str) -> None:
    """Echo with logprobs on a prefill/decode cluster: the call stays on one worker (only its prefill sees every
    prompt position) and the answer lists the prompt's logprobs."""
    body = {"model": model, "prompt": PROMPTS[1], "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}
    with httpx.Client(timeout=300) as http:
        decisions = http.get(url + "/cluster").json()["router_decisions"]
        got = http.post(url + "/v1/completions", json=body).json()
        info, _ = wait_pd_idle(http, url)
    logprobs = got["choices"][0]["logprobs"]
    num_prompt = got["usage"]["prompt_tokens"]
    assert len(logprobs["tokens"]) == num_prompt + 1 and logprobs["token_logprobs"][0] is None
    assert all(lp <= 0 for lp in logprobs["token_logprobs"][1:])
    assert info["router_decisions"].get("local_prefill", 0) == decisions.get("local_prefill", 0) + 1


@pytest.mark.parametrize("served_pd", ["tiny-random"], indirect=True)
def test_1p1d_serve_equals_generate_tiny(served_pd: tuple[str, str]) -> None:
    _check(*served_pd, max_tokens=12)
    _check_structured(*served_pd)
    _check_tool_call(*served_pd)
    _check_prompt_logprobs(*served_pd)


@pytest.mark.smollm2
@pytest.mark.parametrize("served_pd", ["smollm2-135m"], indirect=True)
def test_1p1d_serve_equals_generate_smollm2(served_pd: tuple[str, str]) -> None:
    _check(*served_pd, max_tokens=24)
    assert _check_structured(*served_pd) == {"name": "Ann", "age": 31}  # the real model reads the question
    assert _check_tool_call(*served_pd) == {"city": "Paris"}
    _check_prompt_logprobs(*served_pd)


@pytest.mark.parametrize("flags, message", [
    (["--prefill", "1"], "--prefill needs at least one --decode worker"),
    (["--workers", "0"], "give at least one worker"),
])
def test_serve_rejects_pools_that_cannot_serve(flags: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "kvbaton.cli", "serve", "--model", "tiny-random", *flags],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr
