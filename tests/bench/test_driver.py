"""The live driver against a tiny fake OpenAI-compatible server (FastAPI + uvicorn on 127.0.0.1, in a thread)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvbaton.bench.driver import DriverConfig, discover_model, run_live
from kvbaton.bench.workloads.base import WorkloadRequest
from kvbaton.cli import main as kvbaton_main

TOKEN_GAP_S = 0.01


def fake_app(received: list[dict]) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):  # noqa: ANN202 - FastAPI response union
        body = await request.json()
        received.append({**body, "request_id": request.headers.get("x-request-id")})
        user = body.get("user", "")
        if user == "reject":
            return JSONResponse({"error": {"message": "overloaded: queue full"}}, status_code=429)
        if user == "broken":
            return JSONResponse({"detail": "boom"}, status_code=500)
        prompt = tuple(body["prompt"])
        cached = 16 if user == "cached" else 0  # fixed per tenant: arrival order is not under test
        delay_s = 5.0 if user == "slow" else TOKEN_GAP_S

        async def stream() -> Iterator[str]:
            for i in range(body["max_tokens"]):
                await asyncio.sleep(delay_s)
                chunk = {"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: " + json.dumps({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}) + "\n\n"
            usage = {"prompt_tokens": len(prompt), "completion_tokens": body["max_tokens"],
                     "total_tokens": len(prompt) + body["max_tokens"],
                     "prompt_tokens_details": {"cached_tokens": cached}}
            extension = {"worker_ids": ["w0"], "queue_s": 0.001, "transfer_bytes": 64}
            yield "data: " + json.dumps({"choices": [], "usage": usage, "kvbaton": extension}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@pytest.fixture()
def server() -> Iterator[tuple[str, list[dict]]]:
    received: list[dict] = []
    config = uvicorn.Config(fake_app(received), host="127.0.0.1", port=0, log_level="warning",
                            timeout_graceful_shutdown=1)
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.01)
    port = srv.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", received
    srv.should_exit = True
    thread.join(timeout=10)
    assert not thread.is_alive()


def req(index: int, arrival_s: float, tenant: str = "", output_tokens: int = 4) -> WorkloadRequest:
    prompt = np.arange(17 + index, 49 + index, dtype=np.int32)
    return WorkloadRequest(index=index, arrival_s=arrival_s, prompt_parts=(prompt,), output_tokens=output_tokens,
                           slo_class="A" if index % 2 else "B", tenant=tenant)


def test_driver_records_tokens_cache_rejections_and_timeouts(server: tuple[str, list[dict]]) -> None:
    url, received = server
    assert discover_model(url) == "fake-model"
    requests = [req(0, 0.0), req(1, 0.05, "cached"), req(2, 0.1, "reject"), req(3, 0.1, "broken"),
                req(4, 0.1, "slow")]
    records = run_live(requests, DriverConfig(url=url, model="fake-model", timeout_s=1.0))
    by_id = {r.request_id: r for r in records}

    first, second = by_id["req-0"], by_id["req-1"]
    assert first.status == "completed" and first.output_tokens == 4
    assert len(first.token_times_s) == 4  # the empty finish chunk is not a token
    assert first.first_token_s == first.token_times_s[0]
    assert first.ttft_s >= TOKEN_GAP_S * 0.5
    assert TOKEN_GAP_S * 0.5 <= first.tpot_s < 1.0  # the server sleeps TOKEN_GAP_S per token; loose on a busy host
    assert (first.cached_tokens, second.cached_tokens) == (0, 16)
    assert first.prompt_tokens == 32 and first.worker_ids == ("w0",) and first.queue_s == 0.001
    assert first.transfer_bytes == 64
    assert second.arrival_s >= 0.05  # sent on schedule, not before

    assert by_id["req-2"].status == "rejected" and by_id["req-2"].reason == "HTTP 429: overloaded: queue full"
    assert by_id["req-3"].status == "failed" and by_id["req-3"].reason == "HTTP 500: boom"
    assert by_id["req-4"].status == "failed" and by_id["req-4"].reason.startswith("timeout")

    body = next(b for b in received if b["request_id"] == "req-0")
    assert body["model"] == "fake-model" and body["stream"] is True
    assert body["max_tokens"] == body["min_tokens"] == 4 and body["ignore_eos"] is True
    assert body["temperature"] == 0.0
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert body["prompt"] == list(range(17, 49))


def test_cli_drives_a_workload_and_writes_the_report(server: tuple[str, list[dict]], tmp_path, capsys) -> None:
    url, received = server
    out = tmp_path / "run"
    rc = kvbaton_main(["bench", "--url", url, "--workload", "shared-prefix", "--num-requests", "8", "--rate", "100",
                       "--param", "num_groups=2", "--param", "system_prompt_tokens=32", "--param", "question_tokens=8",
                       "--param", "output_tokens=3", "--ttft-slo", "2", "--tpot-slo", "1", "--out", str(out), "--json"])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["model"] == "fake-model"
    assert printed["summary"]["overall"]["num_completed"] == 8
    assert printed["summary"]["overall"]["slo_attainment"] == 1.0
    report = json.loads((out / "report.json").read_text())
    assert report["runs"]["shared-prefix"]["overall"]["num_requests"] == 8
    assert (out / "report.md").is_file() and (out / "ttft_cdf.png").is_file()
    assert len(received) == 8 and all(len(b["prompt"]) == 40 for b in received)
