"""Tool calling on the chat endpoint, as vLLM serves it: forced calls for any model, "auto" with a parser.

`tools` (OpenAI's function list) go to the chat template, which may render them. With `tool_choice`
naming a function, the output is constrained to that function's `parameters` schema and returned as
one tool call whose `arguments` are the generated JSON (finish reason "stop", as OpenAI's forced calls);
with "required", to a JSON array of one or more {"name", "parameters"} objects of the given tools
(at most one when `parallel_tool_calls` is false), returned as tool calls (finish reason "tool_calls").
Those constraints are structured-output grammars (`engine/structured.py`), so they also hold through a
prefill -> decode handoff. "none" (the default without tools) ignores the tools. "auto" (the default with
tools) lets the model decide in its own tool-call syntax, which only a parser for that syntax can read:
`kvbaton serve --tool-call-parser NAME` reads it with vLLM's parser of that name (`server/tool_parsers.py`:
hermes, mistral, llama3_json, qwen3_xml); without a parser "auto" is refused, as vLLM refuses it without
`--tool-call-parser`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

from kvbaton.core.errors import InvalidRequestError
from kvbaton.engine.structured import grammar_for
from kvbaton.server.tool_parsers import PARSERS, arguments_json, chat_call, new_call_id

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names


@dataclass(frozen=True, slots=True)
class ToolUse:
    """What a chat request asks of its tools: the grammar that forces the call, and how to read the output."""

    mode: str  # "named" | "required" | "auto" (read by the parser)
    name: str  # the forced function (mode "named")
    grammar: str  # "" in mode "auto"
    parser: str = ""  # mode "auto": the tool_parsers.PARSERS name that reads the output
    tools: tuple[Mapping[str, object], ...] = ()  # mode "auto": the request's tools (their parameters' types)


TOOL_CALL_PARSERS = tuple(PARSERS)


def parse_tool_use(body: Mapping[str, object], parser: str = "") -> tuple[tuple[Mapping[str, object], ...],
                                                                        ToolUse | None]:
    """(tools for the chat template, how the output is read or None); InvalidRequestError names the field first.
    `parser`: the server's tool-call parser ("" for none), which "auto" needs."""
    tools = parse_tools(body.get("tools"))
    choice = body.get("tool_choice")
    if choice is not None and not tools:
        raise InvalidRequestError("tool_choice is only allowed when tools are given")
    if not tools or choice == "none":
        return (), None
    if (choice is None or choice == "auto") and parser:
        return tools, ToolUse("auto", "", "", parser, tools)
    if choice is None or choice == "auto":
        raise InvalidRequestError(
            "tool_choice 'auto' (the default with tools) needs a parser for the model's own tool-call syntax "
            "(kvbaton serve --tool-call-parser hermes, for models that write <tool_call> blocks); set tool_choice "
            "to 'required' or to {'type': 'function', 'function': {'name': ...}}")
    parallel = body.get("parallel_tool_calls")
    parallel = True if parallel is None else parallel  # null is the default, as everywhere in the API
    if not isinstance(parallel, bool):
        raise InvalidRequestError("parallel_tool_calls must be a boolean")
    schemas = {tool["function"]["name"]: tool["function"].get("parameters") or {"type": "object"}  # type: ignore[index]
               for tool in tools}
    if choice == "required":
        call = {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                           "required": ["name", "parameters"], "additionalProperties": False}
                          for name, schema in schemas.items()]}
        array = {"type": "array", "items": call, "minItems": 1, **({} if parallel else {"maxItems": 1})}
        return tools, ToolUse("required", "", _grammar(array))
    name = _named(choice)
    if name not in schemas:
        raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the tools")
    return tools, ToolUse("named", name, _grammar(schemas[name]))


def tool_calls_of(use: ToolUse, text: str) -> list[dict[str, object]] | None:
    """The forced calls (mode "named" or "required") the output `text` makes, in OpenAI's shape; None when it is
    not a complete call (the output was cut by max_tokens), which the caller returns as plain content. Mode
    "auto" is read by its parser (`message_of`)."""
    if use.mode == "named":
        try:
            json.loads(text)
        except ValueError:
            return None
        return [chat_call(use.name, text)]
    try:
        calls = json.loads(text)
    except ValueError:
        return None
    return [chat_call(call["name"], arguments_json(call["parameters"])) for call in calls]


def hermes_tool_calls(text: str) -> tuple[str | None, list[dict[str, object]] | None]:
    """(content, calls) of a Hermes-style answer (`tool_parsers.HermesParser`)."""
    return PARSERS["hermes"].calls(text, ())


def parse_tools(value: object) -> tuple[Mapping[str, object], ...]:
    """OpenAI's `tools` (function definitions) checked for the chat template; () for none."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidRequestError("tools must be a list of {'type': 'function', 'function': {...}} objects")
    names: set[str] = set()
    for index, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, Mapping) and tool.get("type") == "function" else None
        if not isinstance(function, Mapping):
            raise InvalidRequestError(f"tools[{index}] must be {{'type': 'function', 'function': {{...}}}}")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidRequestError(f"tools[{index}].function.name must be 1-64 letters, digits, '_' or '-'")
        if name in names:
            raise InvalidRequestError(f"tools[{index}].function.name {name!r} is given twice")
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise InvalidRequestError(f"tools[{index}].function.parameters must be a JSON schema object")
    return tuple(value)


def _named(choice: object) -> str:
    function = choice.get("function") if isinstance(choice, Mapping) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str):
        raise InvalidRequestError("tool_choice must be 'none', 'auto', 'required' or "
                                  "{'type': 'function', 'function': {'name': ...}}")
    return name


def _grammar(schema: Mapping[str, object]) -> str:
    try:
        return grammar_for("json_schema", schema)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"tools: a function's parameters are not a usable JSON schema: {exc}") from None


def message_of(use: ToolUse, text: str, finish_reason: str | None) -> tuple[dict[str, object], str | None]:
    """A finished sample's chat message and finish reason: its tool calls when the output is a complete call,
    else (cut by max_tokens; in mode "auto", an answer without complete calls) its text as content. Parsed
    calls end with "tool_calls", as vLLM reports them."""
    if use.mode == "auto":
        content, calls = PARSERS[use.parser].calls(text, use.tools)
        if calls is None:
            return {"role": "assistant", "content": text, "refusal": None}, finish_reason
        return {"role": "assistant", "content": content, "tool_calls": calls, "refusal": None}, "tool_calls"
    calls = tool_calls_of(use, text) if finish_reason == "stop" else None
    if calls is None:
        return {"role": "assistant", "content": text, "refusal": None}, finish_reason
    return ({"role": "assistant", "content": None, "tool_calls": calls, "refusal": None},
            "tool_calls" if use.mode == "required" else finish_reason)


class ToolCallStream:
    """The streamed deltas of tool calls, per choice. A named call opens with its id and name, then each
    piece of text extends its arguments (as vLLM streams one); a "required" list is sent whole when the
    choice ends, since which calls it holds is known only then. In mode "auto" the text streams as content
    as far as the parser knows it is content (up to the first call's marker, a tail that could be its start
    held back), and the calls after it are sent whole at the end. `pieces` returns (delta, finish reason)."""

    def __init__(self, use: ToolUse) -> None:
        self.use = use
        self._call_ids: dict[int, str] = {}
        self._num_sent_chars: dict[int, int] = {}  # mode "auto": content sent per choice

    def pieces(self, index: int, new_text: str, finished: bool, finish_reason: str | None,
               full_text: str) -> list[tuple[dict[str, object], str | None]]:
        out: list[tuple[dict[str, object], str | None]] = []
        if self.use.mode == "auto":
            return self._auto_pieces(index, finished, finish_reason, full_text)
        if self.use.mode == "named":
            if new_text:
                first = index not in self._call_ids
                call_id = self._call_ids.setdefault(index, new_call_id())
                function: dict[str, object] = {"name": self.use.name, "arguments": new_text} if first \
                    else {"arguments": new_text}
                entry: dict[str, object] = {"index": 0, "function": function}
                if first:
                    entry.update(id=call_id, type="function")
                out.append(({"tool_calls": [entry]}, None))
            if finished:
                out.append(({}, finish_reason))
            return out
        if finished:
            message, reason = message_of(self.use, full_text, finish_reason)
            calls = message.get("tool_calls")
            if calls:
                out.append(({"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}, None))  # type: ignore[arg-type]
            elif full_text:
                out.append(({"content": full_text}, None))
            out.append(({}, reason))
        return out

    def _auto_pieces(self, index: int, finished: bool, finish_reason: str | None,
                     full_text: str) -> list[tuple[dict[str, object], str | None]]:
        out: list[tuple[dict[str, object], str | None]] = []
        sent = self._num_sent_chars.get(index, 0)
        parser = PARSERS[self.use.parser]
        if finished:
            _, calls = parser.calls(full_text, self.use.tools)
            end = len(full_text) if calls is None else max(sent, parser.content_end(full_text))
        else:
            end = parser.content_end(full_text)
        if end > sent:
            out.append(({"content": full_text[sent:end]}, None))
            self._num_sent_chars[index] = end
        if finished:
            if calls is not None:
                out.append(({"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}, None))
            out.append(({}, "tool_calls" if calls is not None else finish_reason))
        return out
