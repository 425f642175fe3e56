"""Drain (issue 24 item 4): `kvbaton serve` stopped by SIGTERM answers new generation requests with 503 and
Retry-After while it finishes its in-flight streams, instead of refusing connections; then it exits 0."""

from __future__ import annotations

import json
import signal
import time

import httpx

from tests.server.serve_helpers import serve_process


def test_a_draining_router_answers_503_with_retry_after_while_its_stream_finishes() -> None:
    with serve_process(["--model", "tiny-random", "--workers", "1", "--num-blocks", "512", "--drain-timeout", "120"],
                       120.0) as served, httpx.Client(timeout=60.0) as http:
        body = {"model": "tiny-random", "prompt": "drain me", "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with http.stream("POST", served.url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            next(lines)  # its call is in flight
            served.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10.0
            while True:  # the signal takes a moment to reach the router's loop
                refused = http.post(served.url + "/v1/completions",
                                    json={"model": "tiny-random", "prompt": "too late", "max_tokens": 4})
                if refused.status_code != 200 or time.monotonic() > deadline:
                    break
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"] == "1"
            assert "shutting down" in refused.json()["error"]["message"]
            ready = http.get(served.url + "/ready")
            assert ready.status_code == 503 and "shutting down" in ready.json()["reason"]
            chunks = [json.loads(line.removeprefix("data: ")) for line in lines
                      if line.startswith("data: ") and line != "data: [DONE]"]
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0].get("finish_reason")]
        assert finish == ["length"]  # the in-flight stream ran to its end during the drain
        assert served.process.wait(60) == 0
