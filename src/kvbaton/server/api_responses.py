"""The Responses endpoint of the router's HTTP layer (`POST /v1/responses`, `GET` and `DELETE
/v1/responses/{id}`), a mixin of `OpenAIServer` (`server/api.py`), whose ingress helpers it calls.

A request continuing a stored response (`previous_response_id`) runs over the whole conversation, its
prompt built as that response's prompt ids, its output ids, then the new turn's tokens
(`responses_store.continued_prompt_ids`): the previous turn's KV is the same token prefix, so the
router's prefix-aware placement weighs the worker holding it on its usual cost terms (a hit there
against that worker's load), and the usage reports the hit as `input_tokens_details.cached_tokens`.
A streamed answer sends OpenAI's typed events, from `response.created` to `response.completed` (which
carries the status, "incomplete" when cut by max_output_tokens).
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, replace

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvbaton.core.errors import InvalidRequestError
from kvbaton.model.tokenizer import Tokenizer
from kvbaton.server.api_run import SampleRun
from kvbaton.server.auth import ApiAuth
from kvbaton.server.protocol import ApiError, ChatRequest, bad_request, parse_json_body
from kvbaton.server.protocol_responses import FastJSONResponse
from kvbaton.server.responses_protocol import (
    ResponsesRequest,
    function_call_item,
    message_item,
    new_response_id,
    output_items,
    parse_as_chat,
    parse_responses_request,
    response_object,
    status_of,
    usage_of,
)
from kvbaton.server.responses_store import ResponseStore, StoredResponse, continued_prompt_ids
from kvbaton.server.tool_calls import message_of
from kvbaton.server.tool_parsers import PARSERS, new_call_id


@dataclass(frozen=True, slots=True)
class _Turn:
    """One Responses request as it runs: what its answer and its stored entry are built from."""

    req: ResponsesRequest
    chat: ChatRequest
    response_id: str
    created_at: int
    owner: str
    messages: tuple[Mapping[str, object], ...]  # the conversation without instructions, the new input last
    prompt_text: str
    prompt_ids: tuple[int, ...]


def _not_found(response_id: str, param: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", param=param, code="response_not_found")


class ResponsesEndpoint:
    """`/v1/responses` (a mixin: `OpenAIServer` holds the state declared here and the helpers it calls)."""

    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    clock: Callable[[], float]
    tool_call_parser: str
    auth: ApiAuth
    responses: ResponseStore

    def _owner(self, request: Request) -> str:
        """Whose stored responses a request may read: its key's tenant (and the client's, when trusted)."""
        header = next((v.decode("latin-1") for k, v in request.scope["headers"] if k == b"x-tenant"), "")
        return self.auth.tenant_of(request.scope, header if self.auth.trust_tenant_header else "", "")

    async def responses_create(self, request: Request) -> Response:
        arrival_at = self.clock()
        req = parse_responses_request(parse_json_body(await request.body()))
        owner = self._owner(request)
        previous = None
        if req.previous_response_id is not None:
            previous = self.responses.get(req.previous_response_id, owner, self.clock())
            if previous is None:
                raise ApiError(404, f"Previous response with id '{req.previous_response_id}' not found.",
                               param="previous_response_id", code="previous_response_not_found")
        messages = (previous.messages if previous is not None else ()) + req.input_messages
        system = ({"role": "system", "content": req.instructions},) if req.instructions else ()
        chat = parse_as_chat(req, system + messages, self.model_name, max_model_len=self.max_model_len,
                             tool_call_parser=self.tool_call_parser)
        try:
            prompt_text = self.tokenizer.apply_chat_template(list(chat.messages), True, tools=chat.tools)
        except InvalidRequestError as exc:
            raise bad_request(str(exc), param="input") from None
        prompt_ids = continued_prompt_ids(self.tokenizer, prompt_text, previous)
        sampling = chat.sampling
        self._check_sampling(sampling)
        if not chat.max_tokens_given:
            sampling = replace(sampling, max_tokens=max(self.max_model_len - len(prompt_ids), 1))
        self._check_context(len(prompt_ids), sampling, "input")
        turn = _Turn(req, replace(chat, sampling=sampling), new_response_id(), int(time.time()), owner, messages,
                     prompt_text, prompt_ids)
        calls = self._calls(turn.response_id, [prompt_ids], sampling, chat.user, request, arrival_at,
                            chat.cache_salt)
        if req.stream:
            run = await self._start(request, calls)
            return self._stream_response(run, self._responses_stream(run, turn), request)
        run = await self._run_to_end(request, calls)
        message, finish_reason = self._answer(turn, run)
        response = self._finish(turn, run, output_items(message), message, finish_reason)
        return FastJSONResponse(response, headers=self._headers(request))

    def _answer(self, turn: _Turn, run: SampleRun) -> tuple[dict[str, object], str | None]:
        sample = run.samples[0]
        if turn.chat.tool_use is None:
            return {"role": "assistant", "content": sample.text}, sample.finish_reason
        message, finish_reason = message_of(turn.chat.tool_use, sample.text, sample.finish_reason)
        message.pop("refusal", None)
        return message, finish_reason

    def _finish(self, turn: _Turn, run: SampleRun, output: list[dict[str, object]], message: dict[str, object],
                finish_reason: str | None) -> dict[str, object]:
        """The completed response object; stored (unless `store` is false) for the next turn and for GET."""
        sample = run.samples[0]
        status, reason = status_of(sample.finish_reason, bool(message.get("tool_calls")))
        usage = usage_of(len(turn.prompt_ids), sample.num_cached_tokens, sample.num_output_tokens)
        response = response_object(turn.req, turn.chat, turn.response_id, turn.created_at, self.model_name,
                                   status=status, output=output, usage=usage, incomplete_reason=reason)
        if turn.req.store and sample.finish_reason in ("stop", "length"):
            entry = StoredResponse(response, turn.owner, turn.messages + (message,), turn.prompt_text,
                                   turn.prompt_ids, tuple(sample.token_ids), self.clock())
            self.responses.put(turn.response_id, entry, self.clock())
        return response

    async def _responses_stream(self, run: SampleRun, turn: _Turn) -> AsyncIterator[str]:
        numbers = itertools.count()

        def event(kind: str, **fields: object) -> str:
            payload = {"type": kind, "sequence_number": next(numbers), **fields}
            return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

        shell = response_object(turn.req, turn.chat, turn.response_id, turn.created_at, self.model_name,
                                status="in_progress", output=[], usage=None)
        use = turn.chat.tool_use
        sample = run.samples[0]
        text_item: dict[str, object] | None = None  # the message item, once opened
        call_item: dict[str, object] | None = None  # a named call's item, opened with its first arguments
        num_sent_chars = 0
        output: list[dict[str, object]] = []

        def open_text() -> list[str]:
            nonlocal text_item
            text_item = message_item("", "in_progress")
            output.append(text_item)
            index = len(output) - 1
            return [event("response.output_item.added", output_index=index, item=text_item),
                    event("response.content_part.added", item_id=text_item["id"], output_index=index,
                          content_index=0, part={"type": "output_text", "text": "", "annotations": []})]

        try:
            yield event("response.created", response=shell)
            yield event("response.in_progress", response=shell)
            async for _, delta in run.deltas():
                if delta.finish_reason == "error":
                    yield event("error", code="generation_failed", message=delta.error or "generation failed",
                                param=None)
                    return
                text = sample.text
                if use is not None and use.mode == "named":
                    if delta.new_text:
                        if call_item is None:
                            call = {"id": new_call_id(), "function": {"name": use.name, "arguments": ""}}
                            call_item = function_call_item(call, "in_progress")
                            output.append(call_item)
                            yield event("response.output_item.added", output_index=len(output) - 1, item=call_item)
                        yield event("response.function_call_arguments.delta", item_id=call_item["id"],
                                    output_index=output.index(call_item), delta=delta.new_text)
                    continue
                if use is None:
                    content_end = len(text)
                elif use.mode == "auto" and not delta.finished:
                    content_end = PARSERS[use.parser].content_end(text)
                else:
                    continue  # "required", or an "auto" answer's end: read whole below
                if content_end > num_sent_chars:
                    if text_item is None:
                        for opened in open_text():
                            yield opened
                    yield event("response.output_text.delta", item_id=text_item["id"],  # type: ignore[index]
                                output_index=output.index(text_item), content_index=0,  # type: ignore[arg-type]
                                delta=text[num_sent_chars:content_end], logprobs=[])
                    num_sent_chars = content_end
            message, finish_reason = self._answer(turn, run)
            for piece in self._stream_end(event, message, output, text_item, call_item, num_sent_chars, open_text):
                yield piece
            response = self._finish(turn, run, output, message, finish_reason)
            # One closing event whatever the status (as vLLM's): the client's stream helper waits for this one.
            yield event("response.completed", response=response)
        finally:
            await run.close()

    def _stream_end(self, event: Callable[..., str], message: Mapping[str, object], output: list[dict[str, object]],
                    text_item: dict[str, object] | None, call_item: dict[str, object] | None, num_sent_chars: int,
                    open_text: Callable[[], list[str]]) -> list[str]:
        """The events closing a streamed answer: its text's rest and done events, then each call's item."""
        pieces: list[str] = []
        content = str(message.get("content") or "")
        calls = list(message.get("tool_calls") or ())  # type: ignore[call-overload]
        if call_item is not None:  # a named call streamed its arguments: its item closes now
            if calls:  # its JSON is whole: the call keeps the id announced when it opened
                calls[0]["id"] = call_item["call_id"]
                call_item.update(arguments=calls[0]["function"]["arguments"], status="completed")
            else:  # cut by max_output_tokens before its JSON was whole
                call_item.update(arguments=content, status="incomplete")
            calls, content = [], ""
        elif text_item is None and (content or not calls):
            pieces += open_text()
            text_item = output[-1]
        if text_item is not None:
            index = output.index(text_item)
            if len(content) > num_sent_chars:
                pieces.append(event("response.output_text.delta", item_id=text_item["id"], output_index=index,
                                    content_index=0, delta=content[num_sent_chars:], logprobs=[]))
            part = {"type": "output_text", "text": content, "annotations": [], "logprobs": []}
            text_item.update(status="completed", content=[part])
            pieces += [event("response.output_text.done", item_id=text_item["id"], output_index=index,
                             content_index=0, text=content, logprobs=[]),
                       event("response.content_part.done", item_id=text_item["id"], output_index=index,
                             content_index=0, part=part),
                       event("response.output_item.done", output_index=index, item=text_item)]
        if call_item is not None:
            index = output.index(call_item)
            pieces += [event("response.function_call_arguments.done", item_id=call_item["id"], output_index=index,
                             name=call_item["name"], arguments=call_item["arguments"]),
                       event("response.output_item.done", output_index=index, item=call_item)]
        for call in calls:
            item = function_call_item(call, "in_progress")
            output.append(item)
            index = len(output) - 1
            pieces += [event("response.output_item.added", output_index=index, item={**item, "arguments": ""}),
                       event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                             delta=item["arguments"]),
                       event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                             name=item["name"], arguments=item["arguments"])]
            item["status"] = "completed"
            pieces.append(event("response.output_item.done", output_index=index, item=item))
        return pieces

    async def responses_retrieve(self, response_id: str, request: Request) -> JSONResponse:
        entry = self.responses.get(response_id, self._owner(request), self.clock())
        if entry is None:
            raise _not_found(response_id, "response_id")
        return JSONResponse(dict(entry.response))

    async def responses_delete(self, response_id: str, request: Request) -> JSONResponse:
        if not self.responses.delete(response_id, self._owner(request), self.clock()):
            raise _not_found(response_id, "response_id")
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})
