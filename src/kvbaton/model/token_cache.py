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
  neighbouring whitespace or match only whole words change their neighbours, so they are not used; nor are
  tokens such a token may hold or follow (the caller picks them: `tokenizer._split_tokens`).
- optionally (`split_at_words`, for the byte-level BPE pre-tokenizers: GPT-2, Llama-3, Qwen2 patterns),
  at the first space after a non-space at or after every `chunk_chars` characters: no piece of those
  patterns runs from a non-space into a following space (the only pieces holding a space start with
  it), so a new piece starts at that space, and BPE never merges across pieces. The caller enables it
  only when no added token holds whitespace or strips it (such a token could swallow the space).
A split is recorded only where the tokenizer's own offsets show a cut there (and, after an added token,
that it emitted that token), so a wrong rule can only cost a miss, never wrong ids.

With word splits on, the text after the known chunks is not handed to the tokenizer whole either: it is
cut at every word split (and after every added token) into pieces, and each piece seen before takes its
ids from a piece memo; only runs of unseen pieces are tokenized (one call per run), and a piece is
memoised only where the tokenizer's offsets show a cut at both its ends (a run's own ends are split
points). This is what the BPE model's own word cache does, moved in front of the pre-tokenizer, whose
regex costs most of a tokenizer call (~0.7 us per character here). A piece's ids depend on the piece
alone because both of its ends are split points, which depend only on the character before and the one
after them (above). Text of words never seen before pays for the splitting and memoising: ~10-20 % over
tokenizing it whole (benchmarks/router_overhead.py's prompts with every word new).

One LRU over both levels, bounded by the characters its entries stand for (about 2 bytes of memory per
character of ASCII prompts: the default 16M characters hold ~32 MB); the piece memo is first-in first-out
(a hit does not refresh a piece: that would cost a call per piece), bounded by its number of pieces
(~250 bytes each: the default 65,536 hold ~16 MB; past it the older half goes). Single-threaded: the
router's event loop owns it.
"""

from __future__ import annotations

import hashlib
import re
from array import array
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import accumulate, chain, compress, islice
from operator import ge, itemgetter

from kvbaton.core.errors import InvalidRequestError

# (ids, char offsets per token) of a text, as the backend tokenizer gives them.
EncodeWithOffsets = Callable[[str], tuple[Sequence[int], Sequence[tuple[int, int]]]]

DEFAULT_MAX_CACHED_CHARS = 16_000_000
DEFAULT_CHUNK_CHARS = 256
DEFAULT_MAX_CACHED_PIECES = 65_536
MAX_PIECE_CHARS = 64  # longer pieces (runs of text without word splits) are tokenized, never memoised
_WORD_SPLIT = re.compile(r"(?<=\S) ")  # a space after a non-space
_BEFORE_WORD_SPLIT = re.compile(r"(?= )(?<=\S)")  # empty: splitting at it keeps the spaces (space test first: faster)
_SPACE_AFTER_SPACE = re.compile(r"\s ")  # a space that is not a word split (unless at the text's start)
_NO_TOKEN = -1  # a word split: any token may end there
_START, _END = itemgetter(0), itemgetter(1)
_MINUS_ONE = (-1).__add__


@dataclass(frozen=True, slots=True)
class TokenCacheStats:
    num_queries: int
    num_exact_hits: int
    num_prefix_hits: int
    num_prefix_tokens_reused: int
    num_entries: int
    num_cached_chars: int
    num_piece_hits: int = 0  # pieces whose ids came from the piece memo (word splits only)
    num_cached_pieces: int = 0


def _chain(parent: bytes, chunk: str) -> bytes:
    return hashlib.blake2b(chunk.encode("utf-8", "surrogatepass"), digest_size=16, key=parent).digest()


class TokenizationCache:
    """`encode(text)` equal to the backend's ids, with each distinct text and chunk tokenized once."""

    def __init__(self, encode_with_offsets: EncodeWithOffsets, split_tokens: Mapping[str, int], *,
                 split_at_words: bool = False, chunk_chars: int = DEFAULT_CHUNK_CHARS,
                 max_cached_chars: int = DEFAULT_MAX_CACHED_CHARS,
                 max_cached_pieces: int = DEFAULT_MAX_CACHED_PIECES) -> None:
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
        # The characters split tokens start with (e.g. just "<"): a text holding none of them holds no split
        # token, which a substring test proves far faster than scanning it with the pattern.
        self._split_initials = "".join(sorted({token[0] for token in tokens}))
        # Exact level: text (str) -> ids. Prefix level: chained hash (bytes) -> (the chunk's ids, its chars).
        # Ids are kept as 4-byte arrays: a tuple of Python ints costs ~9x the memory per token.
        self._entries: OrderedDict[str | bytes, tuple[array[int], int]] = OrderedDict()
        self._num_cached_chars = 0
        self._num_queries = 0
        self._num_exact_hits = 0
        self._num_prefix_hits = 0
        self._num_prefix_tokens_reused = 0
        # Piece memo (word splits only): piece text -> its ids, alone. Tuples: extending a list from one is
        # cheaper than from an array, a few ids cost about the same memory, and unlike lists the garbage
        # collector stops tracking tuples of ints, so a full memo adds nothing to its collections.
        self.max_cached_pieces = max_cached_pieces
        self._pieces: dict[str, tuple[int, ...]] = {}
        self._num_piece_hits = 0

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
        if self.split_at_words:
            rest_ids, cut_index = self._encode_pieces(text, start)
            self._remember_chunks(text, splits[num_known:], key, start, rest_ids, cut_index)
        else:
            rest_ids, offsets = self._encode(text[start:])
            self._remember_chunks(text, splits[num_known:], key, start, rest_ids,
                                  lambda at, token_id: _cut_index(rest_ids, offsets, at, token_id))
        ids.extend(rest_ids)
        self._put(text, ids, len(text))
        return ids

    def stats(self) -> TokenCacheStats:
        return TokenCacheStats(self._num_queries, self._num_exact_hits, self._num_prefix_hits,
                               self._num_prefix_tokens_reused, len(self._entries), self._num_cached_chars,
                               self._num_piece_hits, len(self._pieces))

    def _split_points(self, text: str) -> list[tuple[int, int]]:
        """(position, the added token's id ending there or _NO_TOKEN), ascending, strictly inside the text."""
        points: dict[int, int] = {}
        if self._split_pattern is not None and self._may_hold_split_token(text):
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
                         ids: Sequence[int], cut_index: Callable[[int, int], int | None]) -> None:
        """Cache the chunks of `text[base:]` (tokenized as `ids`) up to each split the tokenizer really cut
        at (`cut_index(split - base, token_id)`: the number of ids before the split, or None); stop at the
        first split it did not cut at, since the chunks after it would be keyed by a prefix whose own ids
        are unknown."""
        start = base
        first_token = 0
        for split, token_id in splits:
            num_before = cut_index(split - base, token_id)
            if num_before is None:
                return
            key = _chain(key, text[start:split])
            self._put(key, ids[first_token:num_before], split - start)
            first_token, start = num_before, split

    def _may_hold_split_token(self, text: str) -> bool:
        return any(initial in text for initial in self._split_initials)

    def _pieces_of(self, text: str, start: int) -> tuple[list[str], dict[int, int]]:
        """`text[start:]` cut at every word split and after every split token (`start` itself is a split
        point, or 0): the pieces in order, and the index -> id of each piece ending with a split token."""
        rest = text[start:]
        if not rest:
            return [], {}
        if _SPACE_AFTER_SPACE.search(rest) is None:  # every space but a leading one is a word split
            parts = rest.split(" ")
            pieces = [" " + part for part in parts[1:]]  # a leading space starts the first of them
            if parts[0]:
                pieces.insert(0, parts[0])
        else:  # a space after whitespace stays in the piece before it (one split: linear in a run of spaces)
            pieces = _BEFORE_WORD_SPLIT.split(rest)
        pattern = self._split_pattern
        if pattern is None or not self._may_hold_split_token(rest) or pattern.search(rest) is None:
            return pieces, {}
        cut: list[str] = []
        end_tokens: dict[int, int] = {}
        for piece in pieces:
            begin = 0
            for match in pattern.finditer(piece):
                if match.end() < len(piece):
                    end_tokens[len(cut)] = self._split_ids[match.group()]
                    cut.append(piece[begin:match.end()])
                    begin = match.end()
            cut.append(piece[begin:])
        return cut, end_tokens

    def _encode_pieces(self, text: str, start: int) -> tuple[list[int], Callable[[int, int], int | None]]:
        """Ids of `text[start:]` from the piece memo, tokenizing each run of unseen pieces in one call; and
        the rest's `cut_index` (ids before a position relative to `start`, if a piece boundary cuts there)."""
        pieces, end_tokens = self._pieces_of(text, start)
        found: list[Sequence[int] | None] = list(map(self._pieces.get, pieces))
        uncut: set[int] = set()  # pieces whose end the tokenizer did not cut at
        num_pieces = len(pieces)
        num_unseen = found.count(None)
        self._num_piece_hits += num_pieces - num_unseen
        first = 0
        while num_unseen:
            first = found.index(None, first)
            last = first + 1
            while last < num_pieces and found[last] is None:
                last += 1
            self._encode_run(pieces, end_tokens, first, last, found, uncut)
            num_unseen -= last - first
            first = last
        ids = list(chain.from_iterable(found))  # type: ignore[arg-type]
        piece_ends = list(accumulate(map(len, pieces)))
        id_ends = list(accumulate(map(len, found)))  # type: ignore[arg-type]

        def cut_index(at: int, token_id: int) -> int | None:
            index = bisect_left(piece_ends, at)
            if index < num_pieces and piece_ends[index] == at and index not in uncut:
                return id_ends[index]
            return None

        return ids, cut_index

    def _encode_run(self, pieces: list[str], end_tokens: Mapping[int, int], first: int, last: int,
                    found: list[Sequence[int] | None], uncut: set[int]) -> None:
        """Tokenize pieces[first:last] (unseen, consecutive) in one call into `found`; memoise each piece the
        tokenizer cut at both ends of. Where it did not cut, the boundary joins `uncut` and the pieces on
        both sides form one group: the group's ids sit at its last piece, its other entries get ()."""
        run = pieces[first:last]
        encoded_ids, offsets = self._encode("".join(run))
        run_ids = tuple(encoded_ids)  # its slices are the pieces' tuples
        token_ends = list(map(_END, offsets))  # nondecreasing
        piece_ends = list(accumulate(map(len, run)))
        # Ids up to the last token ending at or before each piece's end (in C: a long all-new text pays
        # little over tokenizing it whole).
        ids_ends = list(map(partial(bisect_right, token_ends), piece_ends))
        ids_ends[-1] = len(run_ids)  # the run's end is a split point
        if self._all_cut(run_ids, offsets, token_ends, piece_ends[:-1], ids_ends[:-1], end_tokens, first):
            found[first:last] = map(run_ids.__getitem__, map(slice, [0, *ids_ends[:-1]], ids_ends))
            self._pieces.update(compress(zip(run, found[first:last]), map(MAX_PIECE_CHARS.__ge__, map(len, run))))
            self._trim_pieces()
            return
        begin = 0  # ids before the current group of pieces (a group ends at the next proven cut)
        group = first
        for index, at, end in zip(range(first, last), piece_ends, ids_ends):
            if index < last - 1 and not self._all_cut(run_ids, offsets, token_ends, [at], [end], end_tokens, index):
                uncut.add(index)
                found[index] = ()
                continue
            found[index] = piece_ids = run_ids[begin:end]
            if group == index:
                self._remember_piece(pieces[index], piece_ids)
            begin, group = end, index + 1

    @staticmethod
    def _all_cut(ids: Sequence[int], offsets: Sequence[tuple[int, int]], token_ends: list[int], positions: list[int],
                 ids_before: list[int], end_tokens: Mapping[int, int], first: int) -> bool:
        """Whether the tokenizer cut at every `positions[i]` (the end of piece `first + i`, inside the run)
        after `ids_before[i]` ids: a token ends there, the next starts there or later (no character spread
        over two tokens), and where the piece ends with a split token, that token ends there. In C but for
        the pieces ending with a split token."""
        if not positions:
            return True
        if min(ids_before) < 1 or max(ids_before) >= len(ids):
            return False
        if list(map(token_ends.__getitem__, map(_MINUS_ONE, ids_before))) != positions:
            return False
        if not all(map(ge, map(_START, map(offsets.__getitem__, ids_before)), positions)):
            return False
        return all(ids[ids_before[i - first] - 1] == token_id for i, token_id in end_tokens.items()
                   if first <= i < first + len(positions))

    def _remember_piece(self, piece: str, piece_ids: tuple[int, ...]) -> None:
        if len(piece) <= MAX_PIECE_CHARS and piece not in self._pieces:
            self._pieces[piece] = piece_ids
            self._trim_pieces()

    def _trim_pieces(self) -> None:
        """Past the bound, the older half goes at once: a plain dict drops its oldest keys cheaply in bulk
        (one at a time, each lookup of the oldest would scan the slots freed before it)."""
        if len(self._pieces) > self.max_cached_pieces:
            for piece in list(islice(self._pieces, len(self._pieces) - self.max_cached_pieces // 2)):
                del self._pieces[piece]

    def _put(self, key: str | bytes, ids: Sequence[int], num_chars: int) -> None:
        """Token ids are below 2**32 (a tokenizer's vocabulary)."""
        if num_chars > self.max_cached_chars:
            return
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        self._entries[key] = (array("I", ids), num_chars)  # "I" converts several times faster than "i"
        self._num_cached_chars += num_chars
        while self._num_cached_chars > self.max_cached_chars:
            _, (_, evicted_chars) = self._entries.popitem(last=False)
            self._num_cached_chars -= evicted_chars


def _cut_index(ids: Sequence[int], offsets: Sequence[tuple[int, int]], at: int, token_id: int) -> int | None:
    """The number of `ids` before position `at` when the tokenizer cut there (by its char `offsets`; after
    an added token, `token_id` must be the token ending there), else None."""
    index = bisect_left(offsets, at, key=_END)  # the first token ending at or after `at`
    if index >= len(offsets) or offsets[index][1] != at:
        return None
    if index + 1 < len(offsets) and offsets[index + 1][0] < at:
        return None  # one character spread over two tokens: no cut here
    if token_id != _NO_TOKEN and ids[index] != token_id:
        return None
    return index + 1
