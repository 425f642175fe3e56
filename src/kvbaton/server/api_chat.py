"""The chat endpoint of the router's HTTP layer (`/v1/chat/completions`), a mixin of `OpenAIServer`
(`server/api.py`), whose ingress helpers it calls: the chat template (with tools and vLLM's template
options), one call per sample, then the answer whole or streamed, with forced tool calls shaped as OpenAI's
`tool_calls` (`server/tool_calls.py`)."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import replace

from fastapi import Request
from fastapi.responses import Response

from kvbaton.core.errors import InvalidRequestError
from kvbaton.model.tokenizer import Tokenizer
from kvbaton.server.api_run import SampleRun
from kvbaton.server.base import TokenDelta
from kvbaton.server.protocol import ApiError, ChatRequest, bad_request, parse_chat_request, parse_json_body
from kvbaton.server.protocol_responses import (
    FastJSONResponse,
    TokenText,
    chat_logprobs_json,
    prompt_logprobs_json,
    sse,
)
from kvbaton.server.tool_calls import ToolCallStream, message_of


class ChatEndpoint:
    """`/v1/chat/completions` (a mixin: `OpenAIServer` holds the state declared here and the helpers it calls)."""

    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    token_text: TokenText
    clock: Callable[[], float]
    tool_call_parser: str  # "" or one of tool_calls.TOOL_CALL_PARSERS, for tool_choice "auto"

    def _chat_prompt_ids(self, messages: Sequence[Mapping[str, object]], add_generation_prompt: bool,
                         tools: Sequence[Mapping[str, object]], continue_final_message: bool,
                         template_kwargs: Mapping[str, object] | None, add_bos: bool = False) -> list[int]:
        """The token ids of a chat as the chat template renders it (the template writes its own BOS, so the
        tokenizer adds none unless asked); a malformed conversation is a 400 naming `messages`."""
        try:
            text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt, tools=tools,
                                                      continue_final_message=continue_final_message,
                                                      template_kwargs=template_kwargs)
        except InvalidRequestError as exc:
            raise bad_request(str(exc), param="messages") from None
        return self.tokenizer.encode(text, add_bos=add_bos)

    async def chat_completions(self, request: Request) -> Response:
        arrival_at = self.clock()
        req = parse_chat_request(parse_json_body(await request.body()), self.model_name,
                                 max_model_len=self.max_model_len, tool_call_parser=self.tool_call_parser)
        prompt_ids = self._truncated(tuple(self._chat_prompt_ids(req.messages, req.add_generation_prompt, req.tools,
                                                                 req.continue_final_message, req.template_kwargs)),
                                     req.truncate_prompt_tokens)
        sampling = req.sampling
        self._check_sampling(sampling)
        if not req.max_tokens_given:  # "as long as the context allows"
            max_tokens = max(self.max_model_len - len(prompt_ids), 1)
            if sampling.min_tokens > max_tokens:
                raise bad_request(f"min_tokens {sampling.min_tokens} exceeds the {max_tokens} tokens the context "
                                  f"leaves after the prompt", param="min_tokens")
            sampling = replace(sampling, max_tokens=max_tokens)
        self._check_context(len(prompt_ids), sampling, "messages")
        api_id = f"chatcmpl-{os.urandom(16).hex()}"
        calls = self._calls(api_id, [prompt_ids], sampling, req.user, request, arrival_at, req.cache_salt)
        created = int(time.time())
        if req.stream:
            run = await self._start(request, calls)
            stream = self._chat_stream(run, req, api_id, created, len(prompt_ids))
            return self._stream_response(run, stream, request)
        run = await self._run_to_end(request, calls)
        choices = []
        for i, sample in enumerate(run.samples):
            message, finish_reason = ({"role": "assistant", "content": sample.text, "refusal": None},
                                      sample.finish_reason) if req.tool_use is None \
                else message_of(req.tool_use, sample.text, sample.finish_reason)
            logprobs = chat_logprobs_json(self.token_text, sample.logprobs, req.top_logprobs) if req.logprobs else None
            choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish_reason})
        body = {"id": api_id, "object": "chat.completion", "created": created, "model": self.model_name,
                "choices": choices, "system_fingerprint": None, "usage": run.usage([len(prompt_ids)])}
        if req.prompt_logprobs:  # vLLM's: the conversation's prompt, once for all the choices
            body["prompt_logprobs"] = prompt_logprobs_json(self.token_text, run.samples[0].prompt_logprobs,
                                                           len(prompt_ids))
        return FastJSONResponse(body, headers=self._headers(request))

    async def _chat_stream(self, run: SampleRun, req: ChatRequest, api_id: str, created: int,
                           num_prompt_tokens: int) -> AsyncIterator[str]:
        head = {"id": api_id, "object": "chat.completion.chunk", "created": created, "model": self.model_name}

        def chunk(index: int, delta: dict[str, object], logprobs: object, finish_reason: str | None) -> str:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            if req.continuous_usage:
                return sse({**head, "choices": [choice], "usage": run.usage([num_prompt_tokens])})
            return sse({**head, "choices": [choice]})

        tool_stream = ToolCallStream(req.tool_use) if req.tool_use is not None else None
        try:
            for index in range(len(run.samples)):
                yield chunk(index, {"role": "assistant", "content": ""}, None, None)
            async for index, delta in run.deltas():
                if delta.finish_reason == "error":
                    yield sse(ApiError(500, delta.error, type="server_error", code="generation_failed").to_json())
                    break
                if tool_stream is not None:
                    # A named call streams each delta's logprobs with its text; a list of calls all of them at once.
                    held = delta.logprobs if tool_stream.use.mode == "named" else (
                        run.samples[index].logprobs if delta.finished else ())
                    logprobs = chat_logprobs_json(self.token_text, held, req.top_logprobs) \
                        if req.logprobs and held else None
                    pieces = tool_stream.pieces(index, delta.new_text, delta.finished, delta.finish_reason,
                                                run.samples[index].text)
                    if logprobs is not None and not pieces:  # tokens whose text is held back (or not whole yet)
                        pieces = [({}, None)]
                    for piece, reason in pieces:
                        yield chunk(index, piece, logprobs, reason)
                        logprobs = None
                    continue
                text = self._chat_delta_chunks(chunk, index, delta, req)
                if text:
                    yield text
            else:
                if req.include_usage:
                    yield sse({**head, "choices": [], "usage": run.usage([num_prompt_tokens])})
            yield "data: [DONE]\n\n"
        finally:
            await run.close()

    def _chat_delta_chunks(self, chunk: Callable[[int, dict[str, object], object, str | None], str], index: int,
                          delta: TokenDelta, req: ChatRequest) -> str:
        """The SSE events for one delta: its text (and logprobs) if any, then the finish chunk if it ends."""
        logprobs = chat_logprobs_json(self.token_text, delta.logprobs, req.top_logprobs) \
            if req.logprobs and delta.logprobs else None
        if delta.new_text or logprobs is not None:
            content_chunk = chunk(index, {"content": delta.new_text}, logprobs, None)
        else:
            content_chunk = ""
        if delta.finished:
            return content_chunk + chunk(index, {}, None, delta.finish_reason)
        return content_chunk
