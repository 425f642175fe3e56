"""What padding step shapes to buckets costs: SmolLM2 `LLM.generate()` with the row buckets against exact shapes.

`kvbaton.model.attention.bucket_rows` pads a linear's rows and a prefill chunk's queries (16 lengths per doubling)
and a cached chunk's keys (to a multiple of KEY_PAD), so that oneDNN and CPU flash attention keep a bounded set
of kernels. Here the same process runs each case with the buckets and with exact shapes (both patched in
`kvbaton.model.llama` and `kvbaton.model.attention`), interleaved, after a first pass of each that builds their
kernels; the figure is bucketed / exact tok/s of the best of `--repeats` (the host is shared: best-of is what
load disturbs least). Cases: a 300-token prefill (304 rows), a 700-token one (512 + 188 over cached context) and
a 37-stream decode (38 rows). Prints one JSON line.

    .venv/bin/python benchmarks/row_buckets.py [--repeats 6] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable

import torch

import kvbaton.model.attention as attention
import kvbaton.model.llama as llama
from kvbaton.core.sampling import SamplingParams
from kvbaton.llm import LLM

BUCKET = attention.bucket_rows
KEY_PAD = attention.KEY_PAD


def set_mode(mode: str) -> None:
    llama.bucket_rows = attention.bucket_rows = BUCKET if mode == "bucketed" else (lambda rows: rows)
    attention.KEY_PAD = KEY_PAD if mode == "bucketed" else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM("smollm2-135m", enable_prefix_cache=False, num_blocks=1024)
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 49000) for _ in range(n)]

    def prefill(n: int) -> float:
        ids = prompt(n)
        started = time.perf_counter()
        llm.generate([ids], SamplingParams(max_tokens=1, ignore_eos=True))
        return n / (time.perf_counter() - started)

    def decode(streams: int, steps: int = 8) -> float:
        prompts = [prompt(8) for _ in range(streams)]
        started = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=steps + 1, ignore_eos=True))
        return streams * steps / (time.perf_counter() - started)

    cases: dict[str, Callable[[], float]] = {"prefill_300": lambda: prefill(300), "prefill_700": lambda: prefill(700),
                                             "decode_37_streams": lambda: decode(37)}
    best: dict[str, dict[str, float]] = {"bucketed": {}, "exact": {}}
    for mode in best:
        set_mode(mode)
        for run in cases.values():
            run()  # builds this mode's kernels
    for repeat in range(args.repeats):
        for name, run in cases.items():
            for mode in ("bucketed", "exact") if repeat % 2 == 0 else ("exact", "bucketed"):
                set_mode(mode)
                best[mode][name] = max(best[mode].get(name, 0.0), run())
    set_mode("bucketed")
    print(json.dumps({"tok_per_s_best": {m: {k: round(v, 1) for k, v in d.items()} for m, d in best.items()},
                      "bucketed_over_exact": {k: round(best["bucketed"][k] / best["exact"][k], 3) for k in cases},
                      "repeats": args.repeats, "threads": args.threads}))


if __name__ == "__main__":
    main()
