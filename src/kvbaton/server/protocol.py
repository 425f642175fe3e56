"""OpenAI-compatible wire format: a JSON body becomes a frozen request value or an ApiError; response pieces.

Bodies are checked by hand rather than by pydantic so every bad input gets OpenAI's error shape and a
message naming the parameter. Sampling ranges are checked once, by `SamplingParams`. Unknown fields are
ignored (clients send extras); fields whose meaning kvbaton cannot honour (penalties, logit_bias, tools)
are refused rather than silently dropped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import orjson

from kvbaton.core.errors import InvalidRequestError
from kvbaton.core.sampling import MAX_LOGPROBS, SamplingParams
from kvbaton.server.protocol_structured import STRUCTURED_FIELDS, structured_grammar
from kvbaton.server.tool_calls import ToolUse, parse_tool_use, parse_tools
from kvbaton.server.tool_parsers import KEEPS_SPECIAL_TOKENS

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_BATCH_PROMPTS = 256  # prompts in one /v1/completions batch
MAX_BATCH_SAMPLES = 256  # completions one request may ask for (prompts x n): each is a call on the cluster
_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "logprobs", "n",
                    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p", "min_tokens",
                    "priority", "stop_token_ids")


class ApiError(Exception):
    """An error meant for the client, rendered as `{"error": {message, type, param, code}}`."""

    def __init__(self, status_code: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def to_json(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    model: str
    prompts: tuple[str | tuple[int, ...], ...]  # each text (tokenized at ingress) or token ids; >1: a batch
    sampling: SamplingParams  # n not yet expanded
    stream: bool
    include_usage: bool  # stream_options.include_usage
    continuous_usage: bool  # stream_options.continuous_usage_stats (vLLM's): usage so far in every chunk
    echo: bool
    user: str
    echo_only: bool = False  # echo with max_tokens 0: the answer is the prompt alone (one token runs, unreported)
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs was asked: each choice carries the prompt's
    truncate_prompt_tokens: int | None = None  # vLLM's: keep each prompt's last k tokens (-1: the context's worth)
    cache_salt: str = ""  # vLLM's: share cached prefixes only with requests of the same salt


@dataclass(frozen=True, slots=True)
class ChatRequest:
    model: str
    messages: tuple[Mapping[str, object], ...]
    sampling: SamplingParams  # max_tokens is max_model_len when not given (see max_tokens_given)
    max_tokens_given: bool  # False: the caller lowers max_tokens to the context left after the prompt
    stream: bool
    include_usage: bool
    continuous_usage: bool
    logprobs: bool
    top_logprobs: int
    user: str
    tools: tuple[Mapping[str, object], ...] = ()  # for the chat template
    tool_use: ToolUse | None = None  # a forced tool call: its grammar is the sampling's
    add_generation_prompt: bool = True  # vLLM's chat template options
    continue_final_message: bool = False
    template_kwargs: Mapping[str, object] | None = None  # chat_template_kwargs, and vLLM's `documents`
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs was asked: the response carries the prompt's
    truncate_prompt_tokens: int | None = None
    cache_salt: str = ""


_DIGITS_AND_COMMAS = b"0123456789,"


def are_non_negative_ints(values: Sequence[object]) -> bool:
    """True when every value is a non-negative int (never a bool), proven at C speed from orjson's rendering,
    which for such a list holds nothing but digits and commas inside the brackets (a bool renders as
    true/false, a float with a point or exponent, a negative with a minus, anything else with quotes,
    braces, brackets or null). False means "not proven": check element by element."""
    try:
        rendered = orjson.dumps(values)
    except orjson.JSONEncodeError:  # e.g. an int beyond 64 bits
        return False
    return rendered.translate(None, _DIGITS_AND_COMMAS) == b"[]"


def parse_json_body(raw: bytes) -> dict[str, object]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:  # invalid UTF-8 included
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, got {type(body).__name__}")
    return body


# -- typed field readers (a missing field and an explicit null both mean "use the default") ----------


def _int(body: Mapping[str, object], name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name} must be an integer, got {json.dumps(value)}", param=name)
    return value


def _float(body: Mapping[str, object], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_request(f"{name} must be a number, got {json.dumps(value)}", param=name)
    return float(value)


def _bool(body: Mapping[str, object], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean, got {json.dumps(value)}", param=name)
    return value


def _str(body: Mapping[str, object], name: str, default: str) -> str:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise bad_request(f"{name} must be a string, got {json.dumps(value)}", param=name)
    return value


def _stop(body: Mapping[str, object]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        if len(value) > 4:  # OpenAI's limit; keeps the engine's per-token stop scan cheap
            raise bad_request("stop accepts at most 4 strings", param="stop")
        return tuple(value)
    raise bad_request("stop must be a string or a list of strings", param="stop")


def _stop_token_ids(body: Mapping[str, object]) -> tuple[int, ...]:
    value = body.get("stop_token_ids")
    if value is None:
        return ()
    if not isinstance(value, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in value):
        raise bad_request("stop_token_ids must be a list of integers", param="stop_token_ids")
    return tuple(value)


def _stream_options(body: Mapping[str, object], stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats); OpenAI refuses stream_options on a non-streaming request, and so
    do we."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not stream:
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
    if not isinstance(options, dict):
        raise bad_request("stream_options must be an object", param="stream_options")
    return _bool(options, "include_usage", False), _bool(options, "continuous_usage_stats", False)


def _logit_bias(body: Mapping[str, object]) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} map as (token id, bias) pairs; the ranges are SamplingParams' to check."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise bad_request("logit_bias must be an object mapping token ids to biases", param="logit_bias")
    pairs = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise bad_request(f"logit_bias keys must be token ids, got {json.dumps(key)}", param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise bad_request(f"logit_bias values must be numbers, got {json.dumps(bias)}", param="logit_bias")
        pairs.append((int(key), float(bias)))
    return tuple(pairs)


# vLLM request fields whose meaning kvbaton does not implement, refused when set to anything but their default:
# dropped like an unknown field, they would change the answer without a word.
_UNSUPPORTED_VLLM_FIELDS = {
    "use_beam_search": "beam search is not supported",
    "allowed_token_ids": "allowed_token_ids is not supported; structured_outputs (choice, regex) or logit_bias "
                         "can restrict the output",
    "bad_words": "bad_words is not supported; logit_bias can ban tokens",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids is not supported",
    "logits_processors": "logits_processors are not supported",
}


def _refuse_unsupported(body: Mapping[str, object], chat: bool = False) -> None:
    for field, reason in _UNSUPPORTED_VLLM_FIELDS.items():
        if body.get(field) not in (None, False, [], {}):
            raise bad_request(reason, param=field, code="unsupported_parameter")
    length_penalty = body.get("length_penalty")
    if length_penalty is not None and length_penalty != 1.0:
        raise bad_request("length_penalty applies to beam search, which is not supported", param="length_penalty",
                          code="unsupported_parameter")
    if chat and body.get("chat_template") is not None:
        raise bad_request("a chat template in the request is not accepted; the model's own applies (vLLM refuses "
                          "one too unless started with --trust-request-chat-template)", param="chat_template",
                          code="unsupported_parameter")
    if body.get("functions") or body.get("function_call"):
        raise bad_request("the legacy functions/function_call are not supported; use tools and tool_choice",
                          param="functions", code="unsupported_parameter")
    if not chat and (body.get("tools") or body.get("tool_choice")):
        raise bad_request("tools are for /v1/chat/completions", param="tools", code="unsupported_parameter")
    if body.get("suffix"):
        raise bad_request("suffix is not supported by this server", param="suffix", code="unsupported_parameter")


def _truncate_prompt_tokens(body: Mapping[str, object]) -> int | None:
    """vLLM's `truncate_prompt_tokens`: keep only the prompt's last k tokens (-1: as many as the context holds)."""
    value = _int(body, "truncate_prompt_tokens", None)
    if value is not None and value != -1 and value < 1:
        raise bad_request(f"truncate_prompt_tokens must be -1 or at least 1, got {value}",
                          param="truncate_prompt_tokens")
    return value


def _cache_salt(body: Mapping[str, object]) -> str:
    """vLLM's `cache_salt`: the request shares cached prefixes only with requests of the same salt."""
    value = body.get("cache_salt")
    if value is None:
        return ""
    if not isinstance(value, str) or not value:
        raise bad_request("cache_salt must be a non-empty string", param="cache_salt")
    return value


def _prompt_logprobs(body: Mapping[str, object], stream: bool) -> int | None:
    """vLLM's `prompt_logprobs` (each prompt token's logprob given those before it, with that many top
    alternatives), refused with streaming as vLLM refuses it."""
    value = _int(body, "prompt_logprobs", None)
    if value is None:
        return None
    if not 0 <= value <= MAX_LOGPROBS:
        raise bad_request(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {value}", param="prompt_logprobs")
    if stream:
        raise bad_request("prompt_logprobs are not available when stream is true", param="prompt_logprobs")
    return value


def _sampling(body: Mapping[str, object], *, max_tokens: int, logprobs: int | None,
              tool_use: ToolUse | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
    """Builds SamplingParams; its InvalidRequestError becomes a 400 naming the parameter it is about. A forced
    tool call's grammar is the output's constraint, which response_format and structured_outputs may not add to."""
    n = _int(body, "n", 1)
    best_of = _int(body, "best_of", None)
    if best_of is not None and best_of != n:
        raise bad_request("best_of other than n is not supported", param="best_of", code="unsupported_parameter")
    top_k = _int(body, "top_k", 0)
    try:
        grammar, field = structured_grammar(body)
    except InvalidRequestError as exc:
        message = str(exc)
        field = next((f for f in STRUCTURED_FIELDS if message.startswith(f)), "response_format")
        raise bad_request(message, param=field) from None
    if tool_use is not None and tool_use.grammar:
        if grammar:
            raise bad_request(f"{field} cannot constrain a forced tool call's output", param=field)
        grammar = tool_use.grammar
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_float(body, "temperature", 1.0),
            top_p=_float(body, "top_p", 1.0),
            top_k=0 if top_k == -1 else top_k,  # vLLM spells "disabled" as -1
            min_p=_float(body, "min_p", 0.0),
            min_tokens=_int(body, "min_tokens", 0),  # type: ignore[arg-type]
            seed=_int(body, "seed", None),
            stop=_stop(body),
            stop_token_ids=_stop_token_ids(body),
            ignore_eos=_bool(body, "ignore_eos", False),
            include_stop_str_in_output=_bool(body, "include_stop_str_in_output", False),
            skip_special_tokens=_bool(body, "skip_special_tokens", True),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            n=n,  # type: ignore[arg-type]
            presence_penalty=_float(body, "presence_penalty", 0.0),
            frequency_penalty=_float(body, "frequency_penalty", 0.0),
            repetition_penalty=_float(body, "repetition_penalty", 1.0),
            logit_bias=_logit_bias(body),
            priority=_int(body, "priority", 0),  # type: ignore[arg-type]
            grammar=grammar,
        )
    except InvalidRequestError as exc:
        message = str(exc)
        field = message.split(" ", 1)[0]
        raise bad_request(message, param=field if field in _SAMPLING_FIELDS else None) from None


def _model(body: Mapping[str, object], served_model: str) -> str:
    model = _str(body, "model", served_model)
    if model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist. This server serves `{served_model}`.",
                       param="model", code="model_not_found")
    return model


def _token_ids(prompt: list[object]) -> tuple[int, ...] | None:
    """`prompt` as token ids if every element is an int (not a bool), else None."""
    if are_non_negative_ints(prompt):  # the usual token-id list, proven without a per-element call
        return tuple(prompt)  # type: ignore[arg-type]
    # Else collect the element types in one C-level pass, then check the few distinct ones (same verdict as
    # isinstance(t, int) and not isinstance(t, bool) per element; bool is an int).
    element_types = set(map(type, prompt))
    if all(issubclass(k, int) and not issubclass(k, bool) for k in element_types):
        return tuple(prompt)  # type: ignore[arg-type]
    return None


def _prompts(body: Mapping[str, object]) -> tuple[str | tuple[int, ...], ...]:
    """OpenAI's four prompt forms: a string, a list of token ids, or a batch (a list of strings, or of token-id
    lists) of at most MAX_BATCH_PROMPTS prompts; none may be empty."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt must not be empty", param="prompt")
        return (prompt,)
    if isinstance(prompt, list):
        if not prompt:
            raise bad_request("prompt must not be empty", param="prompt")
        ids = _token_ids(prompt)
        if ids is not None:
            return (ids,)
        if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
            if len(prompt) > MAX_BATCH_PROMPTS:
                raise bad_request(f"a batch holds at most {MAX_BATCH_PROMPTS} prompts, got {len(prompt)}",
                                  param="prompt")
            batch: list[str | tuple[int, ...]] = []
            for index, one in enumerate(prompt):
                if not one:
                    raise bad_request(f"prompt {index} of the batch is empty", param="prompt")
                ids = one if isinstance(one, str) else _token_ids(one)
                if ids is None:
                    raise bad_request(f"prompt {index} of the batch is not a list of token ids", param="prompt")
                batch.append(ids)
            return tuple(batch)
    if prompt is None:
        raise bad_request("prompt is required", param="prompt")
    raise bad_request("prompt must be a string, a list of token ids, or a list of either (a batch)", param="prompt")


def parse_completion_request(body: Mapping[str, object], served_model: str) -> CompletionRequest:
    model = _model(body, served_model)
    prompts = _prompts(body)
    _refuse_unsupported(body)
    stream = _bool(body, "stream", False)
    logprobs = _int(body, "logprobs", None)
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}", param="logprobs")
    echo = _bool(body, "echo", False)
    include_usage, continuous_usage = _stream_options(body, stream)
    max_tokens = _int(body, "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
    # OpenAI's (and vLLM's) way to score a prompt: echo it with max_tokens 0. The engine runs one token, not reported.
    echo_only = echo and max_tokens == 0
    prompt_logprobs = _prompt_logprobs(body, stream)
    # Echo with logprobs scores the prompt too (with `logprobs` alternatives unless prompt_logprobs says how many).
    scored = prompt_logprobs if prompt_logprobs is not None else (logprobs if echo else None)
    sampling = _sampling(body, max_tokens=1 if echo_only else max_tokens,  # type: ignore[arg-type]
                         logprobs=logprobs, prompt_logprobs=scored)
    if len(prompts) * sampling.n > MAX_BATCH_SAMPLES:
        raise bad_request(f"a batch of {len(prompts)} prompts with n={sampling.n} asks for {len(prompts) * sampling.n} "
                          f"completions; at most {MAX_BATCH_SAMPLES} per request", param="prompt")
    return CompletionRequest(
        model=model,
        prompts=prompts,
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        echo=echo,
        user=_str(body, "user", ""),
        echo_only=echo_only,
        prompt_logprobs=prompt_logprobs is not None,
        truncate_prompt_tokens=_truncate_prompt_tokens(body),
        cache_salt=_cache_salt(body),
    )


@dataclass(frozen=True, slots=True)
class TokenizeRequest:
    """vLLM's /tokenize: a prompt, or a chat rendered by the chat template with the chat endpoint's options."""

    prompt: str  # "" when messages are given
    messages: tuple[Mapping[str, object], ...]
    add_special_tokens: bool  # the tokenizer's BOS (default: for a prompt, not for a chat, whose template writes it)
    add_generation_prompt: bool
    continue_final_message: bool
    tools: tuple[Mapping[str, object], ...]
    template_kwargs: Mapping[str, object] | None
    return_token_strs: bool  # also answer each token's vocabulary string


def parse_tokenize_request(body: Mapping[str, object], served_model: str) -> TokenizeRequest:
    """{"prompt": text}, or {"messages": [...]} to count a chat as the chat endpoint would send it (with its
    add_generation_prompt, continue_final_message, tools and chat_template_kwargs), as vLLM's /tokenize takes them."""
    _model(body, served_model)
    messages = body.get("messages")
    return_token_strs = _bool(body, "return_token_strs", False)
    if messages is not None:
        if not isinstance(messages, list) or not messages:
            raise bad_request("messages must be a non-empty list of {'role', 'content'} objects", param="messages")
        try:
            tools = parse_tools(body.get("tools"))
        except InvalidRequestError as exc:
            raise bad_request(str(exc), param="tools") from None
        return TokenizeRequest("", tuple(messages), _bool(body, "add_special_tokens", False),
                               _bool(body, "add_generation_prompt", True), _bool(body, "continue_final_message", False),
                               tools, _template_kwargs(body), return_token_strs)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad_request("give prompt (a string) or messages", param="prompt")
    return TokenizeRequest(prompt, (), _bool(body, "add_special_tokens", True), True, False, (), None,
                           return_token_strs)


def parse_detokenize_request(body: Mapping[str, object], served_model: str) -> tuple[int, ...]:
    """vLLM's /detokenize: {"tokens": [token ids]}; the ids' range is the caller's (it knows the vocabulary)."""
    _model(body, served_model)
    tokens = body.get("tokens")
    ids = _token_ids(tokens) if isinstance(tokens, list) else None
    if ids is None or any(t < 0 for t in ids):
        raise bad_request("tokens must be a list of token ids (non-negative integers)", param="tokens")
    return ids


def parse_chat_request(body: Mapping[str, object], served_model: str, *, max_model_len: int,
                       tool_call_parser: str = "") -> ChatRequest:
    """max_tokens left out means "up to the context"; the caller clamps it once the prompt length is known.
    `tool_call_parser` is the server's (`server/tool_calls.py`), which tool_choice "auto" needs."""
    model = _model(body, served_model)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {'role', 'content'} objects", param="messages")
    _refuse_unsupported(body, chat=True)
    try:
        tools, tool_use = parse_tool_use(body, tool_call_parser)
    except InvalidRequestError as exc:
        message = str(exc)
        raise bad_request(message, param=re.match(r"[a-z_]+", message).group()) from None  # type: ignore[union-attr]
    stream = _bool(body, "stream", False)
    include_usage, continuous_usage = _stream_options(body, stream)
    logprobs = _bool(body, "logprobs", False)
    top_logprobs = _int(body, "top_logprobs", 0)
    if not 0 <= top_logprobs <= MAX_LOGPROBS:  # type: ignore[operator]
        raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top_logprobs}", param="top_logprobs")
    if top_logprobs and not logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    prompt_logprobs = _prompt_logprobs(body, stream)
    max_tokens = _int(body, "max_completion_tokens", None)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", None)
    sampling = _sampling(body, max_tokens=max_tokens if max_tokens is not None else max_model_len,
                         logprobs=top_logprobs if logprobs else None, tool_use=tool_use,
                         prompt_logprobs=prompt_logprobs)
    if tool_use is not None and tool_use.parser in KEEPS_SPECIAL_TOKENS and body.get("skip_special_tokens") is None:
        sampling = replace(sampling, skip_special_tokens=False)  # the call marker is a special token (as vLLM's)
    return ChatRequest(
        model=model,
        messages=tuple(messages),
        sampling=sampling,
        max_tokens_given=max_tokens is not None,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        logprobs=logprobs,
        top_logprobs=top_logprobs,  # type: ignore[arg-type]
        user=_str(body, "user", ""),
        tools=tools,
        tool_use=tool_use,
        add_generation_prompt=_bool(body, "add_generation_prompt", True),
        continue_final_message=_bool(body, "continue_final_message", False),
        template_kwargs=_template_kwargs(body),
        prompt_logprobs=prompt_logprobs is not None,
        truncate_prompt_tokens=_truncate_prompt_tokens(body),
        cache_salt=_cache_salt(body),
    )


def _template_kwargs(body: Mapping[str, object]) -> Mapping[str, object] | None:
    """chat_template_kwargs, and vLLM's `documents` (for RAG templates), which the template sees as its
    `documents` variable, as transformers gives them."""
    value = body.get("chat_template_kwargs")
    if value is not None and (not isinstance(value, dict)
                              or not all(isinstance(k, str) and k.isidentifier() for k in value)):
        raise bad_request("chat_template_kwargs must be an object of template variables", param="chat_template_kwargs")
    documents = body.get("documents")
    if documents is None:
        return value
    if not isinstance(documents, list) or not all(isinstance(d, dict) for d in documents):
        raise bad_request("documents must be a list of objects", param="documents")
    return {**(value or {}), "documents": documents}
