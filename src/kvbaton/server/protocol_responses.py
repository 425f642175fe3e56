"""Response pieces of the OpenAI-compatible API, in OpenAI's shapes so the official client parses them: usage,
the logprobs objects of completions (echoed prompt included) and chat, with tokens spelled by their bytes, a
server-sent event, and the orjson-rendered JSON response."""

from __future__ import annotations

import json
from collections.abc import Sequence

import orjson
from fastapi.responses import JSONResponse

from kvbaton.core.step import SampledToken
from kvbaton.model.tokenizer import Tokenizer, bytes_to_unicode


class FastJSONResponse(JSONResponse):
    """JSONResponse rendered by orjson (several times faster than json.dumps for a completion body)."""

    def render(self, content: object) -> bytes:
        return orjson.dumps(content)


def sse(payload: dict[str, object]) -> str:
    """One server-sent event carrying `payload`."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def usage_json(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> dict[str, object]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


class TokenText:
    """Spells token ids for logprobs: the token's own bytes (not a decode of the whole text)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._id_to_token = tokenizer.id_to_token
        self._byte_of_char = {char: byte for byte, char in bytes_to_unicode().items()}

    def token_bytes(self, token_id: int) -> bytes:
        piece = self._id_to_token(token_id)
        if piece is None:
            return b""
        if all(char in self._byte_of_char for char in piece):  # byte-level BPE spelling
            return bytes(self._byte_of_char[char] for char in piece)
        return piece.encode("utf-8")

    def token_str(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")


MIN_LOGPROB = -9999.0  # what a token a grammar masks out (logprob -inf) is reported as, as vLLM reports it


def _logprob(value: float) -> float:
    """A logprob JSON can carry: -inf (a masked token) becomes MIN_LOGPROB; JSON has no infinities, and OpenAI's
    schema wants a number."""
    return value if value > MIN_LOGPROB else MIN_LOGPROB


def completion_logprobs_json(text: TokenText, logprobs: Sequence[SampledToken],
                             text_offset_chars: int) -> dict[str, object]:
    """The legacy completions shape: parallel lists, text_offset counting chars from the choice's start."""
    tokens: list[str] = []
    offsets: list[int] = []
    offset = text_offset_chars
    for entry in logprobs:
        token = text.token_str(entry.token_id)
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [_logprob(entry.logprob) for entry in logprobs],
        "top_logprobs": [{text.token_str(t): _logprob(lp) for t, lp in entry.top_logprobs} for entry in logprobs],
        "text_offset": offsets,
    }


def echo_logprobs_json(text: TokenText, prompt_ids: Sequence[int], prompt_logprobs: Sequence[SampledToken],
                       completion: dict[str, object]) -> dict[str, object]:
    """Echo with logprobs (lm-eval's loglikelihood request): the prompt's tokens first, each with its logprob
    given those before it (the first has none: null, as OpenAI's), then `completion`'s (completion_logprobs_json
    with its offsets after the echoed prompt)."""
    tokens = [text.token_str(t) for t in prompt_ids]
    offsets = [0]
    for token in tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    missing = [None] * max(len(prompt_ids) - 1 - len(prompt_logprobs), 0)  # a call that ended before its first token
    return {
        "tokens": tokens + completion["tokens"],  # type: ignore[operator]
        "token_logprobs": [None, *(_logprob(entry.logprob) for entry in prompt_logprobs), *missing]
        + completion["token_logprobs"],  # type: ignore[operator]
        "top_logprobs": [None, *({text.token_str(t): _logprob(lp) for t, lp in entry.top_logprobs}
                                 for entry in prompt_logprobs), *missing]
        + completion["top_logprobs"],  # type: ignore[operator]
        "text_offset": offsets + completion["text_offset"],  # type: ignore[operator]
    }


def prompt_logprobs_json(text: TokenText, prompt_logprobs: Sequence[SampledToken],
                         num_prompt_tokens: int) -> list[dict[str, dict[str, object]] | None]:
    """vLLM's `prompt_logprobs`: null for the first prompt token (nothing comes before it), then for each one a
    map from token id to logprob, rank and text: the prompt token's own first, then its top alternatives (ranks
    1..k); null also for positions a call that ended early never scored."""

    def one(token_id: int, logprob: float, rank: int) -> dict[str, object]:
        return {"logprob": _logprob(logprob), "rank": rank, "decoded_token": text.token_str(token_id)}

    scored: list[dict[str, dict[str, object]] | None] = [None]
    for entry in prompt_logprobs:
        ranked = {str(entry.token_id): one(entry.token_id, entry.logprob, entry.rank)}
        for rank, (token_id, logprob) in enumerate(entry.top_logprobs, start=1):
            ranked.setdefault(str(token_id), one(token_id, logprob, rank))
        scored.append(ranked)
    return scored + [None] * max(num_prompt_tokens - len(scored), 0)


def chat_logprobs_json(text: TokenText, logprobs: Sequence[SampledToken], num_top: int) -> dict[str, object]:
    def one(token_id: int, logprob: float) -> dict[str, object]:
        return {"token": text.token_str(token_id), "logprob": _logprob(logprob),
                "bytes": list(text.token_bytes(token_id))}

    return {
        "content": [
            {**one(entry.token_id, entry.logprob),
             "top_logprobs": [one(t, lp) for t, lp in entry.top_logprobs[:num_top]]}
            for entry in logprobs
        ],
        "refusal": None,
    }
