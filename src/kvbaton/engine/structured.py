"""Structured outputs: a grammar (JSON schema, regex, choice list, Lark/GBNF) masks a request's logits every step.

Built on llguidance, one of vLLM's structured-output backends. `grammar_for(kind, spec)` turns an API
constraint into an llguidance grammar string; the router does it at ingress (a bad schema or regex is a
400 there) and `SamplingParams.grammar` carries the string to the workers. Each engine builds one
`LLTokenizer` over its own tokenizer on its first such request (~0.4 s for SmolLM2's 49k tokens), and a
`RequestGrammar` per request: a matcher that has consumed exactly the request's output tokens, so it
gives the mask of the next step. A prefill worker's matcher consumes the first token it samples; the
decode worker that adopts the request builds its own and consumes that token again.

As in vLLM, the mask applies to the logits before anything else (logprobs included), JSON is generated
without free whitespace (a small model otherwise tends to pad with newlines), and a request ends with
finish reason "stop" as soon as its grammar is complete.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import llguidance
import torch

from kvbaton.core.errors import InvalidRequestError
from kvbaton.model.tokenizer import Tokenizer

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# JSON without free whitespace between tokens, "," and ":" as separators (vLLM's --disable-any-whitespace).
_JSON_OPTIONS = {"whitespace_flexible": False}
_SHIFTS = torch.arange(32, dtype=torch.int32)


def grammar_for(kind: str, spec: object) -> str:
    """The llguidance grammar of one constraint; InvalidRequestError names what is wrong with `spec`.

    kind: "json_schema" (a schema object, or its JSON text), "json_object" (any JSON object; `spec`
    unused), "regex" (Rust regex syntax, matched in full), "choice" (a list of strings: the output is
    one of them), "grammar" (a Lark grammar, or GBNF as llama.cpp writes it)."""
    try:
        if kind == "json_schema":
            if isinstance(spec, str):
                spec = json.loads(spec)
            if not isinstance(spec, Mapping):
                raise InvalidRequestError("a JSON schema must be an object")
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(spec), defaults=_JSON_OPTIONS)
        elif kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
        elif kind == "regex":
            if not isinstance(spec, str) or not spec:
                raise InvalidRequestError("a regex must be a non-empty string")
            grammar = llguidance.LLMatcher.grammar_from_regex(spec)
        elif kind == "choice":
            if (not isinstance(spec, list) or not spec
                    or any(not isinstance(choice, str) or not choice for choice in spec)):
                raise InvalidRequestError("choice must be a non-empty list of non-empty strings")
            grammar = llguidance.grammar_from("choice", spec)  # type: ignore[arg-type]
        elif kind == "grammar":
            if not isinstance(spec, str) or not spec.strip():
                raise InvalidRequestError("a grammar must be a non-empty string")
            grammar = llguidance.grammar_from("grammar", spec)
        else:
            raise InvalidRequestError(f"unknown structured output kind {kind!r}; one of {', '.join(KINDS)}")
    except (ValueError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
        raise InvalidRequestError(f"invalid {kind.replace('_', ' ')}: {exc}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidRequestError(f"invalid {kind.replace('_', ' ')}: {error.strip()}")
    return grammar


def grammar_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of `tokenizer` over the model's `vocab_size` logits (costly: build it once)."""
    return llguidance.LLTokenizer(tokenizer.backend_json(), n_vocab=vocab_size, eos_token=tokenizer.eos_token_id)


class RequestGrammar:
    """One request's matcher: `allowed()` is the mask of its next token; `consume()` the token it got."""

    __slots__ = ("_matcher", "_vocab_size")

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> None:
        self._matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        self._vocab_size = tokenizer.vocab_size
        if self._matcher.is_error():
            raise InvalidRequestError(f"structured output grammar: {self._matcher.get_error()}")

    def allowed(self) -> torch.Tensor:
        """[vocab] bool: the tokens the grammar lets come next (the end-of-sequence token once it is complete)."""
        words = torch.frombuffer(bytearray(self._matcher.compute_bitmask()), dtype=torch.int32)
        return ((words.unsqueeze(1) >> _SHIFTS) & 1).view(-1)[: self._vocab_size].bool()

    def consume(self, token_id: int) -> str:
        """Advance past `token_id`; returns "" or why the grammar cannot take it."""
        if self._matcher.consume_token(token_id):
            return ""
        return self._matcher.get_error() or f"token {token_id} does not fit the grammar"

    @property
    def complete(self) -> bool:
        """The grammar is satisfied and takes no more tokens (only end-of-sequence would fit)."""
        return self._matcher.is_stopped()
