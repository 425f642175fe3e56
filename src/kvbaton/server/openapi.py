"""The OpenAPI 3.1 document the router serves at /openapi.json: every route, with the request bodies its parsers read.

The generation routes parse their bodies by hand (`server/protocol.py`) and are answered outside
FastAPI's routing (`RouterApp`), so FastAPI cannot describe them; this module does, field by field, as
`protocol.py`, `protocol_structured.py` and `tool_calls.py` read them (`tests/server/test_openapi.py`
checks that every field they read is here). Ranges are the parsers' own (`MAX_LOGPROBS`, the batch limits,
the served context length). Unknown fields are allowed, as the parsers ignore them. Every error is OpenAI's
`{"error": {message, type, param, code}}`; with API keys, every route but the open ones names the bearer
scheme. A client or a fuzzer (schemathesis, `tests/server/test_fuzz_api.py`) can work from it alone.
"""

from __future__ import annotations

from typing import Any

from kvbaton.core.sampling import MAX_LOGPROBS
from kvbaton.server.protocol import MAX_BATCH_PROMPTS, MAX_BATCH_SAMPLES

Schema = dict[str, Any]

_ERROR: Schema = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
_ERROR_STATUSES = {"400": "invalid request", "401": "missing or wrong API key", "403": "the key's role may not",
                   "404": "unknown model or path", "405": "method not allowed", "429": "queue full or SLO admission",
                   "503": "no worker can take it now"}


def _nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


def _int(minimum: int | None = None, maximum: int | None = None) -> Schema:
    schema: Schema = {"type": "integer"}
    if minimum is not None:
        schema["minimum"] = minimum
    if maximum is not None:
        schema["maximum"] = maximum
    return _nullable(schema)


_NUMBER = _nullable({"type": "number"})
_BOOL = _nullable({"type": "boolean"})
_STRING = _nullable({"type": "string"})
_OBJECT = _nullable({"type": "object"})
_TOKEN_IDS: Schema = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_CHOICES: Schema = {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}}
_EMPTY: Schema = {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]}


def _sampling(model_name: str, max_model_len: int) -> Schema:
    """Fields both generation routes read (`protocol._sampling` and friends)."""
    return {
        "model": {"enum": [model_name, None]},
        "max_tokens": _int(0, max_model_len),
        "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 100}),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _int(-1),
        "min_p": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
        "min_tokens": _int(0, max_model_len),
        "seed": _int(),
        "stop": _nullable({"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"},
                                                            "maxItems": 4}]}),
        "stop_token_ids": _nullable(_TOKEN_IDS),
        "ignore_eos": _BOOL, "include_stop_str_in_output": _BOOL, "skip_special_tokens": _BOOL,
        "n": _int(1, MAX_BATCH_SAMPLES), "best_of": _int(1, MAX_BATCH_SAMPLES),
        "presence_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
        "frequency_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
        "repetition_penalty": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 10}),
        "logit_bias": _nullable({"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
                                 "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}),
        "priority": _int(),
        "stream": _BOOL,
        "stream_options": _nullable({"type": "object", "properties": {"include_usage": _BOOL,
                                                                      "continuous_usage_stats": _BOOL}}),
        "user": _STRING,
        "truncate_prompt_tokens": _nullable({"anyOf": [{"const": -1}, {"type": "integer", "minimum": 1,
                                                                       "maximum": max_model_len}]}),
        "cache_salt": _nullable({"type": "string", "minLength": 1}),
        "prompt_logprobs": _int(0, MAX_LOGPROBS),
        # Structured outputs (protocol_structured.py): at most one of these constrains the output.
        "response_format": _nullable({"type": "object", "required": ["type"], "properties": {
            "type": {"enum": ["text", "json_object", "json_schema"]},
            "json_schema": {"type": "object", "properties": {"name": {"type": "string"},
                                                             "schema": {"type": "object"}}}}}),
        "structured_outputs": _nullable({"type": "object", "minProperties": 1, "maxProperties": 1, "properties": {
            "json": {"type": "object"}, "regex": {"type": "string", "minLength": 1}, "choice": _CHOICES,
            "grammar": {"type": "string"}, "json_object": {"const": True}}, "additionalProperties": False}),
        "guided_json": _OBJECT, "guided_regex": _nullable({"type": "string", "minLength": 1}),
        "guided_choice": _nullable(_CHOICES), "guided_grammar": _STRING,
        # vLLM and legacy OpenAI fields kvbaton refuses by name (400, code unsupported_parameter) unless left at
        # their default (protocol._refuse_unsupported): the document admits the defaults only.
        "use_beam_search": {"enum": [False, None]}, "allowed_token_ids": _EMPTY, "bad_words": _EMPTY,
        "return_tokens_as_token_ids": {"enum": [False, None]}, "logits_processors": _EMPTY,
        "length_penalty": {"enum": [1.0, None]}, "guided_whitespace_pattern": {"type": "null"},
        "structural_tag": {"type": "null"}, "functions": _EMPTY, "function_call": {"enum": [None, ""]},
        "suffix": {"enum": [None, ""]},
    }


_TEXT_PART: Schema = {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"const": "text"}, "text": {"type": "string"}}}
_TOOL_CALL: Schema = {"type": "object", "required": ["function"], "properties": {
    "id": {"type": "string"}, "type": {"const": "function"},
    "function": {"type": "object", "required": ["name", "arguments"], "properties": {
        "name": {"type": "string"}, "arguments": {"anyOf": [{"type": "string"}, {"type": "object"}]}}}}}
# model/chat_template.py `validated_messages`: a string or text parts (it also takes null beside tool_calls).
_MESSAGE: Schema = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"type": "string", "minLength": 1},
    "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]},
    "name": {"type": "string"}, "tool_calls": _nullable({"type": "array", "items": _TOOL_CALL}),
    "tool_call_id": {"type": "string"}}}
_TOOL: Schema = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": {"type": "string"},
        "parameters": {"type": "object"}}}}}
_TEMPLATE_FIELDS: Schema = {
    "add_generation_prompt": _BOOL, "continue_final_message": _BOOL,
    "chat_template_kwargs": _nullable({"type": "object",
                                       "propertyNames": {"pattern": "^[A-Za-z_][A-Za-z0-9_]*$"}}),
    "documents": _nullable({"type": "array", "items": {"type": "object"}}),
    "tools": _nullable({"type": "array", "items": _TOOL}),
}


def _completion_body(model_name: str, max_model_len: int) -> Schema:
    prompt = {"anyOf": [{"type": "string", "minLength": 1}, {**_TOKEN_IDS, "minItems": 1},
                        {"type": "array", "minItems": 1, "maxItems": MAX_BATCH_PROMPTS,
                         "items": {"type": "string", "minLength": 1}},
                        {"type": "array", "minItems": 1, "maxItems": MAX_BATCH_PROMPTS,
                         "items": {**_TOKEN_IDS, "minItems": 1}}]}
    return {"type": "object", "required": ["prompt"], "properties": {
        **_sampling(model_name, max_model_len), "prompt": prompt, "echo": _BOOL, "logprobs": _int(0, MAX_LOGPROBS)}}


def _chat_body(model_name: str, max_model_len: int) -> Schema:
    return {"type": "object", "required": ["messages"], "properties": {
        **_sampling(model_name, max_model_len), **_TEMPLATE_FIELDS,
        "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
        "tool_choice": _nullable({"anyOf": [{"enum": ["none", "auto", "required"]}, {
            "type": "object", "required": ["type", "function"], "properties": {
                "type": {"const": "function"}, "function": {"type": "object", "required": ["name"],
                                                            "properties": {"name": {"type": "string"}}}}}]}),
        "parallel_tool_calls": _BOOL, "logprobs": _BOOL, "top_logprobs": _int(0, MAX_LOGPROBS),
        "max_completion_tokens": _int(1, max_model_len), "chat_template": {"type": "null"}}}


_TEXT_PARTS: Schema = {"type": "array", "items": {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"enum": ["input_text", "output_text", "text"]}, "text": {"type": "string"}}}}
_RESPONSES_ITEM: Schema = {"anyOf": [
    {"type": "object", "required": ["role", "content"], "properties": {
        "type": {"const": "message"}, "role": {"enum": ["user", "assistant", "system", "developer"]},
        "content": {"anyOf": [{"type": "string"}, _TEXT_PARTS]}}},
    {"type": "object", "required": ["type", "call_id", "name", "arguments"], "properties": {
        "type": {"const": "function_call"}, "call_id": {"type": "string", "minLength": 1},
        "name": {"type": "string", "minLength": 1}, "arguments": {"type": "string"}, "id": {"type": "string"}}},
    {"type": "object", "required": ["type", "call_id", "output"], "properties": {
        "type": {"const": "function_call_output"}, "call_id": {"type": "string", "minLength": 1},
        "output": {"anyOf": [{"type": "string"}, _TEXT_PARTS]}}}]}
_RESPONSES_TOOL: Schema = {"type": "object", "required": ["type", "name"], "properties": {
    "type": {"const": "function"}, "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
    "description": {"type": "string"}, "parameters": {"type": "object"}, "strict": _BOOL}}


def _responses_body(model_name: str, max_model_len: int) -> Schema:
    """`responses_protocol.parse_responses_request`, and the sampling fields it passes on to the chat parser."""
    sampling = _sampling(model_name, max_model_len)
    passed = {name: sampling[name] for name in ("model", "temperature", "top_p", "top_k", "min_p", "min_tokens",
                                                 "seed", "stop", "stop_token_ids", "repetition_penalty",
                                                 "presence_penalty", "frequency_penalty", "cache_salt", "priority",
                                                 "skip_special_tokens", "ignore_eos", "user", "stream")}
    return {"type": "object", "required": ["input"], "properties": {
        **passed,
        "input": {"anyOf": [{"type": "string", "minLength": 1},
                            {"type": "array", "minItems": 1, "items": _RESPONSES_ITEM}]},
        "instructions": _STRING, "previous_response_id": _nullable({"type": "string", "minLength": 1}),
        "store": _BOOL, "max_output_tokens": _int(1, max_model_len), "parallel_tool_calls": _BOOL,
        "metadata": _nullable({"type": "object", "maxProperties": 16,
                               "additionalProperties": {"type": "string", "maxLength": 512}}),
        "tools": _nullable({"type": "array", "items": _RESPONSES_TOOL}),
        "tool_choice": _nullable({"anyOf": [{"enum": ["none", "auto", "required"]}, {
            "type": "object", "required": ["type", "name"], "properties": {
                "type": {"const": "function"}, "name": {"type": "string"}}}]}),
        "text": _nullable({"type": "object", "properties": {"format": {"type": "object", "required": ["type"],
                                                                       "properties": {
            "type": {"enum": ["text", "json_object", "json_schema"]}, "name": {"type": "string"},
            "schema": {"type": "object"}, "strict": _BOOL, "description": {"type": "string"}}}}}),
        "truncation": {"enum": ["disabled", None]}, "background": {"enum": [False, None]},
        "conversation": {"type": "null"}, "prompt": {"type": "null"}, "top_logprobs": {"enum": [0, None]}}}


_RESPONSE: Schema = {"type": "object", "required": ["id", "object", "created_at", "status", "output"], "properties": {
    "id": {"type": "string"}, "object": {"const": "response"}, "created_at": {"type": "integer"},
    "status": {"type": "string"}, "output": {"type": "array", "items": {"type": "object"}}, "usage": _OBJECT}}
_RESPONSE_ID: Schema = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}


def _tokenize_body(model_name: str) -> Schema:
    return {"type": "object", "anyOf": [{"required": ["prompt"]}, {"required": ["messages"]}], "properties": {
        "model": {"enum": [model_name, None]}, "prompt": {"type": "string"},
        "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
        "add_special_tokens": _BOOL, "return_token_strs": _BOOL, **_TEMPLATE_FIELDS}}


def _detokenize_body(model_name: str) -> Schema:
    return {"type": "object", "required": ["tokens"], "properties": {
        "model": {"enum": [model_name, None]}, "tokens": _TOKEN_IDS}}


_GENERATED: Schema = {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
    "id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"},
    "model": {"type": "string"}, "choices": {"type": "array", "items": {"type": "object"}},
    "usage": _OBJECT}}


# One server-sent event of a stream, as OpenAPI before 3.2 has a text/event-stream's `schema` describe each event
# (3.2's `itemSchema`): its data (a JSON chunk, or [DONE]) and, for /v1/responses, the event's type.
_SSE_EVENT: Schema = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}


def _json(schema: Schema) -> Schema:
    return {"application/json": {"schema": schema}}


def _operation(summary: str, ok: Schema, body: Schema | None = None, *, open_route: bool = False,
               stream: bool = False, with_keys: bool = False, media_type: str = "application/json") -> Schema:
    ok_content = {media_type: {"schema": ok}}
    if stream:
        ok_content["text/event-stream"] = {"schema": _SSE_EVENT}
    errors = {status: {"description": why, "content": _json(_ERROR)} for status, why in _ERROR_STATUSES.items()
              if (with_keys and not open_route) or status not in ("401", "403")}
    operation: Schema = {"summary": summary, "responses": {"200": {"description": "OK", "content": ok_content},
                                                           **errors}}
    if body is not None:
        operation["requestBody"] = {"required": True, "content": _json(body)}
    if open_route and with_keys:
        operation["security"] = []
    return operation


def openapi_document(model_name: str, max_model_len: int, *, with_keys: bool = False,
                     metrics_open: bool = True) -> Schema:
    """The document for a router serving `model_name` with contexts up to `max_model_len` tokens; `with_keys`:
    it takes API keys (and /metrics needs one unless `metrics_open`)."""
    op: dict[str, Any] = {"with_keys": with_keys}
    text = {"type": "string"}
    paths = {
        "/v1/completions": {"post": _operation("OpenAI completions (vLLM's extensions)", _GENERATED,
                                               _completion_body(model_name, max_model_len), stream=True, **op)},
        "/v1/chat/completions": {"post": _operation("OpenAI chat completions (vLLM's extensions)", _GENERATED,
                                                    _chat_body(model_name, max_model_len), stream=True, **op)},
        "/v1/responses": {"post": _operation("OpenAI Responses (previous_response_id, function calls, text.format)",
                                             _RESPONSE, _responses_body(model_name, max_model_len), stream=True,
                                             **op)},
        "/v1/responses/{response_id}": {
            "get": {**_operation("a stored response (its tenant's only)", _RESPONSE, **op),
                    "parameters": [_RESPONSE_ID]},
            "delete": {**_operation("delete a stored response", {"type": "object", "required": ["id", "deleted"]},
                                    **op), "parameters": [_RESPONSE_ID]}},
        "/tokenize": {"post": _operation("vLLM's /tokenize", {"type": "object"}, _tokenize_body(model_name), **op)},
        "/detokenize": {"post": _operation("vLLM's /detokenize", {"type": "object"}, _detokenize_body(model_name),
                                           **op)},
        "/v1/models": {"get": _operation("the served model", {"type": "object"}, **op)},
        "/reset_prefix_cache": {"post": _operation("empty every worker's prefix cache (admin)", {"type": "object"},
                                                   **op)},
        "/cluster": {"get": _operation("workers, pools and counters (admin)", {"type": "object"}, **op)},
        "/health": {"get": _operation("the router process is up", {"type": "object"}, open_route=True, **op)},
        "/ready": {"get": _operation("some worker serves", {"type": "object"}, open_route=True, **op)},
        "/metrics": {"get": _operation("Prometheus metrics", text, open_route=metrics_open, media_type="text/plain",
                                       **op)},
        "/dashboard": {"get": _operation("the live dashboard's page (its data: /dashboard/data)", text,
                                         open_route=True, media_type="text/html", **op)},
        "/dashboard/data": {"get": _operation("the dashboard's data: workers and recent traffic (admin)",
                                              {"type": "object", "required": ["workers", "recent"]}, **op)},
    }
    document: Schema = {"openapi": "3.1.0", "info": {"title": "kvbaton", "version": "0.1.0",
                                                     "description": f"serving {model_name}"}, "paths": paths}
    if with_keys:
        document["components"] = {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}
        document["security"] = [{"bearer": []}]
    return document
