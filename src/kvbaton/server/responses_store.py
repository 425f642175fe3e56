"""The responses `/v1/responses` keeps for `previous_response_id` and `GET /v1/responses/{id}`: bounded in
number and in tokens held, each kept for a TTL, readable only by the tenant that made it.

A stored response carries what the next turn needs to extend its prompt exactly (`continued_prompt_ids`):
the conversation as chat messages (its own output included, instructions left out, as OpenAI does not
carry them over), its prompt's rendered text and token ids, and the ids it generated. A turn that renders
as the previous turn's prompt followed by its output is then that same token prefix, so the prefix-aware
placement finds the worker holding the previous turn's KV on its own cost terms.

Time is passed in (`now`); entries leave in insertion order, so the oldest go first, whether expired or
pushed out by the bounds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

from kvbaton.model.tokenizer import Tokenizer

DEFAULT_MAX_NUM_RESPONSES = 1024
DEFAULT_MAX_NUM_TOKENS = 4_000_000  # prompt + output ids over all stored responses
DEFAULT_TTL_S = 3600.0


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: Mapping[str, object]  # the response object as it was returned
    owner: str  # the tenant that made it (auth.tenant_of, without a cache salt)
    messages: tuple[Mapping[str, object], ...]  # the conversation so far, this response's output last
    prompt_text: str  # what the chat template rendered for its prompt
    prompt_ids: tuple[int, ...]  # the ids that ran for it (an extension of the previous turn's, if any)
    output_ids: tuple[int, ...]  # the ids it generated
    stored_at: float

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


class ResponseStore:
    def __init__(self, max_num_responses: int = DEFAULT_MAX_NUM_RESPONSES,
                 max_num_tokens: int = DEFAULT_MAX_NUM_TOKENS, ttl_s: float = DEFAULT_TTL_S) -> None:
        self.max_num_responses = max_num_responses
        self.max_num_tokens = max_num_tokens
        self.ttl_s = ttl_s
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse, now: float) -> None:
        """Stores `entry` (one larger than the token bound is not kept), then drops the oldest over the bounds."""
        self._expire(now)
        if entry.num_tokens > self.max_num_tokens or self.max_num_responses < 1:
            return
        self._remove(response_id)
        self._entries[response_id] = entry
        self.num_tokens += entry.num_tokens
        while len(self._entries) > self.max_num_responses or self.num_tokens > self.max_num_tokens:
            self._remove(next(iter(self._entries)))

    def get(self, response_id: str, owner: str, now: float) -> StoredResponse | None:
        """The entry, if stored, alive and made by `owner` (another tenant's reads as missing)."""
        self._expire(now)
        entry = self._entries.get(response_id)
        return entry if entry is not None and entry.owner == owner else None

    def delete(self, response_id: str, owner: str, now: float) -> bool:
        if self.get(response_id, owner, now) is None:
            return False
        self._remove(response_id)
        return True

    def _expire(self, now: float) -> None:
        while self._entries:
            oldest_id, oldest = next(iter(self._entries.items()))
            if now - oldest.stored_at < self.ttl_s:
                return
            self._remove(oldest_id)

    def _remove(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.num_tokens -= entry.num_tokens


def continued_prompt_ids(tokenizer: Tokenizer, text: str, previous: StoredResponse | None) -> tuple[int, ...]:
    """The ids of prompt `text`: when it starts with the previous turn's prompt text, that turn's own ids
    (and, when its output follows as the ids spelled it, special tokens included, those ids too), then the
    rest tokenized; else `text` tokenized whole. The shared part is then the same token prefix the
    previous turn ran, whose KV the worker that ran it still caches."""
    if previous is None or not text.startswith(previous.prompt_text):
        return tuple(tokenizer.encode(text, add_bos=False))
    ids = previous.prompt_ids
    rest = text[len(previous.prompt_text):]
    output_text = tokenizer.decode(list(previous.output_ids), skip_special_tokens=False)
    if output_text and rest.startswith(output_text):
        ids += previous.output_ids
        rest = rest[len(output_text):]
    return ids + tuple(tokenizer.encode(rest, add_bos=False)) if rest else ids
