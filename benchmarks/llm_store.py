"""An offline LLM's KV store node (`LLM(kv_store_gb=...)`): TTFT when shared prefixes outnumber what the KV pool holds.

SmolLM2 in-process, one engine per configuration. `--groups` prefixes of `--prefix-tokens` tokens, each followed
by a short unique question, are sent one request at a time in turn, `--rounds` times: the KV pool
(`--num-blocks`) holds only a few of the prefixes, so under LRU every return of a prefix finds it evicted. Without
a store it is prefilled again; with one (`--kv-store-gb`, a store node on a thread of the process: blocks written
through as they are computed, loaded back before admission, both off the step's path) its blocks come back by
copy from the node's shared memory. A third engine has a pool large enough to never evict (no store): its prefix
hits are the best a cache can do, and its answers are what the store's must be token for token (both compute each
question on top of the same cached prefix KV; the engine that recomputes the prefix chunks it differently, so bf16
near-ties may fall the other way there). Reports the median TTFT of the requests after the first round for all
three, their ratios and the hit tokens; the configurations alternate `--repeats` times, medians over repeats. (The
load's speed against memcpy is `kv_store_live.py`'s.) Prints one JSON line (progress on stderr).

    .venv/bin/python benchmarks/llm_store.py [--groups 8 --prefix-tokens 1000 --num-blocks 320 --rounds 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys

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


def run(args: argparse.Namespace, num_blocks: int, kv_store_gb: float, prompts: list[list[int]]) -> dict[str, object]:
    llm = LLM(MODEL, num_blocks=num_blocks, kv_store_gb=kv_store_gb, max_num_batched_tokens=args.max_num_batched_tokens)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    ttfts, answers = [], []
    for prompt in prompts:
        result = llm.generate([prompt], params)[0]
        ttfts.append(result.ttft_s)
        answers.append(result.outputs[0].token_ids)
    llm.engine.check_invariants()
    stats = llm.engine.stats()
    io = llm.engine.store_io
    llm.close()
    later = ttfts[args.groups:]  # after the first round: each prefix has been seen (and evicted) before
    return {"ttft_s": statistics.median(later), "hit_tokens": stats.prefix_cache_hits_tokens,
            "loaded_blocks": io.num_loaded_blocks if io else 0, "saved_blocks": io.num_saved_blocks if io else 0,
            "answers": answers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-blocks", type=int, default=320, help="device KV blocks (16 tokens each)")
    parser.add_argument("--kv-store-gb", type=float, default=0.76,
                        help="the store node's DRAM (default: 2,048 SmolLM2 blocks, what the host tier had here)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    prompts = make_prompts(LLM(MODEL, num_blocks=64), args.groups, args.prefix_tokens, args.rounds, args.seed)
    roomy_blocks = len(prompts) * (len(prompts[0]) // 16 + 2) + 64
    configs = (("without", args.num_blocks, 0.0), ("with", args.num_blocks, args.kv_store_gb),
               ("roomy", roomy_blocks, 0.0))
    runs: dict[str, list[dict[str, object]]] = {name: [] for name, _, _ in configs}
    for repeat in range(args.repeats):
        for name, num_blocks, store_gb in configs[:: 1 if repeat % 2 == 0 else -1]:
            result = run(args, num_blocks, store_gb, prompts)
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
                  "num_blocks": args.num_blocks, "kv_store_gb": args.kv_store_gb, "repeats": args.repeats,
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
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
