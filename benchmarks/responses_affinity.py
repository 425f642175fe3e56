"""Multi-turn conversations on a live cluster: the share of each turn's prompt found cached, with the conversation
held by the server (`/v1/responses` and `previous_response_id`) and with the client resending it (chat completions
with the whole message history), one run.

`kvbaton serve --model MODEL --workers N` (Preble placement); `--conversations` conversations of `--turns` turns,
each turn a short new user message and `--max-tokens` sampled output tokens, the conversations interleaved so the
workers' caches and loads are shared. A Responses turn runs as the previous turn's prompt ids, its generated ids,
then the new tokens (`server/responses_store.py`); a chat turn re-renders and re-tokenizes the whole history, whose
earlier answers need not tokenize back into the ids that were generated. Prints one JSON line: per turn, the mean
of cached / input tokens for each API (progress on stderr).

    .venv/bin/python benchmarks/responses_affinity.py [--model tiny-random --workers 2 --conversations 8 --turns 4]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.server.serve_helpers import serve_process  # noqa: E402

INSTRUCTIONS = "You are a helpful assistant for a travel agency. Answer briefly and stay on topic. " * 3
QUESTIONS = ("Where should I go in spring?", "What about the food there?", "How do I get around?",
             "Is it expensive?", "What should I pack?", "Any festivals?", "Where do I stay?", "Thanks, anything else?")


def run(model: str, num_workers: int, num_conversations: int, num_turns: int, max_tokens: int) -> dict[str, object]:
    ratios: dict[str, list[list[float]]] = {"responses": [[] for _ in range(num_turns)],
                                            "chat": [[] for _ in range(num_turns)]}
    with serve_process(["--model", model, "--workers", str(num_workers), "--num-blocks", "2048",
                        "--drain-timeout", "5"]) as served, \
            openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=300) as client:
        previous: list[str | None] = [None] * num_conversations
        histories: list[list[dict[str, str]]] = [[{"role": "system", "content": f"{INSTRUCTIONS} (chat {c})"}]
                                                 for c in range(num_conversations)]
        for turn in range(num_turns):
            for c in range(num_conversations):
                question = f"{QUESTIONS[turn % len(QUESTIONS)]} (conversation {c})"
                answer = client.responses.create(model=model, instructions=f"{INSTRUCTIONS} (responses {c})",
                                                 input=question, previous_response_id=previous[c],
                                                 max_output_tokens=max_tokens, temperature=1.0, extra_body={"seed": c})
                previous[c] = answer.id
                ratios["responses"][turn].append(answer.usage.input_tokens_details.cached_tokens
                                                 / answer.usage.input_tokens)
                histories[c].append({"role": "user", "content": question})
                chat = client.chat.completions.create(model=model, messages=histories[c], max_tokens=max_tokens,
                                                      temperature=1.0, seed=c)
                histories[c].append({"role": "assistant", "content": chat.choices[0].message.content or ""})
                ratios["chat"][turn].append(chat.usage.prompt_tokens_details.cached_tokens / chat.usage.prompt_tokens)
            print(f"turn {turn + 1} done", file=sys.stderr)
    shares = {api: [round(sum(r) / len(r), 3) for r in per_turn] for api, per_turn in ratios.items()}
    return {"model": model, "num_workers": num_workers, "num_conversations": num_conversations,
            "max_tokens": max_tokens,
            "cached_share_per_turn": shares,
            # Responses (previous_response_id) against chat completions resending the history, same run and prompts
            "responses_over_chat_per_turn": [round(r / c, 3) if c else None
                                             for r, c in zip(shares["responses"], shares["chat"])]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    print(json.dumps(run(args.model, args.workers, args.conversations, args.turns, args.max_tokens)))


if __name__ == "__main__":
    main()
