"""The prefix cache's host tier (`--host-num-blocks`): TTFT when shared prefixes outnumber what the KV pool holds.

SmolLM2 in-process, one engine per configuration. `--groups` prefixes of `--prefix-tokens` tokens, each followed
by a short unique question, are sent one request at a time in turn, `--rounds` times: the KV pool
(`--num-blocks`) holds only a few of the prefixes, so under LRU every return of a prefix finds it evicted. Without
a host tier it is prefilled again; with one (`--host-num-blocks`) its blocks come back by copy. A third engine
has a pool large enough to never evict (no tier): its prefix hits are the best a cache can do, and its answers are
what the tier's must be token for token (both compute each question on top of the same cached prefix KV; the
engine that recomputes the prefix chunks it differently, so bf16 near-ties may fall the other way there). Reports
the median TTFT of the requests after the first round for all three, their ratios, the hit tokens, and the copy's cost next to
the physical limit measured in the same run: the tier's load of a prefix's blocks (ids in one run, and scattered so
that every block is its own copy) against `torch` copying the same bytes as one contiguous tensor (memcpy speed). Greedy answers must agree between the two. The configurations
alternate `--repeats` times; medians over repeats. Prints one JSON line (progress on stderr).

    .venv/bin/python benchmarks/host_tier.py [--groups 8 --prefix-tokens 1000 --num-blocks 320 --rounds 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

from kvbaton import LLM, SamplingParams

MODEL = "smollm2-135m"
_WORDS = ("river", "market", "signal", "harbor", "ledger", "orbit", "canvas", "timber", "meadow", "engine",
          "lantern", "quarry", "velvet", "summit", "cipher", "garden", "anchor", "prism", "thistle", "beacon")


def make_prompts(llm: LLM, groups: int, prefix_tokens: int, rounds: int, seed: int) -> list[list[int]]:
    """Token ids: group g's prefix (exactly prefix_tokens) + a question unique to (round, g)."""
    rng = random.Random(seed)
    tokenizer = llm.tokenizer
    prefixes = []
    for _ in range(groups):
        text = " ".join(rng.choice(_WORDS) + str(rng.randrange(100)) for _ in range(prefix_tokens))
        prefixes.append(tokenizer.encode(text)[:prefix_tokens])
    return [prefixes[g] + tokenizer.encode(f"\nQuestion {r}.{g}: which word comes first?")
            for r in range(rounds) for g in range(groups)]


def run(args: argparse.Namespace, num_blocks: int, host_num_blocks: int, prompts: list[list[int]]) -> dict[str, object]:
    llm = LLM(MODEL, num_blocks=num_blocks, host_num_blocks=host_num_blocks,
              max_num_batched_tokens=args.max_num_batched_tokens)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    ttfts, answers = [], []
    for prompt in prompts:
        result = llm.generate([prompt], params)[0]
        ttfts.append(result.ttft_s)
        answers.append(result.outputs[0].token_ids)
    llm.engine.check_invariants()
    stats = llm.engine.stats()
    later = ttfts[args.groups:]  # after the first round: each prefix has been seen (and evicted) before
    return {"ttft_s": statistics.median(later), "hit_tokens": stats.prefix_cache_hits_tokens,
            "loaded_blocks": stats.num_host_loaded_blocks, "saved_blocks": stats.num_host_saved_blocks,
            "answers": answers, "llm": llm}


def copy_cost(llm: LLM, num_blocks: int, repeats: int = 5) -> dict[str, float]:
    """The tier's load of `num_blocks` blocks vs torch copying the same bytes contiguously (memcpy speed)."""
    storage = llm.engine.host_storage
    assert storage is not None
    num_blocks = min(num_blocks, storage.num_blocks, llm.engine.storage.num_blocks)
    ids = list(range(num_blocks))
    scattered = random.Random(0).sample(ids, num_blocks)  # no two neighbours: one slice copy per block
    num_bytes = num_blocks * storage.bytes_per_block
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    load_s, scattered_s, memcpy_s = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        storage.load(ids, ids)
        load_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        storage.load(scattered, ids)
        scattered_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        dst.copy_(src)
        memcpy_s.append(time.perf_counter() - start)
    load, scattered_load, memcpy = (statistics.median(x) for x in (load_s, scattered_s, memcpy_s))
    return {"blocks": num_blocks, "bytes": num_bytes, "load_s": load, "scattered_load_s": scattered_load,
            "memcpy_s": memcpy, "load_gb_s": num_bytes / load / 1e9, "memcpy_gb_s": num_bytes / memcpy / 1e9,
            "load_over_memcpy_time": load / memcpy, "scattered_load_over_memcpy_time": scattered_load / memcpy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-blocks", type=int, default=320, help="device KV blocks (16 tokens each)")
    parser.add_argument("--host-num-blocks", type=int, default=2048)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    prompts = make_prompts(LLM(MODEL, num_blocks=64), args.groups, args.prefix_tokens, args.rounds, args.seed)
    roomy_blocks = len(prompts) * (len(prompts[0]) // 16 + 2) + 64
    configs = (("without", args.num_blocks, 0), ("with", args.num_blocks, args.host_num_blocks),
               ("roomy", roomy_blocks, 0))
    runs: dict[str, list[dict[str, object]]] = {name: [] for name, _, _ in configs}
    for repeat in range(args.repeats):
        for name, num_blocks, host in configs[:: 1 if repeat % 2 == 0 else -1]:
            result = run(args, num_blocks, host, prompts)
            runs[name].append(result)
            print(f"repeat {repeat} {name}: median TTFT {result['ttft_s']:.3f} s, hit tokens "
                  f"{result['hit_tokens']}, loaded {result['loaded_blocks']} blocks", file=sys.stderr, flush=True)
    with_ttft, without_ttft, roomy_ttft = (statistics.median(r["ttft_s"] for r in runs[name])  # type: ignore[misc]
                                           for name in ("with", "without", "roomy"))

    def identical(a: str, b: str) -> str:
        same = sum(x == y for x, y in zip(runs[a][0]["answers"], runs[b][0]["answers"]))  # type: ignore[arg-type]
        return f"{same}/{len(prompts)}"

    prefix_blocks = args.prefix_tokens // 16
    out = {
        "setup": {"model": MODEL, "groups": args.groups, "prefix_tokens": args.prefix_tokens, "rounds": args.rounds,
                  "num_blocks": args.num_blocks, "host_num_blocks": args.host_num_blocks, "repeats": args.repeats,
                  "prefixes_the_pool_holds": round(args.num_blocks / (prefix_blocks + 2), 1),
                  "roomy_num_blocks": roomy_blocks},
        "ttft_s_without": round(without_ttft, 4), "ttft_s_with": round(with_ttft, 4),
        "ttft_s_roomy": round(roomy_ttft, 4),
        "ttft_without_over_with": round(without_ttft / with_ttft, 2),
        "ttft_with_over_roomy": round(with_ttft / roomy_ttft, 2),
        "hit_tokens_without": runs["without"][0]["hit_tokens"], "hit_tokens_with": runs["with"][0]["hit_tokens"],
        "hit_tokens_roomy": runs["roomy"][0]["hit_tokens"],
        "loaded_blocks": runs["with"][0]["loaded_blocks"], "saved_blocks": runs["with"][0]["saved_blocks"],
        "identical_answers_with_vs_roomy": identical("with", "roomy"),
        "identical_answers_with_vs_without": identical("with", "without"),
        "copy_of_one_prefix": {k: round(v, 6) if isinstance(v, float) else v
                               for k, v in copy_cost(runs["with"][0]["llm"], prefix_blocks).items()},  # type: ignore[arg-type]
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
