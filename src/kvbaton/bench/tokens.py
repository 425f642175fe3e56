"""Synthetic prompt token ids: random spans, spans keyed by an id, and word-hashed text.

Every id lies in [FIRST_NORMAL_TOKEN, vocab_size): SmolLM2 reserves ids 0..16 for special
tokens (bos 1, eos 2, ...), so a synthetic prompt never contains an end-of-sequence token.

Token spans are read-only 1-D int32 numpy arrays: 4 bytes a token, built in bulk, and sliced
without copying. A million-token prompt made of shared spans costs only the unique spans; the
Python `tuple[int, ...]` form is produced only where a consumer asks for it.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence

import numpy as np

from kvbaton.core.errors import InvalidRequestError

DEFAULT_VOCAB_SIZE = 49_152  # SmolLM2
FIRST_NORMAL_TOKEN = 17  # ids below this are special tokens in SmolLM2

TokenIds = np.ndarray  # 1-D, dtype int32, read-only


def check_vocab_size(vocab_size: int) -> int:
    """Returns the number of usable ids; raises if the vocabulary leaves none."""
    num_ids = vocab_size - FIRST_NORMAL_TOKEN
    if num_ids < 2:
        raise InvalidRequestError(f"vocab_size must exceed {FIRST_NORMAL_TOKEN + 1}, got {vocab_size}")
    return num_ids


def as_token_array(ids: np.ndarray | Sequence[int]) -> TokenIds:
    """The ids as a read-only int32 array (a span may then be shared by many prompts safely)."""
    arr = np.array(ids, dtype=np.int32)
    arr.flags.writeable = False
    return arr


def random_tokens(rng: np.random.Generator, num_tokens: int, vocab_size: int) -> TokenIds:
    """`num_tokens` ids drawn uniformly from the normal (non-special) range."""
    check_vocab_size(vocab_size)
    return as_token_array(rng.integers(FIRST_NORMAL_TOKEN, vocab_size, size=num_tokens, dtype=np.int32))


def random_token_rows(rng: np.random.Generator, num_rows: int, num_tokens: int, vocab_size: int) -> list[TokenIds]:
    """`num_rows` independent random spans of equal length, drawn in one call (fast for 100k rows)."""
    check_vocab_size(vocab_size)
    block = as_token_array(rng.integers(FIRST_NORMAL_TOKEN, vocab_size, size=(num_rows, num_tokens), dtype=np.int32))
    return list(block)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """Vectorised SplitMix64 finaliser, in place on a uint64 array (returned for chaining).

    A fixed, seedless mixing function, so a key's tokens are the same in every process and on
    every platform (unlike Python's salted str hash).
    """
    x += np.uint64(0x9E3779B97F4A7C15)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def keyed_token_blocks(keys: Iterable[int], block_tokens: int, vocab_size: int, salt: int = 0) -> dict[int, TokenIds]:
    """One `block_tokens`-long span per key, a pure function of (key, salt, vocab_size).

    Equal keys give equal spans. The first two tokens spell the key in base num_ids (low
    digit first), so keys below num_ids (49,135 for SmolLM2) differ in their very first token:
    two prompts built from such key sequences share exactly `k * block_tokens` leading tokens
    when they share k leading keys. The remaining tokens are a seedless hash of (key, position).
    """
    num_ids = check_vocab_size(vocab_size)
    unique_keys = sorted(set(keys))
    if not unique_keys:
        return {}
    if unique_keys[0] < 0 or unique_keys[-1] >= num_ids * num_ids:
        raise InvalidRequestError(f"block keys must lie in [0, {num_ids * num_ids}), got {unique_keys[-1]}")
    key_arr = np.asarray(unique_keys, dtype=np.uint64)[:, None]
    positions = np.arange(block_tokens, dtype=np.uint64)[None, :]
    with np.errstate(over="ignore"):
        mixed = _splitmix64(key_arr * np.uint64(1_000_003) + positions * np.uint64(0x632BE59BD9B4E019)
                            + np.uint64(salt % 2**64))
    ids = (mixed % np.uint64(num_ids)).astype(np.int32) + FIRST_NORMAL_TOKEN
    ids[:, 0] = FIRST_NORMAL_TOKEN + key_arr[:, 0].astype(np.int64) % num_ids
    if block_tokens > 1:
        ids[:, 1] = FIRST_NORMAL_TOKEN + key_arr[:, 0].astype(np.int64) // num_ids
    ids.flags.writeable = False
    return dict(zip(unique_keys, ids))


def word_tokens(text: str, vocab_size: int) -> TokenIds:
    """Approximate tokenisation without a tokenizer: one id per whitespace-separated word.

    The id is a stable hash (CRC-32) of the word, so equal texts give equal ids and shared text
    stays shared at the token level. Real BPE counts run about 1.3 ids per English word; pass
    a real tokenizer to the loaders that accept one when exact counts matter.
    """
    num_ids = check_vocab_size(vocab_size)
    return as_token_array([FIRST_NORMAL_TOKEN + zlib.crc32(word.encode()) % num_ids for word in text.split()])
