"""Tokenization cache: reuse the token ids of text the router has tokenized before.

Ingress tokenizes every prompt, and in agent, RAG and multi-turn traffic most of a prompt is text seen
before (the same system prompt, the conversation so far). Two levels, as SGLang's gateway does:

- exact: the whole text was tokenized before -> its ids, no tokenizer call;
- prefix: the text is cut at split points into chunks; the ids of each chunk are cached under a chained
  hash of everything up to its end (like KV block hashes), so the longest run of known leading chunks
  is reused and the tokenizer runs on the rest only.

Split points are where the tokenizer provably cuts whatever follows, and depend only on the text before
them (plus one character after), so two prompts sharing a prefix share its split points:
- right after an added token (`<|im_start|>`, ...): the tokenizer matches added tokens whole, before
  pre-tokenization, and tokenizes the text between them independently. Added tokens that strip
  neighbouring whitespace or match only whole words change their neighbours, so they are not used.
- optionally (`split_at_words`, for the byte-level BPE pre-tokenizers: GPT-2, Llama-3, Qwen2 patterns),
  at the first space after a non-space at or after every `chunk_chars` characters: no piece of those
  patterns runs from a non-space into a following space (the only pieces holding a space start with
  it), so a new piece starts at that space, and BPE never merges across pieces. The caller enables it
  only when no added token holds whitespace or strips it (such a token could swallow the space).
A split is recorded only where the tokenizer's own offsets show a cut there (and, after an added token,
that it emitted that token), so a wrong rule can only cost a miss, never wrong ids.

One LRU over both levels, bounded by the characters its entries stand for (about 2 bytes of memory per
character of ASCII prompts: the default 16M characters hold ~32 MB). Single-threaded: the router's
event loop owns it.
"""

from __future__ import annotations

import hashlib
import re
from array import array
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvbaton.core.errors import InvalidRequestError

# (ids, char offsets per token) of a text, as the backend tokenizer gives them.
EncodeWithOffsets = Callable[[str], tuple[Sequence[int], Sequence[tuple[int, int]]]]

DEFAULT_MAX_CACHED_CHARS = 16_000_000
DEFAULT_CHUNK_CHARS = 256
_WORD_SPLIT = re.compile(r"(?<=\S) ")  # a space after a non-space
_NO_TOKEN = -1  # a word split: any token may end there


@dataclass(frozen=True, slots=True)
class TokenCacheStats:
    num_queries: int
    num_exact_hits: int
    num_prefix_hits: int
    num_prefix_tokens_reused: int
    num_entries: int
    num_cached_chars: int


def _chain(parent: bytes, chunk: str) -> bytes:
    return hashlib.blake2b(chunk.encode("utf-8", "surrogatepass"), digest_size=16, key=parent).digest()


class TokenizationCache:
    """`encode(text)` equal to the backend's ids, with each distinct text and chunk tokenized once."""

    def __init__(self, encode_with_offsets: EncodeWithOffsets, split_tokens: Mapping[str, int], *,
                 split_at_words: bool = False, chunk_chars: int = DEFAULT_CHUNK_CHARS,
                 max_cached_chars: int = DEFAULT_MAX_CACHED_CHARS) -> None:
        """`split_tokens`: the added tokens usable as split points, text -> token id."""
        if max_cached_chars <= 0 or chunk_chars <= 0:
            raise InvalidRequestError(f"max_cached_chars and chunk_chars must be > 0, got {max_cached_chars} "
                                      f"and {chunk_chars}")
        self._encode = encode_with_offsets
        self.max_cached_chars = max_cached_chars
        self.chunk_chars = chunk_chars
        self.split_at_words = split_at_words
        self._split_ids = {text: token_id for text, token_id in split_tokens.items() if text}
        # Longest first, so that a token that is a prefix of another never hides it at the same position.
        tokens = sorted(self._split_ids, key=len, reverse=True)
        self._split_pattern = re.compile("|".join(map(re.escape, tokens))) if tokens else None
        # Exact level: text (str) -> ids. Prefix level: chained hash (bytes) -> (the chunk's ids, its chars).
        # Ids are kept as 4-byte arrays: a tuple of Python ints costs ~9x the memory per token.
        self._entries: OrderedDict[str | bytes, tuple[array[int], int]] = OrderedDict()
        self._num_cached_chars = 0
        self._num_queries = 0
        self._num_exact_hits = 0
        self._num_prefix_hits = 0
        self._num_prefix_tokens_reused = 0

    def encode(self, text: str) -> list[int]:
        self._num_queries += 1
        entries = self._entries
        exact = entries.get(text)
        if exact is not None:
            entries.move_to_end(text)
            self._num_exact_hits += 1
            return list(exact[0])
        splits = self._split_points(text)
        ids: list[int] = []
        key = b""
        start = 0
        num_known = 0
        for split, _ in splits:
            chunk_key = _chain(key, text[start:split])
            chunk = entries.get(chunk_key)
            if chunk is None:
                break
            entries.move_to_end(chunk_key)
            ids.extend(chunk[0])
            key, start = chunk_key, split
            num_known += 1
        if num_known:
            self._num_prefix_hits += 1
            self._num_prefix_tokens_reused += len(ids)
        rest_ids, offsets = self._encode(text[start:])
        self._remember_chunks(text, splits[num_known:], key, start, rest_ids, offsets)
        ids.extend(rest_ids)
        self._put(text, ids, len(text))
        return ids

    def stats(self) -> TokenCacheStats:
        return TokenCacheStats(self._num_queries, self._num_exact_hits, self._num_prefix_hits,
                               self._num_prefix_tokens_reused, len(self._entries), self._num_cached_chars)

    def _split_points(self, text: str) -> list[tuple[int, int]]:
        """(position, the added token's id ending there or _NO_TOKEN), ascending, strictly inside the text."""
        points: dict[int, int] = {}
        if self._split_pattern is not None:
            for match in self._split_pattern.finditer(text):
                points[match.end()] = self._split_ids[match.group()]
        if self.split_at_words:
            position = self.chunk_chars
            while position < len(text):
                match = _WORD_SPLIT.search(text, position)
                if match is None:
                    break
                points.setdefault(match.start(), _NO_TOKEN)
                position = max(position + self.chunk_chars, match.start() + 1)
        return sorted((p, t) for p, t in points.items() if 0 < p < len(text))

    def _remember_chunks(self, text: str, splits: list[tuple[int, int]], key: bytes, base: int,
                         ids: Sequence[int], offsets: Sequence[tuple[int, int]]) -> None:
        """Cache the chunks of `text[base:]` (tokenized as `ids` with `offsets`, relative to `base`) up
        to each split the tokenizer really cut at; stop at the first split it did not cut at, since the
        chunks after it would be keyed by a prefix whose own ids are unknown."""
        ends = [end for _, end in offsets]
        start = base
        first_token = 0
        for split, token_id in splits:
            at = split - base  # offsets are relative to the text the tokenizer saw
            index = bisect_left(ends, at)  # the first token ending at or after the split
            if index >= len(ends) or ends[index] != at:
                return
            if index + 1 < len(offsets) and offsets[index + 1][0] < at:
                return  # one character spread over two tokens: no cut here
            if token_id != _NO_TOKEN and ids[index] != token_id:
                return
            key = _chain(key, text[start:split])
            self._put(key, ids[first_token:index + 1], split - start)
            first_token, start = index + 1, split

    def _put(self, key: str | bytes, ids: Sequence[int], num_chars: int) -> None:
        if num_chars > self.max_cached_chars:
            return
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        self._entries[key] = (array("i", ids), num_chars)
        self._num_cached_chars += num_chars
        while self._num_cached_chars > self.max_cached_chars:
            _, (_, evicted_chars) = self._entries.popitem(last=False)
            self._num_cached_chars -= evicted_chars
