"""OpenAI's Responses API on the wire: a `/v1/responses` body checked field by field, and the response
object, output items and usage in OpenAI's shapes (so the official client's `responses.create`, `stream`,
`parse` and `retrieve` read them).

A request is run as the chat request it amounts to: `input` (a string, or items: messages, function calls
and their outputs) becomes chat messages, Responses tools (`{"type": "function", "name", "parameters"}`)
and `tool_choice` become chat's, `text.format` a `response_format`, `max_output_tokens` the `max_tokens`;
`parse_chat_request` then builds the sampling, tool use and grammar exactly as for chat. A refusal names
the Responses field (`input[2].call_id`, `text.format`, `max_output_tokens`), not the chat one it became.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvbaton.server.protocol import ApiError, ChatRequest, bad_request, parse_chat_request

# vLLM's sampling extensions a Responses body may carry, read as the chat endpoint reads them.
_PASSED_THROUGH = ("seed", "top_k", "min_p", "min_tokens", "stop", "stop_token_ids", "repetition_penalty",
                   "presence_penalty", "frequency_penalty", "cache_salt", "priority", "skip_special_tokens",
                   "ignore_eos", "user", "temperature", "top_p", "parallel_tool_calls", "stream", "model")
_REFUSED = {"background": "background responses are not supported",
            "conversation": "conversations objects are not supported; chain turns with previous_response_id",
            "prompt": "reusable prompt templates are not supported"}
_CHAT_TO_RESPONSES = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}
_TEXT_PART_TYPES = ("input_text", "output_text", "text")
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    input_messages: tuple[Mapping[str, object], ...]  # the new input as chat messages
    instructions: str | None
    previous_response_id: str | None
    store: bool
    stream: bool
    metadata: Mapping[str, str]
    max_output_tokens: int | None
    tools: tuple[Mapping[str, object], ...]  # as given (Responses shape), echoed in the response
    tool_choice: object  # as given, echoed ("auto" when tools are given without one)
    text_format: Mapping[str, object]  # as given, echoed ({"type": "text"} by default)
    chat_body: Mapping[str, object] = field(default_factory=dict)  # the chat request without its messages


def _id(prefix: str) -> str:
    return f"{prefix}_{os.urandom(16).hex()}"


def new_response_id() -> str:
    return _id("resp")


def _text_of(content: object, where: str) -> str:
    """A message's or output's content: a string, or text parts (input_text, output_text) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of input_text parts", param=where)
    texts = []
    for number, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in _TEXT_PART_TYPES:
            raise bad_request(f"{where}[{number}].type {json.dumps(kind)} is not supported: this server reads "
                              "text parts only (input_text, output_text)", param=f"{where}[{number}].type")
        text = part.get("text")  # type: ignore[union-attr]
        if not isinstance(text, str):
            raise bad_request(f"{where}[{number}].text must be a string", param=f"{where}[{number}].text")
        texts.append(text)
    return "".join(texts)


def _string(item: Mapping[str, object], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{where}.{name} must be a non-empty string", param=f"{where}.{name}")
    return value


def input_messages(value: object) -> list[dict[str, object]]:
    """Responses `input` as chat messages: messages by role (developer as system), a run of function calls as
    one assistant message's `tool_calls` (joined to the assistant message just before, as the model wrote
    them in one turn), each function call output as a `tool` message."""
    if isinstance(value, str):
        if not value:
            raise bad_request("input must not be empty", param="input")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request("input must be a non-empty string or a non-empty list of items", param="input")
    messages: list[dict[str, object]] = []
    for index, item in enumerate(value):
        where = f"input[{index}]"
        if not isinstance(item, Mapping):
            raise bad_request(f"{where} must be an object", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise bad_request(f"{where}.role must be one of user, assistant, system, developer",
                                  param=f"{where}.role")
            messages.append({"role": role, "content": _text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            arguments = item.get("arguments")
            if not isinstance(arguments, str):
                raise bad_request(f"{where}.arguments must be a JSON string", param=f"{where}.arguments")
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last["tool_calls"] = [*(last.get("tool_calls") or ()), call]  # type: ignore[misc]
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": _text_of(item.get("output"), f"{where}.output")})
        else:
            raise bad_request(f"{where}.type {json.dumps(kind)} is not supported: give message, function_call or "
                              "function_call_output items", param=f"{where}.type")
    return messages


def _chat_tools(value: object) -> tuple[list[dict[str, object]] | None, tuple[Mapping[str, object], ...]]:
    if value is None:
        return None, ()
    if not isinstance(value, list):
        raise bad_request("tools must be a list of {'type': 'function', 'name': ..., 'parameters': {...}}",
                          param="tools")
    chat = []
    for index, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        if kind != "function":
            raise bad_request(f"tools[{index}].type {json.dumps(kind)} is not supported: function tools only",
                              param=f"tools[{index}].type")
        function = {"name": tool.get("name")}  # type: ignore[union-attr]
        for key in ("description", "parameters"):
            if tool.get(key) is not None:  # type: ignore[union-attr]
                function[key] = tool[key]  # type: ignore[index]
        chat.append({"type": "function", "function": function})
    return chat, tuple(value)


def _chat_tool_choice(value: object) -> object:
    if value is None or value in ("none", "auto", "required"):
        return value
    if isinstance(value, Mapping) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise bad_request("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
                      param="tool_choice")


def _response_format(text: object) -> tuple[dict[str, object] | None, Mapping[str, object]]:
    """(chat's response_format, the format echoed); text.format {"type": "json_schema", "name", "schema"}."""
    if text is None:
        return None, {"type": "text"}
    fmt = text.get("format") if isinstance(text, Mapping) else None
    if not isinstance(text, Mapping) or (fmt is not None and not isinstance(fmt, Mapping)):
        raise bad_request("text must be {'format': {'type': 'text' | 'json_object' | 'json_schema', ...}}",
                          param="text.format")
    if fmt is None or fmt.get("type") == "text":
        return None, {"type": "text"}
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}, fmt
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), Mapping):
            raise bad_request("text.format.schema must be a JSON schema object", param="text.format.schema")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "output",
                                                       "schema": fmt["schema"]}}, fmt
    raise bad_request("text.format.type must be text, json_object or json_schema", param="text.format.type")


def parse_responses_request(body: Mapping[str, object]) -> ResponsesRequest:
    """The Responses fields checked, and the chat body (without messages) the request runs as."""
    for name, reason in _REFUSED.items():
        if body.get(name) not in (None, False):
            raise bad_request(reason, param=name, code="unsupported_parameter")
    if body.get("truncation") not in (None, "disabled"):
        raise bad_request("truncation 'auto' is not supported: a prompt over the context is refused",
                          param="truncation", code="unsupported_parameter")
    if body.get("top_logprobs") not in (None, 0):
        raise bad_request("top_logprobs are not supported on /v1/responses", param="top_logprobs",
                          code="unsupported_parameter")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("instructions must be a string", param="instructions")
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise bad_request("previous_response_id must be a response id string", param="previous_response_id")
    flags = {}
    for name, default in (("store", True), ("stream", False)):
        value = body.get(name)
        if value is not None and not isinstance(value, bool):
            raise bad_request(f"{name} must be a boolean", param=name)
        flags[name] = default if value is None else value
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, Mapping) or len(metadata) > 16 or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in metadata.items())):
        raise bad_request("metadata must map at most 16 keys (up to 64 chars) to strings (up to 512 chars)",
                          param="metadata")
    max_output_tokens = body.get("max_output_tokens")
    if max_output_tokens is not None and (isinstance(max_output_tokens, bool) or not isinstance(max_output_tokens, int)
                                          or max_output_tokens < 1):
        raise bad_request("max_output_tokens must be a positive integer", param="max_output_tokens")
    chat_tools, tools = _chat_tools(body.get("tools"))
    tool_choice = _chat_tool_choice(body.get("tool_choice"))
    response_format, text_format = _response_format(body.get("text"))
    chat_body: dict[str, object] = {name: body[name] for name in _PASSED_THROUGH if body.get(name) is not None}
    chat_body.update(tools=chat_tools, tool_choice=tool_choice, response_format=response_format,
                     max_tokens=max_output_tokens)
    return ResponsesRequest(
        input_messages=tuple(input_messages(body.get("input"))), instructions=instructions,
        previous_response_id=previous, store=flags["store"], stream=flags["stream"],
        metadata=dict(metadata or {}), max_output_tokens=max_output_tokens, tools=tools,
        tool_choice=body.get("tool_choice") if body.get("tool_choice") is not None else ("auto" if tools else "none"),
        text_format=text_format, chat_body=chat_body)


def parse_as_chat(req: ResponsesRequest, messages: Sequence[Mapping[str, object]], served_model: str, *,
                  max_model_len: int, tool_call_parser: str) -> ChatRequest:
    """The chat request `req` runs as, over the whole conversation; a refusal names the Responses field."""
    try:
        return parse_chat_request({**req.chat_body, "messages": list(messages)}, served_model,
                                  max_model_len=max_model_len, tool_call_parser=tool_call_parser)
    except ApiError as exc:
        if exc.param in _CHAT_TO_RESPONSES:
            exc.param = _CHAT_TO_RESPONSES[exc.param]
        exc.message = re.sub(r"\bmax_tokens\b", "max_output_tokens", exc.message)
        exc.message = re.sub(r"\bresponse_format\b", "text.format", exc.message)
        exc.message = exc.message.replace("{'type': 'function', 'function': {'name': ...}}",
                                          "{'type': 'function', 'name': ...}")
        raise


# -- the answer ------------------------------------------------------------------------------------------


def message_item(text: str, status: str = "completed", item_id: str = "") -> dict[str, object]:
    return {"id": item_id or _id("msg"), "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def function_call_item(call: Mapping[str, object], status: str = "completed", item_id: str = "") -> dict[str, object]:
    function = call["function"]
    return {"id": item_id or _id("fc"), "type": "function_call", "status": status, "call_id": call["id"],
            "name": function["name"], "arguments": function["arguments"]}  # type: ignore[index]


def output_items(message: Mapping[str, object]) -> list[dict[str, object]]:
    """A chat message (text and tool calls) as Responses output items: the message, then one item per call."""
    calls = message.get("tool_calls") or ()
    items = [message_item(str(message.get("content") or ""))] if message.get("content") or not calls else []
    return items + [function_call_item(call) for call in calls]  # type: ignore[union-attr]


def usage_of(num_input_tokens: int, num_cached_tokens: int, num_output_tokens: int) -> dict[str, object]:
    return {"input_tokens": num_input_tokens, "input_tokens_details": {"cached_tokens": num_cached_tokens},
            "output_tokens": num_output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": num_input_tokens + num_output_tokens}


def response_object(req: ResponsesRequest, chat: ChatRequest, response_id: str, created_at: int, model: str, *,
                    status: str, output: list[dict[str, object]], usage: Mapping[str, object] | None,
                    incomplete_reason: str = "") -> dict[str, object]:
    sampling = chat.sampling
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status,
        "background": False, "error": None,
        "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
        "output": output, "parallel_tool_calls": req.chat_body.get("parallel_tool_calls", True),
        "previous_response_id": req.previous_response_id, "reasoning": {"effort": None, "summary": None},
        "store": req.store, "temperature": sampling.temperature, "top_p": sampling.top_p,
        "text": {"format": dict(req.text_format)}, "tool_choice": req.tool_choice, "tools": list(req.tools),
        "truncation": "disabled", "usage": dict(usage) if usage is not None else None,
        "user": chat.user or None, "metadata": dict(req.metadata),
    }


def status_of(finish_reason: str | None, has_calls: bool) -> tuple[str, str]:
    """(status, incomplete reason) of a finished answer: cut by max_output_tokens (without a complete call) is
    incomplete, as OpenAI reports it."""
    if finish_reason == "length" and not has_calls:
        return "incomplete", "max_output_tokens"
    if finish_reason == "abort":
        return "incomplete", "cancelled"
    return "completed", ""
