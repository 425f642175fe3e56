"""Hot-path constructors of the handoff messages: the very values their dataclass `__init__` builds, faster.

Every simulated handoff builds a transfer id, a reserve request, a grant, a layer chunk per streamed
step, a done, an ack and an `Outgoing` envelope for each message, on both legs of both workers; the
live legs build the same. They are built from fields the legs have already checked, so these write
the slots directly (`kvbaton.cache.fast_init`: about half the cost of the frozen `__init__`).
Messages decoded from the wire (`kvbaton.transfer.codec`) keep the ordinary constructors.
"""

from __future__ import annotations

from kvbaton.cache.fast_init import slot_setters
from kvbaton.transfer.layout import KVLayout
from kvbaton.transfer.messages import (
    Ack,
    FirstToken,
    LayerChunk,
    Message,
    Outgoing,
    ReserveGranted,
    ReserveRequest,
    SourceDone,
    TransferId,
)

_new = object.__new__
_set_id_request, _set_id_sample = slot_setters(TransferId, ("request_id", "sample_index"))
_set_first_token_id, _set_first_logprob, _set_first_top, _set_first_cached = slot_setters(
    FirstToken, ("token_id", "logprob", "top_logprobs", "num_cached_tokens"))
_set_reserve_id, _set_reserve_layout, _set_reserve_tokens = slot_setters(
    ReserveRequest, ("transfer_id", "layout", "num_tokens"))
_set_chunk_id, _set_chunk_layout, _set_chunk_layer, _set_chunk_first, _set_chunk_valid, _set_chunk_src, \
    _set_chunk_dst = slot_setters(LayerChunk, ("transfer_id", "layout", "layer_index", "first_position",
                                               "num_valid_tokens", "src_block_ids", "dst_block_ids"))
_set_done_id, _set_done_tokens, _set_done_first = slot_setters(SourceDone, ("transfer_id", "num_tokens", "first_token"))
_set_grant_id, _set_grant_blocks = slot_setters(ReserveGranted, ("transfer_id", "dst_block_ids"))
(_set_ack_id,) = slot_setters(Ack, ("transfer_id",))
_set_peer, _set_message = slot_setters(Outgoing, ("peer", "message"))


def make_transfer_id(request_id: str, sample_index: int = 0) -> TransferId:
    """`TransferId(request_id, sample_index)`."""
    value = _new(TransferId)
    _set_id_request(value, request_id)
    _set_id_sample(value, sample_index)
    return value


def make_first_token(token_id: int, logprob: float, top_logprobs: tuple[tuple[int, float], ...] = (),
                     num_cached_tokens: int = 0) -> FirstToken:
    """`FirstToken(token_id, logprob, top_logprobs, num_cached_tokens)`."""
    value = _new(FirstToken)
    _set_first_token_id(value, token_id)
    _set_first_logprob(value, logprob)
    _set_first_top(value, top_logprobs)
    _set_first_cached(value, num_cached_tokens)
    return value


def make_outgoing(peer: str, message: Message) -> Outgoing:
    """`Outgoing(peer, message)`."""
    value = _new(Outgoing)
    _set_peer(value, peer)
    _set_message(value, message)
    return value


def make_reserve_request(transfer_id: TransferId, layout: KVLayout, num_tokens: int) -> ReserveRequest:
    """`ReserveRequest(transfer_id, layout, num_tokens)`."""
    value = _new(ReserveRequest)
    _set_reserve_id(value, transfer_id)
    _set_reserve_layout(value, layout)
    _set_reserve_tokens(value, num_tokens)
    return value


def make_layer_chunk(transfer_id: TransferId, layout: KVLayout, layer_index: int, first_position: int,
                     num_valid_tokens: int, src_block_ids: tuple[int, ...],
                     dst_block_ids: tuple[int, ...]) -> LayerChunk:
    """`LayerChunk(transfer_id, layout, layer_index, first_position, num_valid_tokens, src_block_ids,
    dst_block_ids)`."""
    value = _new(LayerChunk)
    _set_chunk_id(value, transfer_id)
    _set_chunk_layout(value, layout)
    _set_chunk_layer(value, layer_index)
    _set_chunk_first(value, first_position)
    _set_chunk_valid(value, num_valid_tokens)
    _set_chunk_src(value, src_block_ids)
    _set_chunk_dst(value, dst_block_ids)
    return value


def make_source_done(transfer_id: TransferId, num_tokens: int, first_token: FirstToken) -> SourceDone:
    """`SourceDone(transfer_id, num_tokens, first_token)`."""
    value = _new(SourceDone)
    _set_done_id(value, transfer_id)
    _set_done_tokens(value, num_tokens)
    _set_done_first(value, first_token)
    return value


def make_reserve_granted(transfer_id: TransferId, dst_block_ids: tuple[int, ...]) -> ReserveGranted:
    """`ReserveGranted(transfer_id, dst_block_ids)`."""
    value = _new(ReserveGranted)
    _set_grant_id(value, transfer_id)
    _set_grant_blocks(value, dst_block_ids)
    return value


def make_ack(transfer_id: TransferId) -> Ack:
    """`Ack(transfer_id)`."""
    value = _new(Ack)
    _set_ack_id(value, transfer_id)
    return value
