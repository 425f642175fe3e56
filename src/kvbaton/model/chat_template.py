"""Chat templates as transformers renders them: the sandboxed Jinja environment (its `tojson`, `raise_exception`
and `strftime_now`), the OpenAI-style messages a template may be given, and the sentinel that marks where the
final message ends (`Tokenizer.apply_chat_template`'s continue_final_message)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from functools import lru_cache

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvbaton.core.errors import InvalidRequestError


def _raise_template_exception(message: str) -> None:
    raise InvalidRequestError(f"chat template rejected the messages: {message}")


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters, which changes prompts; templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    # Some templates (Llama 3.x) print today's date; this is model-layer formatting, never policy.
    return time.strftime(fmt)


@lru_cache(maxsize=8)
def compile_chat_template(source: str) -> jinja2.Template:
    """The environment transformers renders chat templates in, so prompts match it byte for byte."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_template_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def validated_messages(messages: object) -> list[dict[str, object]]:
    """OpenAI-style messages with string contents; text parts (`[{"type": "text", ...}]`) are joined, and an
    assistant message that only makes tool calls (content null) gets "" (its `tool_calls` go to the template)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {'role', 'content'} objects")
    validated: list[dict[str, object]] = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"messages[{index}] must be an object, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"messages[{index}].role must be a non-empty string")
        content = message.get("content")
        if content is None and message.get("tool_calls"):
            content = ""
        if isinstance(content, list):
            texts = [part.get("text") for part in content if isinstance(part, Mapping) and part.get("type") == "text"]
            if len(texts) != len(content) or not all(isinstance(text, str) for text in texts):
                raise InvalidRequestError(f"messages[{index}].content parts must all be {{'type': 'text', 'text': str}}")
            content = "".join(texts)  # type: ignore[arg-type]
        if not isinstance(content, str):
            raise InvalidRequestError(f"messages[{index}].content must be a string or a list of text parts")
        _check_tool_calls(message.get("tool_calls"), index)
        validated.append({**message, "content": content})
    return validated


def _check_tool_calls(tool_calls: object, index: int) -> None:
    """An assistant message's earlier tool calls, as chat templates read them: a list of
    {"function": {"name": str, "arguments": str or object}} (None or absent: no calls)."""
    if tool_calls is None:
        return
    where = f"messages[{index}].tool_calls"
    if not isinstance(tool_calls, list):
        raise InvalidRequestError(f"{where} must be a list of tool calls")
    for number, tool_call in enumerate(tool_calls):
        function = tool_call.get("function") if isinstance(tool_call, Mapping) else None
        if (not isinstance(function, Mapping) or not isinstance(function.get("name"), str)
                or not isinstance(function.get("arguments"), str | Mapping)):
            raise InvalidRequestError(f"{where}[{number}] must be {{'type': 'function', 'function': {{'name': str, "
                                      "'arguments': str or object}}}")


def unused_sentinel(text: str) -> str:
    """A marker that occurs nowhere in `text`; its trailing space shows whether a template trimmed it."""
    sentinel = "<|kvbaton_final_message_ends|>"
    while sentinel in text:
        sentinel = sentinel.replace("|>", "_|>")
    return sentinel + " "
