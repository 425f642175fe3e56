"""Handoff messages and transport handshake frames to and from msgpack bytes (never pickle).

A link's handshake is Challenge -> Hello -> Welcome | Rejected (the proofs they carry: `link_auth`).
A frame header is a msgpack array `[tag, *fields]`; nested values (layout, transfer id, first
token) are arrays too. A layer chunk's block tables travel as runs `[first_id, num_blocks, ...]`
(a fresh pool's table is one run), so a prefill step's 30+ chunks cost a few bytes each rather
than one integer per block. `decode` rejects unknown tags and malformed fields in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import chain
from operator import add, index
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
class Challenge:
    """First frame on a new link, from the receiver: the nonce the sender's proof must cover (`link_auth`)."""

    nonce: bytes


@dataclass(frozen=True, slots=True)
class Hello:
    """The sender's answer: the sending (prefill) worker, the KV layout it will send, its own nonce and its
    proof of the cluster secret over both nonces and these fields (`kvbaton.transfer.link_auth`)."""

    worker_id: str
    layout: KVLayout
    nonce: bytes = b""
    proof: bytes = b""


@dataclass(frozen=True, slots=True)
class Welcome:
    """The receiver accepts the link; `num_blocks` and `shm_path` describe its KV storage; `proof` is its own
    proof of the cluster secret."""

    worker_id: str
    num_blocks: int
    shm_path: str  # "" for transports that stream the bytes
    proof: bytes = b""


@dataclass(frozen=True, slots=True)
class Rejected:
    """The receiver refuses the link and closes it: `kind` "auth" (no proof of the cluster secret), "layout"
    (its KV layout differs) or "linked" (that worker id already has a link)."""

    reason: str
    kind: str = "layout"


Frame = Message | Challenge | Hello | Welcome | Rejected
HANDSHAKE_FRAMES = (Challenge, Hello, Welcome, Rejected)


@lru_cache(maxsize=64)
def layout_to_wire(layout: KVLayout) -> tuple[Any, ...]:
    """Packed as a msgpack array; cached because every chunk of a link carries the same layout."""
    return (layout.model_revision, layout.dtype, layout.block_size, layout.num_layers, layout.num_kv_heads,
            layout.head_dim, layout.tensor_parallel_size, layout.pipeline_parallel_size)


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


def _typed(value: Any, kind: type) -> Any:
    """`value` when msgpack decoded it as exactly `kind` (a bool or float where an int belongs is malformed)."""
    if type(value) is not kind:
        raise ValueError(f"expected {kind.__name__}, got {value!r}")
    return value


def _decode_tid(request_id: Any, sample_index: Any) -> TransferId:
    return TransferId(_typed(request_id, str), _typed(sample_index, int))


def _block_ids(runs: list[int]) -> tuple[int, ...]:
    if len(runs) == 2 and type(runs[0]) is int and type(runs[1]) is int and runs[1] > 0:
        return tuple(range(runs[0], runs[0] + runs[1]))  # one run (a fresh pool's table), at C speed
    firsts, nums = runs[0::2], runs[1::2]
    if len(firsts) != len(nums) or (nums and min(nums) <= 0):
        raise ValueError(f"block runs must be (first, count > 0) pairs, got {runs!r}")
    if nums and max(nums) == 1:
        return tuple(map(index, firsts))  # a fully fragmented table: no run to expand (`index` rejects non-ints)
    return tuple(chain.from_iterable(map(range, firsts, map(add, firsts, nums))))


@lru_cache(maxsize=64, typed=True)
def _decode_layout(model_revision: Any, dtype: Any, *sizes: Any) -> KVLayout:
    """Layouts repeat in every chunk of a link; validating each once keeps decoding off the hot path."""
    return KVLayout(_typed(model_revision, str), _typed(dtype, str), *(_typed(size, int) for size in sizes))


def encode(frame: Frame) -> bytes:
    if isinstance(frame, ReserveRequest):
        fields: list[Any] = ["reserve", _tid(frame.transfer_id), layout_to_wire(frame.layout), frame.num_tokens]
    elif isinstance(frame, LayerChunk):
        fields = ["chunk", _tid(frame.transfer_id), layout_to_wire(frame.layout), frame.layer_index,
                  frame.first_position, frame.num_valid_tokens, _block_runs(frame.src_block_ids),
                  _block_runs(frame.dst_block_ids)]
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
    elif isinstance(frame, Challenge):
        fields = ["challenge", frame.nonce]
    elif isinstance(frame, Hello):
        fields = ["hello", frame.worker_id, layout_to_wire(frame.layout), frame.nonce, frame.proof]
    elif isinstance(frame, Welcome):
        fields = ["welcome", frame.worker_id, frame.num_blocks, frame.shm_path, frame.proof]
    elif isinstance(frame, Rejected):
        fields = ["rejected", frame.reason, frame.kind]
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


def _decode_chunk(tid: list[Any], layout: list[Any], layer: Any, first: Any, num: Any, src: list[int],
                  dst: list[int]) -> LayerChunk:
    if type(layer) is not int or type(first) is not int or type(num) is not int:
        raise ValueError(f"chunk layer and positions must be integers, got {layer!r}, {first!r}, {num!r}")
    return LayerChunk(_decode_tid(*tid), _decode_layout(*layout), layer, first, num, _block_ids(src), _block_ids(dst))


def _decode_first_token(token_id: int, logprob: float, top: list[list[Any]], num_cached_tokens: int) -> FirstToken:
    return FirstToken(int(token_id), float(logprob), tuple((int(t), float(lp)) for t, lp in top),
                      int(num_cached_tokens))


_DECODERS: dict[str, Any] = {
    "reserve": lambda tid, layout, num: ReserveRequest(_decode_tid(*tid), _decode_layout(*layout), _typed(num, int)),
    "chunk": _decode_chunk,
    "done": lambda tid, num, token: SourceDone(_decode_tid(*tid), _typed(num, int), _decode_first_token(*token)),
    "grant": lambda tid, dst: ReserveGranted(_decode_tid(*tid), tuple(map(index, _typed(dst, list)))),
    "refuse": lambda tid, reason: ReserveRefused(_decode_tid(*tid), _typed(reason, str)),
    "ack": lambda tid: Ack(_decode_tid(*tid)),
    "abort": lambda tid, cause, reason: Abort(_decode_tid(*tid), AbortCause(cause), _typed(reason, str)),
    "challenge": lambda nonce: Challenge(_typed(nonce, bytes)),
    "hello": lambda worker_id, layout, nonce, proof: Hello(_typed(worker_id, str), _decode_layout(*layout),
                                                           _typed(nonce, bytes), _typed(proof, bytes)),
    "welcome": lambda worker_id, num_blocks, shm_path, proof: Welcome(
        _typed(worker_id, str), _typed(num_blocks, int), _typed(shm_path, str), _typed(proof, bytes)),
    "rejected": lambda reason, kind: Rejected(_typed(reason, str), _typed(kind, str)),
}
