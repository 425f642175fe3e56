"""What a structured-output grammar costs a decode step: SmolLM2, one stream, the same chat prompt with and
without a JSON schema (and a regex), time per output token, medians over --repeats alternating runs.

The grammar's cost per step is llguidance computing the next token's mask plus applying it to the logits
row; the ratio constrained / unconstrained TPOT is the figure to quote (the machine is shared and noisy).
Also prints the grammar's first-request setup (llguidance's view of the 49k-token vocabulary, once per
engine) and the mask alone per step. Prints one JSON line.

    .venv/bin/python benchmarks/structured_outputs.py [--model smollm2-135m] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from kvbaton import LLM, SamplingParams
from kvbaton.engine.structured import RequestGrammar, grammar_for, grammar_tokenizer

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "hobbies"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                         "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}}
QUESTION = "Describe a made-up person (name, age, city, hobbies) as JSON."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    llm = LLM(args.model)
    tokenizer = llm.engine.tokenizer
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    vocab = llm.engine.loaded.config.vocab_size
    started = time.perf_counter()
    grammar_tokenizer(tokenizer, vocab)
    setup_s = time.perf_counter() - started
    runs = {
        "none": SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True),
        "json_schema": SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                      grammar=grammar_for("json_schema", SCHEMA)),
        "regex": SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                grammar=grammar_for("regex", r"[A-Z][a-z]+ is [0-9]{2} and lives in [A-Z][a-z]+\.")),
    }
    llm.generate(prompt, runs["json_schema"])  # warm-up (and the engine's own grammar tokenizer)
    tpot: dict[str, list[float]] = {name: [] for name in runs}
    texts: dict[str, str] = {}
    for _ in range(args.repeats):
        for name, params in runs.items():
            result = llm.generate(prompt, params)[0]
            tpot[name].append(result.tpot_s)
            texts[name] = result.outputs[0].text
    # The mask alone: a fresh matcher over the JSON output, one mask per token of it.
    token_ids = tokenizer.encode(texts["json_schema"])
    grammar = RequestGrammar(grammar_tokenizer(tokenizer, vocab), runs["json_schema"].grammar)
    started = time.perf_counter()
    for token in token_ids:
        grammar.allowed()
        grammar.consume(token)
    mask_us = 1e6 * (time.perf_counter() - started) / max(len(token_ids), 1)
    medians = {name: statistics.median(values) for name, values in tpot.items()}
    print(json.dumps({
        "benchmark": "structured_outputs", "model": args.model, "repeats": args.repeats,
        "tpot_ms": {name: round(1e3 * value, 2) for name, value in medians.items()},
        "ratio_over_unconstrained": {name: round(value / medians["none"], 3) for name, value in medians.items()
                                     if name != "none"},
        "mask_and_consume_us_per_token": round(mask_us, 1), "grammar_tokenizer_setup_s": round(setup_s, 3),
        "outputs": texts,
    }))


if __name__ == "__main__":
    main()
