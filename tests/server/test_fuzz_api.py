"""Schemathesis against the real server: `kvbaton serve` with a prefill and a decode tiny-random worker, API keys
on, every operation of the document it serves (/openapi.json) fuzzed with bodies valid by that document and with
bodies that break it. No answer may be a 5xx, every 4xx must be OpenAI's error shape (and every answer what
the document says), and afterwards the server still serves, with no request in flight and no block held
beyond the prefix cache. The same server's worker processes hold the cluster secret in their environment,
never on their command line, and not the router's API keys.

Bounded CI time: a fixed number of examples per operation and mode, derandomized (a fixed seed per test), and
each generated body's sampling counts clamped (n, best_of <= 2; max_tokens and friends <= 8, and 8 for a chat
that gives none, which would run to the end of the context; a batch <= 4 prompts) when they are in range, so a
valid body costs milliseconds of tiny-random; an out-of-range value (the negative cases) is sent as generated.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from kvbaton.core.cluster_secret import API_KEY_ENV, SECRET_ENV
from tests.server.serve_helpers import Served, serve_process, wait_pd_idle

ADMIN_KEY = "sk-fuzz-admin-0123456789"
USER_KEY = "sk-fuzz-user-9876543210"
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
MAX_EXAMPLES = 20  # per operation with a body and generation mode (5 for the others)
WITH_BODIES = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/v1/responses"),
               ("POST", "/tokenize"), ("POST", "/detokenize")]
BY_ID = [("GET", "/v1/responses/{response_id}"), ("DELETE", "/v1/responses/{response_id}")]  # random ids: 404s
WITHOUT = [("GET", "/v1/models"), ("POST", "/reset_prefix_cache"), ("GET", "/cluster"), ("GET", "/health"),
           ("GET", "/ready"), ("GET", "/metrics"), ("GET", "/dashboard"), ("GET", "/dashboard/data"), *BY_ID]
OPERATIONS = WITH_BODIES + WITHOUT
# (method, path, mode): an operation without a body or parameters has nothing to break, so only valid requests.
FUZZED = [(m, p, GenerationMode.POSITIVE) for m, p in OPERATIONS] + [(m, p, GenerationMode.NEGATIVE)
                                                                    for m, p in WITH_BODIES]
_CLAMPS = {"n": 2, "best_of": 2, "max_tokens": 8, "max_completion_tokens": 8, "max_output_tokens": 8, "min_tokens": 8,
           "top_logprobs": 5, "logprobs": 5, "prompt_logprobs": 5}
_MAX_BATCH = 4


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps([{"key": ADMIN_KEY, "tenant": "ops", "role": "admin"},
                                {"key": USER_KEY, "tenant": "acme", "role": "user"}]))
    with serve_process(["--model", "tiny-random", "--prefill", "1", "--decode", "1", "--num-blocks", "64",
                        "--max-num-waiting", "64", "--threads-per-worker", "1", "--drain-timeout", "5",
                        "--api-key-file", str(keys)], 180.0) as server:
        yield server


@pytest.fixture(scope="module")
def api_schema(served: Served) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{served.url}/openapi.json")


def clamp(body: Any) -> Any:
    """A generated body with its in-range sampling counts lowered to what tiny-random answers in milliseconds."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for name, most in _CLAMPS.items():
        value = body.get(name)
        if type(value) is int and 1 <= value:
            body[name] = min(value, most)
    if "messages" in body and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = _CLAMPS["max_tokens"]  # a chat without one may run to the end of the context
    if "input" in body and body.get("max_output_tokens") is None:
        body["max_output_tokens"] = _CLAMPS["max_output_tokens"]  # so may a response
    for limit in ("max_tokens", "max_output_tokens"):
        if type(body.get("min_tokens")) is int and type(body.get(limit)) is int:
            body["min_tokens"] = min(body["min_tokens"], body[limit])
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (list, str)) for p in prompt):
        body["prompt"] = prompt[:_MAX_BATCH]
    return body


def openai_error_shape(ctx: object, response: schemathesis.Response, case: schemathesis.Case) -> bool | None:
    """Every 4xx is OpenAI's {"error": {message, type, param, code}}."""
    if 400 <= response.status_code < 500:
        error = json.loads(response.content)["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), error
    return None


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          openai_error_shape]


@pytest.mark.parametrize(("method", "path", "mode"), FUZZED, ids=[f"{m} {p} {g.value}" for m, p, g in FUZZED])
def test_fuzzed_requests_get_no_5xx_and_openai_shaped_4xx(served: Served, api_schema: schemathesis.BaseSchema,
                                                          method: str, path: str, mode: GenerationMode) -> None:
    operation = api_schema[path][method]
    statuses: dict[int, int] = {}

    @settings(max_examples=MAX_EXAMPLES if (method, path) in WITH_BODIES else 5, derandomize=True, deadline=None,
              database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case: schemathesis.Case) -> None:
        case.body = clamp(case.body)
        response = case.call(base_url=served.url, headers=AUTH, timeout=60)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        case.validate_response(response, checks=CHECKS)

    fuzz()
    if mode is GenerationMode.NEGATIVE:  # broken bodies were refused, not answered
        assert any(400 <= status < 500 for status in statuses), statuses
    elif (method, path) in BY_ID:  # no response was stored under a generated id
        assert set(statuses) == {404}, statuses
    else:
        assert statuses.get(200), statuses


def test_the_served_document_lists_the_fuzzed_operations(api_schema: schemathesis.BaseSchema) -> None:
    served_operations = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert served_operations == set(OPERATIONS)


# Valid bodies that once killed the worker drawing their first token (a NaN distribution), then the worker the call
# migrated to: the first a CI run's fuzz found (its examples are not this machine's), the second the sampler's
# search over every accepted range (tests/engine/test_sampler_ranges.py).
FOUND = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\u00ae4\u00ec9"}], "top_p": 5e-324,
                              "temperature": 1.0, "max_tokens": 8}),
    # token 5 is in the prompt and banned until min_tokens: its -inf logit times a penalty float32 holds as 0
    ("/v1/completions", {"prompt": [5, 6, 7], "stop_token_ids": [5], "min_tokens": 4, "repetition_penalty": 5e-324,
                         "max_tokens": 8}),
]


@pytest.mark.parametrize(("path", "body"), FOUND, ids=[path for path, _ in FOUND])
def test_bodies_a_fuzz_run_found_are_answered(served: Served, path: str, body: dict[str, Any]) -> None:
    with httpx.Client(timeout=60, headers=AUTH) as http:
        answer = http.post(f"{served.url}{path}", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["finish_reason"] in ("stop", "length")
        assert http.get(f"{served.url}/ready").status_code == 200


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 4}),
    ("/v1/completions", {"prompt": "hi", "stream": True, "max_tokens": 4}),
    ("/v1/responses", {"input": "hi", "stream": True, "max_output_tokens": 4}),
], ids=["chat", "completions", "responses"])
def test_a_streamed_answer_is_what_the_document_says(served: Served, api_schema: schemathesis.BaseSchema, path: str,
                                                    body: dict[str, Any]) -> None:
    # Each server-sent event against the stream's event schema (a fuzz run once found the document said a string)
    case = api_schema[path]["POST"].Case(body=body)
    response = case.call(base_url=served.url, headers=AUTH, timeout=60)
    assert response.status_code == 200 and response.content.startswith((b"data: ", b"event: ")), response.content[:200]
    case.validate_response(response, checks=CHECKS)


def test_the_server_still_serves_after_the_fuzz_with_nothing_held(served: Served) -> None:
    # Module order: the fuzz above ran first (pytest keeps file order).
    with httpx.Client(timeout=60, headers=AUTH) as http:
        assert http.get(f"{served.url}/health").status_code == 200
        answer = http.post(f"{served.url}/v1/completions", json={"prompt": "after the fuzz", "max_tokens": 4})
        assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] == "length"
        info, workers = wait_pd_idle(http, served.url)
        assert info["num_in_flight"] == 0 and sorted(workers) == ["d0", "p0"]
        for worker in workers.values():
            assert worker["invariant_error"] == "", worker


def test_workers_hold_the_secret_in_their_environment_only(served: Served) -> None:
    deadline = time.monotonic() + 5
    while not all(Path(f"/proc/{pid}").exists() for pid in served.worker_pids):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    for pid in served.worker_pids:
        command_line = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        environment = dict(entry.split(b"=", 1) for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                           if b"=" in entry)
        secret = environment[SECRET_ENV.encode()]
        assert len(bytes.fromhex(secret.decode())) == 32
        assert not any(secret in arg for arg in command_line) and API_KEY_ENV.encode() not in environment
        assert not any(ADMIN_KEY.encode() in arg for arg in command_line)
