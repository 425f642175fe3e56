"""Structured-output fields of a request: OpenAI's `response_format` and vLLM's `structured_outputs`.

Either one becomes the llguidance grammar that `SamplingParams.grammar` carries to the workers
(`kvbaton.engine.structured.grammar_for`), built and validated here at ingress so that a bad schema,
regex or grammar is a 400 naming the field before any worker sees the request.

- `response_format`: {"type": "text"} (no constraint), {"type": "json_object"}, or
  {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}.
- `structured_outputs` (vLLM): exactly one of {"json": schema}, {"regex": str}, {"choice": [str, ...]},
  {"grammar": Lark or GBNF text}, {"json_object": true}.
- vLLM's older fields, which it took until v0.12 and many clients still send: one of `guided_json`,
  `guided_regex`, `guided_choice`, `guided_grammar`, meaning the same as the `structured_outputs` key
  they name; `guided_decoding_backend` is accepted and ignored (one backend here), as vLLM ignored it
  once it chose backends itself; `guided_whitespace_pattern` is refused (the JSON grammar has no free
  whitespace), as is `structural_tag`. Dropping an unknown field would return unconstrained output.
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


# vLLM's pre-0.12 request fields -> the structured_outputs key each one meant
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
_REFUSED_GUIDED_FIELDS = {
    "guided_whitespace_pattern": "the JSON grammar here writes no free whitespace",
    "structural_tag": "structural tags are not supported",
}
STRUCTURED_FIELDS = ("response_format", "structured_outputs", *GUIDED_FIELDS, *_REFUSED_GUIDED_FIELDS)


def structured_grammar(body: Mapping[str, object]) -> tuple[str, str]:
    """(grammar, the field it came from); ("", "") when the request sets no constraint. Raises
    InvalidRequestError whose message starts with the field's name."""
    for field, reason in _REFUSED_GUIDED_FIELDS.items():
        if body.get(field) is not None:
            raise InvalidRequestError(f"{field} is not supported: {reason}")
    guided = [field for field in GUIDED_FIELDS if body.get(field) is not None]
    if len(guided) > 1:
        raise InvalidRequestError(f"{guided[0]} and {guided[1]} cannot both constrain the output; give one")
    constraints = [(field, grammar) for field, grammar in (
        ("response_format", _response_format(body.get("response_format"))),
        ("structured_outputs", _structured_outputs(body.get("structured_outputs"))),
        *((field, _built(field, _STRUCTURED_KINDS[GUIDED_FIELDS[field]], body[field])) for field in guided),
    ) if grammar]
    if len(constraints) > 1:
        raise InvalidRequestError(f"{constraints[0][0]} and {constraints[1][0]} cannot both constrain the output")
    return (constraints[0][1], constraints[0][0]) if constraints else ("", "")


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
