"""The handoff protocol's messages (seed 001 order): reserve -> grant|refuse -> layer chunks -> done -> ack.

Every message names its transfer; one transfer id per (request, sample) so `n > 1` hands off each
sample separately. Messages carry metadata only: the KV bytes of a `LayerChunk` are moved by the
transport (written in place for shm, streamed after the frame for tcp) before the message becomes
visible to the destination.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvbaton.transfer.layout import KVLayout


@dataclass(frozen=True, slots=True, order=True)
class TransferId:
    request_id: str
    sample_index: int = 0

    def __str__(self) -> str:
        return f"{self.request_id}#{self.sample_index}"


@dataclass(frozen=True, slots=True)
class FirstToken:
    """The token the prefill worker sampled after the last prompt position; decode starts from it. It also
    carries how many prompt tokens the prefill worker's prefix cache supplied, for the request's usage."""

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()
    num_cached_tokens: int = 0


class AbortCause(Enum):
    CANCELLED = "cancelled"  # a client or the router gave up on the request
    FAILED = "failed"  # a worker, the transport or the peer's protocol check failed
    EXPIRED = "expired"  # a lease ran out before the leg could finish


# -- source (prefill) -> destination (decode) -------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReserveRequest:
    transfer_id: TransferId
    layout: KVLayout
    num_tokens: int  # prompt tokens whose KV will be handed over


@dataclass(frozen=True, slots=True)
class LayerChunk:
    """KV of one layer for token positions [first_position, first_position + num_valid_tokens)."""

    transfer_id: TransferId
    layout: KVLayout
    layer_index: int
    first_position: int
    num_valid_tokens: int
    src_block_ids: tuple[int, ...]  # source blocks covering the positions, in logical order
    dst_block_ids: tuple[int, ...]  # the reserved destination blocks for the same positions

    @property
    def end_position(self) -> int:
        return self.first_position + self.num_valid_tokens


@dataclass(frozen=True, slots=True)
class SourceDone:
    """Every layer chunk has been sent; the destination acks once it has received them all."""

    transfer_id: TransferId
    num_tokens: int
    first_token: FirstToken


# -- destination -> source --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReserveGranted:
    transfer_id: TransferId
    dst_block_ids: tuple[int, ...]  # blocks for positions 0.., block_size tokens each


@dataclass(frozen=True, slots=True)
class ReserveRefused:
    transfer_id: TransferId
    reason: str  # backpressure ("no free blocks") or a layout mismatch


@dataclass(frozen=True, slots=True)
class Ack:
    """All layers are complete on the destination: the source may release its blocks."""

    transfer_id: TransferId


# -- either direction -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Abort:
    """The sender's leg has ended without success; the receiver ends its leg too."""

    transfer_id: TransferId
    cause: AbortCause
    reason: str


Message = ReserveRequest | LayerChunk | SourceDone | ReserveGranted | ReserveRefused | Ack | Abort


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A message a protocol leg wants sent to `peer` (a worker id); the caller hands it to a transport."""

    peer: str
    message: Message
