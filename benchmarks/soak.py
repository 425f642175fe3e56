"""Soak: a long run of mixed requests against `kvbaton serve` (1 prefill + 1 decode worker) that must leave nothing.

A closed loop of `--concurrency` clients sends `--num-requests` requests, a seeded mix of completions and chats,
streamed (60 %) and whole, with n = 1, 2 or 3, structured output on a fifth of them (a JSON schema for chats, a
choice for completions), prompts that share a few system prefixes, and clients that leave mid-stream (10 %: they
close the stream after its first chunk). Every request carries the API key the server was started with (handed
to it in KVBATON_API_KEY, off its command line). The run shows:

- every request ends: completed (every choice has a finish reason, a stream ends with [DONE]), rejected (429/503)
  or failed with a reason (an error body or an error event); none still open at `--request-timeout-s`;
- the workers hold no block afterwards beyond their prefix cache (no request in flight, no transfer's blocks, no
  failed invariant: `/cluster`, polled until idle);
- RSS of the router and of each worker (sampled every 0.5 s from /proc) within 5 % between the first and the
  last quarter of the requests (median of each quarter's samples; quarters by requests finished);
- p99 latency (whole request, completed ones) of the last quarter within 1.2x the second's (quarters by start).

The workers start with `--warm-up` (every linear shape a step can use is built before serving: oneDNN keeps one
primitive, ~0.5 MB, per row bucket, a bounded set, `kvbaton.model.llama.Linear`); `--no-warm-up` shows the same
run without it, where the workers' RSS grows by up to that bound as new step sizes arrive. `rss_at_start_mb`
is each process's first sample, before any request.

Prints one JSON line (progress on stderr). The machine is shared: rerun before trusting one figure.

    .venv/bin/python benchmarks/soak.py [--model tiny-random --num-requests 2000 --concurrency 64]
    .venv/bin/python benchmarks/soak.py --model smollm2-135m --num-requests 300 --max-num-batched-tokens 128
    .venv/bin/python benchmarks/soak.py --no-warm-up
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

BANNER = re.compile(r"at (http://127\.0\.0\.1:\d+) .*\(pids ([\d ]+)\)")
SYSTEM_PROMPTS = [f"You are assistant number {i}. Answer briefly, politely and in plain words. " * 3 for i in range(4)]
WORDS = ("alpha", "river", "stone", "cloud", "maple", "orbit", "pixel", "quartz", "ember", "delta", "lumen", "cedar")
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@dataclass
class Outcome:
    index: int
    kind: str  # completed | rejected | failed | abandoned | hung
    reason: str
    started_s: float
    latency_s: float


def make_request(rng: random.Random, index: int, max_tokens: int) -> tuple[str, dict[str, object], bool]:
    """(path, body, leaves mid-stream) of request `index`."""
    stream = rng.random() < 0.6
    abandon = stream and rng.random() < 1 / 6  # 10 % of all requests
    n = rng.choice((1, 1, 1, 2, 3))
    structured = rng.random() < 0.2
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40))) + f" (request {index})"
    body: dict[str, object] = {"max_tokens": rng.randint(max(2, max_tokens // 4), max_tokens), "n": n,
                               "temperature": rng.choice((0.0, 0.8)), "seed": index, "stream": stream}
    if rng.random() < 0.5:
        body["messages"] = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)},
                            {"role": "user", "content": text}]
        if structured:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
        return "/v1/chat/completions", body, abandon
    body["prompt"] = rng.choice(SYSTEM_PROMPTS) + text
    if structured:
        body["structured_outputs"] = {"choice": ["yes", "no", "maybe"]}
    return "/v1/completions", body, abandon


async def one_request(http: httpx.AsyncClient, index: int, path: str, body: dict[str, object], abandon: bool,
                      timeout_s: float) -> Outcome:
    started = time.monotonic()

    def done(kind: str, reason: str = "") -> Outcome:
        return Outcome(index, kind, reason, started, time.monotonic() - started)

    try:
        async with asyncio.timeout(timeout_s):
            if not body["stream"]:
                response = await http.post(path, json=body)
                return _judge_whole(response, int(body["n"]), done)  # type: ignore[call-overload]
            async with http.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    return _judge_whole(response, 0, done)
                finished: set[int] = set()
                async for line in response.aiter_lines():
                    if abandon:
                        return done("abandoned")  # closing the stream is the client leaving
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        n = int(body["n"])  # type: ignore[call-overload]
                        return done("completed") if len(finished) == n else done("failed", f"{len(finished)}/{n} ended")
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return done("failed", str(chunk["error"].get("message", ""))[:120])
                    finished |= {c["index"] for c in chunk["choices"] if c.get("finish_reason")}
                return done("failed", "the stream ended without [DONE]")
    except TimeoutError:
        return done("hung", f"no end within {timeout_s:g} s")
    except httpx.HTTPError as exc:
        return done("failed", f"{type(exc).__name__}: {exc}")


def _judge_whole(response: httpx.Response, n: int, done: object) -> Outcome:
    finish = done  # type: ignore[assignment]
    if response.status_code in (429, 503):
        return finish("rejected", str(response.status_code))  # type: ignore[operator,no-any-return]
    if response.status_code != 200:
        message = response.json().get("error", {}).get("message", "") if response.content else ""
        return finish("failed", f"{response.status_code}: {message[:120]}")  # type: ignore[operator,no-any-return]
    choices = response.json()["choices"]
    ended = len(choices) == n and all(choice.get("finish_reason") for choice in choices)
    if ended:
        return finish("completed")  # type: ignore[operator,no-any-return]
    return finish("failed", "a choice without a finish reason")  # type: ignore[operator,no-any-return]


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


async def sample_rss(pids: dict[str, int], finished: list[int], samples: list[tuple[int, dict[str, float]]],
                     stop: asyncio.Event) -> None:
    while not stop.is_set():
        samples.append((finished[0], {name: rss_mb(pid) for name, pid in pids.items()}))
        try:
            await asyncio.wait_for(stop.wait(), 0.2)
        except TimeoutError:
            pass
    # One sample as the run ends, so that the last quarter has one however quickly it went by.
    samples.append((finished[0], {name: rss_mb(pid) for name, pid in pids.items()}))


async def drive(url: str, api_key: str, args: argparse.Namespace, pids: dict[str, int]) -> dict[str, object]:
    rng = random.Random(args.seed)
    requests = [make_request(rng, i, args.max_tokens) for i in range(args.num_requests)]
    outcomes: list[Outcome] = []
    finished = [0]
    samples: list[tuple[int, dict[str, float]]] = []
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {api_key}"}, limits=limits,
                                 timeout=httpx.Timeout(args.request_timeout_s)) as http:
        sampler = asyncio.create_task(sample_rss(pids, finished, samples, stop))
        queue = iter(enumerate(requests))
        started = time.monotonic()

        async def client() -> None:
            for index, (path, body, abandon) in queue:
                outcomes.append(await one_request(http, index, path, body, abandon, args.request_timeout_s))
                finished[0] += 1
                if finished[0] % max(1, args.num_requests // 10) == 0:
                    print(f"soak: {finished[0]}/{args.num_requests} ended", file=sys.stderr, flush=True)

        await asyncio.gather(*(client() for _ in range(args.concurrency)))
        wall_s = time.monotonic() - started
        stop.set()
        await sampler
        idle = await wait_idle(http, args.idle_timeout_s)
    return {"outcomes": outcomes, "samples": samples, "wall_s": wall_s, "idle": idle,
            "mix": _mix(requests)}


async def wait_idle(http: httpx.AsyncClient, timeout_s: float) -> dict[str, object]:
    """Poll /cluster until nothing is in flight and every worker holds only prefix-cache blocks (or time out)."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = (await http.get("/cluster")).json()
        held = {w["worker_id"]: (w["num_used_blocks"] - w["num_cached_blocks"]) + w["transfers"]["num_held_blocks"]
                for w in info["workers"]}
        errors = {w["worker_id"]: w["invariant_error"] for w in info["workers"] if w["invariant_error"]}
        if (info["num_in_flight"] == 0 and not any(held.values())) or time.monotonic() > deadline:
            return {"num_in_flight": info["num_in_flight"], "blocks_held": held, "invariant_errors": errors,
                    "lost_workers": info["lost_workers"]}
        await asyncio.sleep(0.2)


def _mix(requests: list[tuple[str, dict[str, object], bool]]) -> dict[str, int]:
    return {"chat": sum(path.endswith("chat/completions") for path, _, _ in requests),
            "streamed": sum(bool(body["stream"]) for _, body, _ in requests),
            "n_above_1": sum(int(body["n"]) > 1 for _, body, _ in requests),  # type: ignore[call-overload]
            "structured": sum("response_format" in body or "structured_outputs" in body for _, body, _ in requests),
            "leave_mid_stream": sum(abandon for _, _, abandon in requests)}


def quarter_percentiles(outcomes: list[Outcome], fraction: float) -> list[float]:
    """A latency percentile (`fraction` 0.99: p99) of the completed requests in each quarter of the run, by start
    order."""
    ordered = sorted(outcomes, key=lambda o: o.started_s)
    size = max(1, len(ordered) // 4)
    values = []
    for q in range(4):
        latencies = sorted(o.latency_s for o in ordered[q * size:(q + 1) * size if q < 3 else None]
                           if o.kind == "completed")
        values.append(latencies[min(len(latencies) - 1, int(fraction * len(latencies)))] if latencies else 0.0)
    return values


def rss_by_quarter(samples: list[tuple[int, dict[str, float]]], num_requests: int) -> dict[str, dict[str, float]]:
    first = [s for done, s in samples if done < num_requests / 4]
    last = [s for done, s in samples if done >= 3 * num_requests / 4]
    out = {}
    for name in samples[0][1] if samples else {}:
        a, b = statistics.median(s[name] for s in first), statistics.median(s[name] for s in last)
        out[name] = {"first_quarter_mb": round(a, 1), "last_quarter_mb": round(b, 1), "ratio": round(b / a, 4)}
    return out


def start_server(args: argparse.Namespace, api_key: str) -> tuple[subprocess.Popen[str], str]:
    command = [sys.executable, "-m", "kvbaton.cli", "serve", "--model", args.model, "--prefill", "1", "--decode", "1",
               "--port", "0", "--num-blocks", str(args.num_blocks), "--max-num-waiting", str(args.max_num_waiting),
               "--threads-per-worker", str(args.threads_per_worker), "--drain-timeout", "5",
               "--max-num-batched-tokens", str(args.max_num_batched_tokens), *(["--warm-up"] if args.warm_up else []),
               *(["--tokenizer-cache-chars", str(args.tokenizer_cache_chars)] if args.tokenizer_cache_chars >= 0 else [])]
    environment = {**os.environ, "KVBATON_API_KEY": api_key}
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              start_new_session=True, env=environment)
    assert server.stdout is not None
    banner = server.stdout.readline()
    match = BANNER.search(banner)
    if match is None:
        stop_server(server)
        raise RuntimeError(f"kvbaton serve did not start: {banner!r}")
    return server, match.group(1)


def stop_server(server: subprocess.Popen[str]) -> None:
    if server.poll() is None:
        os.kill(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=24, help="a request asks for 1/4 of this up to all of it")
    parser.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per worker")
    parser.add_argument("--max-num-waiting", type=int, default=256, help="the router's queue limit (then 429)")
    parser.add_argument("--threads-per-worker", type=int, default=1)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512,
                        help="tokens per worker step (SmolLM2 on one busy core: 128 keeps steps short)")
    parser.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                        help="start the workers without --warm-up (their RSS then grows while new step sizes come)")
    parser.add_argument("--tokenizer-cache-chars", type=int, default=-1,
                        help="the router's ingress tokenization cache bound (serve's flag; default: serve's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument("--idle-timeout-s", type=float, default=30.0)
    args = parser.parse_args()
    api_key = f"sk-soak-{random.Random(args.seed).getrandbits(64):016x}"
    server, url = start_server(args, api_key)
    try:
        info = httpx.get(f"{url}/cluster", headers={"Authorization": f"Bearer {api_key}"}, timeout=30).json()
        pids = {"router": server.pid, **{w["worker_id"]: int(w["pid"]) for w in info["workers"]}}
        run = asyncio.run(drive(url, api_key, args, pids))
        serving_after = httpx.get(f"{url}/health", timeout=30).status_code == 200
    finally:
        stop_server(server)
    outcomes: list[Outcome] = run["outcomes"]  # type: ignore[assignment]
    counts = {kind: sum(o.kind == kind for o in outcomes) for kind in ("completed", "rejected", "failed",
                                                                       "abandoned", "hung")}
    reasons = sorted({o.reason for o in outcomes if o.kind == "failed"})[:5]
    idle: dict[str, object] = run["idle"]  # type: ignore[assignment]
    blocks_held = sum(idle["blocks_held"].values())  # type: ignore[union-attr]
    rss = rss_by_quarter(run["samples"], args.num_requests)  # type: ignore[arg-type]
    p99, p50 = quarter_percentiles(outcomes, 0.99), quarter_percentiles(outcomes, 0.5)
    p99_ratio = round(p99[3] / p99[1], 3) if p99[1] else None
    print(json.dumps({
        "model": args.model, "num_requests": args.num_requests, "concurrency": args.concurrency,
        "mix": run["mix"], "outcomes": counts, "failure_reasons": reasons,
        "every_request_ended": counts["hung"] == 0 and len(outcomes) == args.num_requests and all(
            o.reason for o in outcomes if o.kind == "failed"),
        "blocks_held_after": blocks_held, "in_flight_after": idle["num_in_flight"],
        "invariant_errors": idle["invariant_errors"], "lost_workers": idle["lost_workers"],
        "serving_after": serving_after, "warm_up": args.warm_up,
        "rss_at_start_mb": {name: round(mb, 1) for name, mb in run["samples"][0][1].items()}  # type: ignore[index]
        if run["samples"] else {}, "rss": rss,
        "rss_within_5pct": bool(rss) and all(abs(r["ratio"] - 1) <= 0.05 for r in rss.values()),
        "latency_p99_s_by_quarter": [round(v, 3) for v in p99], "p99_last_over_second": p99_ratio,
        "latency_p50_s_by_quarter": [round(v, 3) for v in p50],
        "p99_within_1_2x": p99_ratio is not None and p99_ratio <= 1.2,
        "wall_s": round(float(run["wall_s"]), 1),  # type: ignore[arg-type]
        "requests_per_s": round(args.num_requests / float(run["wall_s"]), 2),  # type: ignore[arg-type]
    }))


if __name__ == "__main__":
    main()
