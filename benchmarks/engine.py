"""Engine throughput and latency on one worker, with transformers `generate()` measured in the same run.

Prints one JSON line. Figures are medians over --repeats runs; the machine is shared and noisy,
so the ratios (kvbaton / transformers, hit / cold) are the numbers to quote.

    .venv/bin/python benchmarks/engine.py [--model smollm2-135m] [--dtype auto] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable

import torch

from kvbaton import LLM, SamplingParams

VLLM_CPU_REFERENCE = {  # measured on this machine class (shared/NOTES.md), SmolLM2 bf16, 2 cores
    "single_stream_tok_s": 40.0, "concurrent_16_tok_s": 404.0, "concurrent_64_tok_s": 610.0,
    "prefill_tok_s": 1060.0, "ttft_hit_over_cold": 0.305 / 1.415,
}


def _median(fn: Callable[[], float], repeats: int, label: str = "") -> float:
    values = [fn() for _ in range(repeats)]
    if label:
        print(f"{label}: {[round(v, 2) for v in values]}", file=sys.stderr, flush=True)
    return statistics.median(values)


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def bench_kvbaton(args: argparse.Namespace) -> dict[str, float]:
    llm = LLM(args.model, dtype=args.dtype, num_blocks=args.num_blocks, max_num_batched_tokens=args.chunk)
    vocab = llm.engine.loaded.config.vocab_size
    rng = random.Random(0)
    out_tokens = args.output_tokens
    decode = SamplingParams(max_tokens=out_tokens, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate(_prompt(rng, 32, vocab), SamplingParams(max_tokens=4, temperature=0.0))  # warm-up

    def streams(n: int) -> float:
        prompts = [_prompt(rng, 32, vocab) for _ in range(n)]
        start = time.perf_counter()
        llm.generate(prompts, decode)
        return n * out_tokens / (time.perf_counter() - start)

    def single_stream() -> float:
        result = llm.generate(_prompt(rng, 32, vocab), decode)[0]
        return 1.0 / result.tpot_s

    def prefill() -> float:
        start = time.perf_counter()
        llm.generate(_prompt(rng, 1500, vocab), one)
        return 1500 / (time.perf_counter() - start)

    def ttft_pair() -> tuple[float, float]:
        shared = _prompt(rng, 1400, vocab)
        cold = llm.generate(shared + _prompt(rng, 100, vocab), one)[0].ttft_s
        hit = llm.generate(shared + _prompt(rng, 100, vocab), one)[0]
        assert hit.num_cached_tokens >= 1392, hit.num_cached_tokens
        return cold, hit.ttft_s

    pairs = [ttft_pair() for _ in range(args.repeats)]
    print(f"kvbaton ttft cold/hit: {pairs}", file=sys.stderr, flush=True)
    cold_s = statistics.median(p[0] for p in pairs)
    hit_s = statistics.median(p[1] for p in pairs)
    result = {
        "single_stream_tok_s": _median(single_stream, args.repeats, "kvbaton single"),
        "concurrent_16_tok_s": _median(lambda: streams(16), args.repeats, "kvbaton x16"),
        "prefill_tok_s": _median(prefill, args.repeats, "kvbaton prefill"),
        "ttft_cold_s": cold_s,
        "ttft_hit_s": hit_s,
        "ttft_hit_over_cold": hit_s / cold_s,
    }
    if not args.quick:
        result["concurrent_64_tok_s"] = _median(lambda: streams(64), max(1, args.repeats - 1))
    llm.engine.check_invariants()
    return result


def bench_transformers(args: argparse.Namespace) -> dict[str, float]:
    """transformers LlamaForCausalLM over the very same dequantized weights and dtype."""
    import transformers

    from kvbaton.model.hf_reference import load_hf_reference

    model = load_hf_reference(args.model, args.dtype)
    vocab = model.config.vocab_size
    rng = random.Random(1)
    out_tokens = args.output_tokens

    @torch.inference_mode()
    def streams(n: int) -> float:
        ids = torch.tensor([_prompt(rng, 32, vocab) for _ in range(n)])
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_tokens, min_new_tokens=out_tokens,
                       do_sample=False, pad_token_id=0)
        return n * out_tokens / (time.perf_counter() - start)

    @torch.inference_mode()
    def prefill() -> float:
        ids = torch.tensor([_prompt(rng, 1500, vocab)])
        start = time.perf_counter()
        model(ids)
        return 1500 / (time.perf_counter() - start)

    transformers.logging.set_verbosity_error()
    streams(1)  # warm-up
    result = {
        "single_stream_tok_s": _median(lambda: streams(1), args.repeats, "transformers single"),
        "concurrent_16_tok_s": _median(lambda: streams(16), args.repeats, "transformers x16"),
        "prefill_tok_s": _median(prefill, args.repeats, "transformers prefill"),
    }
    if not args.quick:
        result["concurrent_64_tok_s"] = _median(lambda: streams(64), max(1, args.repeats - 1))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens")
    parser.add_argument("--quick", action="store_true", help="skip the 64-stream runs")
    parser.add_argument("--no-transformers", action="store_true")
    args = parser.parse_args()
    ours = bench_kvbaton(args)
    report: dict[str, object] = {"benchmark": "engine", "model": args.model, "dtype": args.dtype,
                                 "threads": torch.get_num_threads(), "kvbaton": ours}
    if not args.no_transformers:
        theirs = bench_transformers(args)
        report["transformers"] = theirs
        report["ratio_vs_transformers"] = {k: ours[k] / theirs[k] for k in theirs if k in ours}
    report["vllm_cpu_reference"] = VLLM_CPU_REFERENCE
    report["ratio_vs_vllm_cpu_reference"] = {k: ours[k] / v for k, v in VLLM_CPU_REFERENCE.items() if k in ours}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
