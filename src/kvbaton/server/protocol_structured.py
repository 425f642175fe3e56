"""Structured-output fields of a request: OpenAI's `response_format` and vLLM's `structured_outputs`.

Either one becomes the llguidance grammar that `SamplingParams.grammar` carries to the workers
(`kvbaton.engine.structured.grammar_for`), built and validated here at ingress so that a bad schema,
regex or grammar is a 400 naming the field before any worker sees the request.

- `response_format`: {"type": "text"} (no constraint), {"type": "json_object"}, or
  {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}.
- `structured_outputs` (vLLM): exactly one of {"json": schema}, {"regex": str}, {"choice": [str, ...]},
  {"grammar": Lark or GBNF text}, {"json_object": true}.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping

from kvbaton.core.errors import InvalidRequestError
from kvbaton.engine.structured import grammar_for

# vLLM's structured_outputs keys -> grammar_for's kinds
_STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                     "json_object": "json_object"}


def structured_grammar(body: Mapping[str, object]) -> tuple[str, str]:
    """(grammar, the field it came from); ("", "") when the request sets no constraint. Raises
    InvalidRequestError whose message starts with the field's name."""
    from_format = _response_format(body.get("response_format"))
    from_outputs = _structured_outputs(body.get("structured_outputs"))
    if from_format and from_outputs:
        raise InvalidRequestError("response_format and structured_outputs cannot both constrain the output")
    if from_format:
        return from_format, "response_format"
    if from_outputs:
        return from_outputs, "structured_outputs"
    return "", ""


def _response_format(value: object) -> str:
    if value is None:
        return ""
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind == "text":
        return ""
    if kind == "json_object":
        return grammar_for("json_object", None)
    if kind == "json_schema":
        spec = value.get("json_schema")  # type: ignore[union-attr]
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if not isinstance(schema, Mapping):
            raise InvalidRequestError("response_format.json_schema.schema must be a JSON schema object")
        return _built("response_format", "json_schema", schema)
    raise InvalidRequestError("response_format must be {'type': 'text'}, {'type': 'json_object'} or "
                              "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}")


def _structured_outputs(value: object) -> str:
    if value is None:
        return ""
    if not isinstance(value, Mapping):
        raise InvalidRequestError("structured_outputs must be an object")
    unknown = sorted(k for k in value if k not in _STRUCTURED_KINDS)
    if unknown:
        raise InvalidRequestError(f"structured_outputs does not support {', '.join(unknown)}; "
                                  f"give one of {', '.join(_STRUCTURED_KINDS)}")
    given = [k for k, v in value.items() if v is not None and v is not False]
    if len(given) != 1:
        raise InvalidRequestError(f"structured_outputs must set exactly one of {', '.join(_STRUCTURED_KINDS)}")
    key = given[0]
    if key == "json_object" and value[key] is not True:
        raise InvalidRequestError("structured_outputs.json_object must be true")
    return _built("structured_outputs", _STRUCTURED_KINDS[key], value[key])


def _built(field: str, kind: str, spec: object) -> str:
    try:
        # Keys keep the client's order: a schema's property order is the order the output writes them in.
        return _cached_grammar(kind, json.dumps(spec))
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"{field}: {exc}") from None


@functools.lru_cache(maxsize=256)
def _cached_grammar(kind: str, spec_json: str) -> str:
    """`grammar_for` of a constraint seen before, from its JSON text: clients repeat their schemas, and
    building and validating one takes 0.15 ms (a JSON schema) to 0.7 ms (a regex) of the router's CPU."""
    return grammar_for(kind, json.loads(spec_json))
