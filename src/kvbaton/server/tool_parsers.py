"""Readers of the tool-call syntax models write themselves, under vLLM's `--tool-call-parser` names.

Each parser turns a finished answer into (content, calls) — calls in OpenAI's chat shape, None when the
answer holds no complete call (cut by max_tokens, malformed), in which case the whole text is content, as
vLLM's parsers answer — and, for streaming, says how much of an unfinished answer is surely content
(`content_end`): never a partial marker, never the start of a call.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen2.5), text before
  the first block is content.
- `mistral`: after `[TOOL_CALLS]`, a JSON list of {"name", "arguments"} (Mistral tokenizers up to v7), or
  `name[ARGS]{...}` / `name{...}` per `[TOOL_CALLS]` (v11 and later); call ids of 9 letters and digits, as
  Mistral's chat template requires.
- `llama3_json`: an answer that starts with `<|python_tag|>` or `{` holds `{"name": ..., "parameters": {...}}`
  objects separated by `;` (Llama 3.1-3.3's JSON tool calling); any other answer is content.
- `qwen3_xml`: Qwen3-Coder's `<tool_call><function=NAME><parameter=P>value</parameter>...</function></tool_call>`,
  each value read by the type its function's JSON schema gives the parameter (string when it names none).

`[TOOL_CALLS]` and `<|python_tag|>` are special tokens of their models, which a decode skipping special
tokens drops: `KEEPS_SPECIAL_TOKENS` lists the parsers whose requests decode with them kept.
"""

from __future__ import annotations

import json
import os
import re
import string
from collections.abc import Mapping, Sequence

Call = dict[str, object]
Tools = Sequence[Mapping[str, object]]
_ID_CHARS = string.ascii_letters + string.digits


def new_call_id() -> str:
    return f"call_{os.urandom(12).hex()}"


def _mistral_call_id() -> str:
    return "".join(_ID_CHARS[b % len(_ID_CHARS)] for b in os.urandom(9))


def arguments_json(value: object) -> str:
    """A call's arguments as the JSON string OpenAI's shape carries, keeping their characters (as vLLM writes them)."""
    return json.dumps(value, ensure_ascii=False)


def chat_call(name: str, arguments: str, call_id: str = "") -> Call:
    return {"id": call_id or new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _held_tail(text: str, marker: str) -> int:
    """How many chars at the end of `text` could be the start of `marker`."""
    return next((n for n in range(len(marker) - 1, 0, -1) if text.endswith(marker[:n])), 0)


def _name_and_arguments(value: object, arguments_key: str = "arguments") -> tuple[str, str] | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", {}))
    return value["name"], arguments if isinstance(arguments, str) else arguments_json(arguments)


class ToolCallParser:
    """A model's tool-call syntax; subclasses set `name` and `marker` and read the calls after it."""

    name = ""
    marker = ""  # what opens the first call

    def calls(self, text: str, tools: Tools) -> tuple[str | None, list[Call] | None]:
        """(content before the calls, None when blank; the calls), or (text, None) without complete calls."""
        start = text.find(self.marker)
        if start < 0:
            return text, None
        calls = self._read(text[start:], tools)
        if not calls:
            return text, None
        return text[:start].strip() or None, calls

    def content_end(self, text: str) -> int:
        """How many leading chars of an unfinished answer are surely content."""
        start = text.find(self.marker)
        return start if start >= 0 else len(text) - _held_tail(text, self.marker)

    def _read(self, text: str, tools: Tools) -> list[Call] | None:
        """The calls of `text` (which starts with the marker), or None unless all are complete."""
        raise NotImplementedError


class HermesParser(ToolCallParser):
    name = "hermes"
    marker = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def _read(self, text: str, tools: Tools) -> list[Call] | None:
        blocks = self._block.findall(text)
        if text.count(self.marker) != len(blocks):
            return None
        calls = []
        for block in blocks:
            try:
                found = _name_and_arguments(json.loads(block))
            except ValueError:
                return None
            if found is None:
                return None
            calls.append(chat_call(*found))
        return calls


class MistralParser(ToolCallParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    _named = re.compile(r"\s*([A-Za-z0-9_-]{1,64})\s*(?:\[ARGS\])?\s*(\{.*\})\s*$", re.DOTALL)

    def _read(self, text: str, tools: Tools) -> list[Call] | None:
        calls = []
        for segment in text.split(self.marker)[1:]:
            segment = segment.strip()
            if segment.startswith("["):  # the JSON list of the older tokenizers
                try:
                    listed = json.loads(segment)
                except ValueError:
                    return None
                found = [_name_and_arguments(one) for one in listed] if isinstance(listed, list) else [None]
                if not found or None in found:
                    return None
                calls.extend(chat_call(name, arguments, _mistral_call_id())  # type: ignore[misc]
                             for name, arguments in found)
                continue
            match = self._named.match(segment)
            if match is None:
                return None
            try:
                arguments = json.loads(match.group(2))
            except ValueError:
                return None
            calls.append(chat_call(match.group(1), arguments_json(arguments), _mistral_call_id()))
        return calls


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"
    marker = "<|python_tag|>"

    def calls(self, text: str, tools: Tools) -> tuple[str | None, list[Call] | None]:
        start = text.find(self.marker)
        if start < 0:
            if not text.lstrip().startswith("{"):
                return text, None
            start = 0
        calls = self._read(text[start:].removeprefix(self.marker), tools)
        return (text[:start].strip() or None, calls) if calls else (text, None)

    def content_end(self, text: str) -> int:
        start = text.find(self.marker)
        if start >= 0:
            return start
        stripped = text.lstrip()
        if not stripped or stripped.startswith("{") or self.marker.startswith(stripped):
            return 0  # may still become a call: held back whole
        return len(text) - _held_tail(text, self.marker)

    def _read(self, text: str, tools: Tools) -> list[Call] | None:
        decoder = json.JSONDecoder()
        calls: list[Call] = []
        position = 0
        while True:
            while position < len(text) and text[position] in " \t\r\n;":
                position += 1
            if position == len(text):
                return calls or None
            try:
                value, position = decoder.raw_decode(text, position)
            except ValueError:
                return None
            found = _name_and_arguments(value, "parameters")
            if found is None:
                return None
            calls.append(chat_call(*found))


class Qwen3XmlParser(ToolCallParser):
    name = "qwen3_xml"
    marker = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*<function=([^>\s]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
    _parameter = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.DOTALL)

    def _read(self, text: str, tools: Tools) -> list[Call] | None:
        blocks = self._block.findall(text)
        if text.count(self.marker) != len(blocks):
            return None
        schemas = {tool["function"]["name"]: tool["function"].get("parameters") or {}  # type: ignore[index]
                   for tool in tools}
        calls = []
        for name, body in blocks:
            properties = schemas.get(name, {}).get("properties") or {}
            arguments = {key: _typed(value.removeprefix("\n").removesuffix("\n"), properties.get(key))
                         for key, value in self._parameter.findall(body)}
            calls.append(chat_call(name, arguments_json(arguments)))
        return calls


def _typed(value: str, schema: object) -> object:
    """A Qwen3-Coder parameter's text as the type its schema names (as vLLM's qwen3_coder parser converts it)."""
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    kind = next((k for k in kind if k != "null"), None) if isinstance(kind, list) else kind
    if kind is None or kind == "string":
        return value
    if value.strip().lower() == "null":
        return None
    try:
        if kind == "integer":
            return int(value)
        if kind == "number":
            number = float(value)
            return int(number) if number.is_integer() and "." not in value and "e" not in value.lower() else number
        if kind == "boolean":
            return {"true": True, "false": False}[value.strip().lower()]
        return json.loads(value)
    except (ValueError, KeyError):
        return value


PARSERS: dict[str, ToolCallParser] = {parser.name: parser for parser in
                                      (HermesParser(), MistralParser(), Llama3JsonParser(), Qwen3XmlParser())}
KEEPS_SPECIAL_TOKENS = frozenset({"mistral", "llama3_json"})
