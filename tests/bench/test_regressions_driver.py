"""Regression: the live driver's records must count tokens as the simulator's do (one time per output token), or
TPOT/ITL of `kvbaton bench` and `kvbaton sim` mean different things for the same run."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from kvbaton.bench.driver import DriverConfig, run_live
from kvbaton.bench.workloads.base import WorkloadRequest

TOKENS_PER_CHUNK = 4  # one step's accepted speculative drafts, or tokens the detokenizer held back (a multi-byte
NUM_CHUNKS = 5        # character split over tokens, a skipped special token) arrive in one SSE chunk


def _app(per_chunk_tokens: list[int] | None = None) -> FastAPI:
    """Chunks of TOKENS_PER_CHUNK tokens each and only a final usage; or, with `per_chunk_tokens`, chunks of those
    many tokens each carrying the cumulative usage (vLLM's and kvbaton's continuous_usage_stats)."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):  # noqa: ANN202
        body = await request.json()

        async def stream() -> Iterator[str]:
            counts = per_chunk_tokens or [TOKENS_PER_CHUNK] * NUM_CHUNKS
            for i, count in enumerate(counts):
                await asyncio.sleep(0.02)
                chunk = {"choices": [{"index": 0, "text": "abcd"[:TOKENS_PER_CHUNK] + str(i), "finish_reason": None}]}
                if per_chunk_tokens:
                    chunk["usage"] = {"prompt_tokens": len(body["prompt"]), "completion_tokens": sum(counts[: i + 1])}
                yield f"data: {json.dumps(chunk)}\n\n"
            total = sum(counts)
            yield "data: " + json.dumps({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}) + "\n\n"
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": total,
                     "total_tokens": len(body["prompt"]) + total}
            yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


PER_CHUNK_TOKENS = [1, 7, 1, 9, 2]  # 20 tokens, as the other server sends


@pytest.fixture(params=["final usage only", "usage per chunk"])
def url(request: pytest.FixtureRequest) -> Iterator[str]:
    app = _app(PER_CHUNK_TOKENS if request.param == "usage per chunk" else None)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=10)


def test_chunks_carrying_several_tokens_keep_one_time_per_token(url: str) -> None:
    # Bug: driver._on_event appends one token time per SSE chunk, while output_tokens comes from usage. A chunk
    # carrying k tokens (speculative decoding accepts several per step; the live server also merges tokens whose
    # text is held back, e.g. tiny-random: 20 tokens in 5 chunks) leaves len(token_times_s) < output_tokens, so
    # TPOT = (last - first) / (chunks - 1) is k times the simulator's (last - first) / (tokens - 1), and ITLs miss
    # the zero gaps the simulator records for accepted drafts.
    # Fixed: with per-chunk usage each chunk's new tokens get its time; without, the final usage's tokens are spread
    # over the chunks by their text length.
    request = WorkloadRequest(0, 0.0, (np.arange(20, 36, dtype=np.int32),), NUM_CHUNKS * TOKENS_PER_CHUNK)
    record = run_live([request], DriverConfig(url=url, model="fake", timeout_s=30))[0]
    assert record.completed and record.output_tokens == NUM_CHUNKS * TOKENS_PER_CHUNK == sum(PER_CHUNK_TOKENS)
    assert len(record.token_times_s) == record.output_tokens
    runs = [len(list(group)) for _, group in itertools.groupby(record.token_times_s)]
    assert runs in ([TOKENS_PER_CHUNK] * NUM_CHUNKS, PER_CHUNK_TOKENS), runs
