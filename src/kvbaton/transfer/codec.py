"""Handoff messages and transport handshake frames to and from msgpack bytes (never pickle).

A frame header is a msgpack array `[tag, *fields]`; nested values (layout, transfer id, first
token) are arrays too. A layer chunk's block tables travel as runs `[first_id, num_blocks, ...]`
(a fresh pool's table is one run), so a prefill step's 30+ chunks cost a few bytes each rather
than one integer per block. `decode` rejects unknown tags and malformed fields in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import chain
from operator import add
from typing import Any

import msgpack

from kvbaton.transfer.layout import KVLayout
from kvbaton.transfer.messages import (
    Abort,
    AbortCause,
    Ack,
    FirstToken,
    LayerChunk,
    Message,
    ReserveGranted,
    ReserveRefused,
    ReserveRequest,
    SourceDone,
    TransferId,
)


class FrameError(ValueError):
    """Bytes that are not a well-formed transfer frame."""


@dataclass(frozen=True, slots=True)
class Hello:
    """First frame on a new link: the sending (prefill) worker and the KV layout it will send."""

    worker_id: str
    layout: KVLayout


@dataclass(frozen=True, slots=True)
class Welcome:
    """The receiver accepts the link; `num_blocks` and `shm_path` describe its KV storage."""

    worker_id: str
    num_blocks: int
    shm_path: str  # "" for transports that stream the bytes


@dataclass(frozen=True, slots=True)
class Rejected:
    """The receiver refuses the link (layout mismatch at registration) and closes it."""

    reason: str


Frame = Message | Hello | Welcome | Rejected


@lru_cache(maxsize=64)
def _layout(layout: KVLayout) -> tuple[Any, ...]:
    """Packed as a msgpack array; cached because every chunk of a link carries the same layout."""
    return (layout.model_revision, layout.dtype, layout.block_size, layout.num_layers, layout.num_kv_heads,
            layout.head_dim)


def _tid(transfer_id: TransferId) -> list[Any]:
    return [transfer_id.request_id, transfer_id.sample_index]


@lru_cache(maxsize=256)
def _block_runs(block_ids: tuple[int, ...]) -> tuple[int, ...]:
    """`(first_id, num_blocks, ...)`: each maximal run of ids ascending by one, in table order.

    Cached: every layer's chunk of a prefill step carries the same two tables.
    """
    if not block_ids:
        return ()
    first = block_ids[0]
    if block_ids == tuple(range(first, first + len(block_ids))):
        return (first, len(block_ids))  # the common case, compared at C speed
    runs: list[int] = []
    for block_id in block_ids:
        if runs and block_id == runs[-2] + runs[-1]:
            runs[-1] += 1
        else:
            runs += (block_id, 1)
    return tuple(runs)


def _block_ids(runs: list[int]) -> tuple[int, ...]:
    if len(runs) == 2 and type(runs[0]) is int and type(runs[1]) is int and runs[1] > 0:
        return tuple(range(runs[0], runs[0] + runs[1]))  # one run (a fresh pool's table), at C speed
    firsts, nums = runs[0::2], runs[1::2]
    if len(firsts) != len(nums) or (nums and min(nums) <= 0):
        raise ValueError(f"block runs must be (first, count > 0) pairs, got {runs!r}")
    if nums and max(nums) == 1:
        return tuple(firsts)  # a fully fragmented table: no run to expand
    return tuple(chain.from_iterable(map(range, firsts, map(add, firsts, nums))))


@lru_cache(maxsize=64)
def _decode_layout(*fields: Any) -> KVLayout:
    """Layouts repeat in every chunk of a link; validating each once keeps decoding off the hot path."""
    return KVLayout(*fields)


def encode(frame: Frame) -> bytes:
    if isinstance(frame, ReserveRequest):
        fields: list[Any] = ["reserve", _tid(frame.transfer_id), _layout(frame.layout), frame.num_tokens]
    elif isinstance(frame, LayerChunk):
        fields = ["chunk", _tid(frame.transfer_id), _layout(frame.layout), frame.layer_index, frame.first_position,
                  frame.num_valid_tokens, _block_runs(frame.src_block_ids), _block_runs(frame.dst_block_ids)]
    elif isinstance(frame, SourceDone):
        token = frame.first_token
        fields = ["done", _tid(frame.transfer_id), frame.num_tokens,
                  [token.token_id, token.logprob, [list(pair) for pair in token.top_logprobs],
                   token.num_cached_tokens]]
    elif isinstance(frame, ReserveGranted):
        fields = ["grant", _tid(frame.transfer_id), list(frame.dst_block_ids)]
    elif isinstance(frame, ReserveRefused):
        fields = ["refuse", _tid(frame.transfer_id), frame.reason]
    elif isinstance(frame, Ack):
        fields = ["ack", _tid(frame.transfer_id)]
    elif isinstance(frame, Abort):
        fields = ["abort", _tid(frame.transfer_id), frame.cause.value, frame.reason]
    elif isinstance(frame, Hello):
        fields = ["hello", frame.worker_id, _layout(frame.layout)]
    elif isinstance(frame, Welcome):
        fields = ["welcome", frame.worker_id, frame.num_blocks, frame.shm_path]
    elif isinstance(frame, Rejected):
        fields = ["rejected", frame.reason]
    else:
        raise TypeError(f"cannot encode {type(frame).__name__}")
    return msgpack.packb(fields, use_bin_type=True)


def decode(data: bytes) -> Frame:
    try:
        fields = msgpack.unpackb(data, raw=False, strict_map_key=True)
        tag, rest = fields[0], fields[1:]
        return _DECODERS[tag](*rest)
    except (KeyError, TypeError, IndexError, ValueError, msgpack.UnpackException) as error:
        raise FrameError(f"malformed transfer frame: {error!r}") from error


def _decode_first_token(token_id: int, logprob: float, top: list[list[Any]], num_cached_tokens: int) -> FirstToken:
    return FirstToken(int(token_id), float(logprob), tuple((int(t), float(lp)) for t, lp in top),
                      int(num_cached_tokens))


_DECODERS: dict[str, Any] = {
    "reserve": lambda tid, layout, num: ReserveRequest(TransferId(*tid), KVLayout(*layout), num),
    "chunk": lambda tid, layout, layer, first, num, src, dst: LayerChunk(
        TransferId(*tid), _decode_layout(*layout), layer, first, num, _block_ids(src), _block_ids(dst)),
    "done": lambda tid, num, token: SourceDone(TransferId(*tid), num, _decode_first_token(*token)),
    "grant": lambda tid, dst: ReserveGranted(TransferId(*tid), tuple(dst)),
    "refuse": lambda tid, reason: ReserveRefused(TransferId(*tid), reason),
    "ack": lambda tid: Ack(TransferId(*tid)),
    "abort": lambda tid, cause, reason: Abort(TransferId(*tid), AbortCause(cause), reason),
    "hello": lambda worker_id, layout: Hello(worker_id, KVLayout(*layout)),
    "welcome": lambda worker_id, num_blocks, shm_path: Welcome(worker_id, num_blocks, shm_path),
    "rejected": lambda reason: Rejected(reason),
}
