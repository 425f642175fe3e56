"""The handoff state machines step by step: the happy path, backpressure, leases, cancellation, bad chunks."""

from __future__ import annotations

import pytest

from kvbaton.transfer import (
    Abort,
    AbortCause,
    Ack,
    DestinationState,
    FailureAction,
    LayerChunk,
    Outcome,
    ProtocolError,
    ReserveGranted,
    ReserveRefused,
    SourceState,
    TransferId,
    action_for,
)
from tests.transfer.helpers import FIRST, LAYOUT, LEASE_S, OTHER_LAYOUT, Legs, make_legs

TID = TransferId("req-1", 0)


def _granted(legs: Legs, num_tokens: int = 10, tid: TransferId = TID) -> tuple[int, ...]:
    replies = legs.to_destination(legs.source.start(tid, "d0", num_tokens, now=0.0), now=0.0)
    assert isinstance(replies[0].message, ReserveGranted)
    legs.to_source(replies, now=0.0)
    return replies[0].message.dst_block_ids


def _stream_all(legs: Legs, src_block_ids: tuple[int, ...], num_tokens: int = 10, now: float = 1.0) -> list:
    replies = []
    for layer in range(LAYOUT.num_layers):
        # two chunks per layer: positions [0, 6) and [6, num_tokens), the second starting mid-block
        replies += legs.to_destination(legs.source.stream(TID, layer, 0, 6, src_block_ids[:2], now), now)
        replies += legs.to_destination(legs.source.stream(TID, layer, 6, num_tokens - 6, src_block_ids[1:], now), now)
    return replies


def test_happy_path_in_seed_order_releases_source_only_after_ack() -> None:
    legs = make_legs()
    src_blocks = tuple(legs.src_pool.allocate(3))  # the prefill request's own blocks
    dst_blocks = _granted(legs)
    assert dst_blocks == (0, 1, 2) and legs.destination.state(TID) is DestinationState.RESERVED
    assert _stream_all(legs, src_blocks) == []
    assert legs.destination.is_layer_complete(TID, 0) and legs.destination.num_complete_layers(TID) == 2
    legs.src_pool.release(src_blocks)  # the request leaves the prefill scheduler; the leg keeps the blocks
    assert legs.src_pool.num_used_blocks == 3 and legs.source.num_held_blocks == 3
    replies = legs.to_destination(legs.source.finish(TID, FIRST, now=2.0), now=2.0)
    assert [r.message for r in replies] == [Ack(TID)]
    assert legs.source.state(TID) is SourceState.AWAITING_ACK and legs.src_pool.num_used_blocks == 3
    legs.to_source(replies, now=2.0)
    assert legs.source.outcome(TID) is Outcome.COMPLETED and legs.src_pool.num_used_blocks == 0
    adopted = legs.destination.adopt(TID, now=3.0)
    assert (adopted.block_ids, adopted.num_tokens, adopted.first_token) == ((0, 1, 2), 10, FIRST)
    assert legs.destination.num_reserved_blocks == 0 and legs.dst_pool.num_used_blocks == 3  # engine owns them
    legs.check()


def test_layer_is_unreadable_until_every_position_arrived() -> None:
    legs = make_legs()
    src = tuple(legs.src_pool.allocate(3))
    _granted(legs)
    legs.to_destination(legs.source.stream(TID, 1, 0, 6, src[:2], now=0.5), now=0.5)
    assert not legs.destination.is_layer_complete(TID, 1)
    assert legs.destination.state(TID) is DestinationState.RECEIVING
    legs.to_destination(legs.source.stream(TID, 1, 6, 4, src[1:], now=0.5), now=0.5)
    assert legs.destination.is_layer_complete(TID, 1) and not legs.destination.is_layer_complete(TID, 0)


def test_state_or_none_is_state_for_a_known_leg_and_none_for_an_unknown_one() -> None:
    legs = make_legs()
    assert legs.destination.state_or_none(TID) is None and legs.source.state_or_none(TID) is None
    with pytest.raises(ProtocolError):
        legs.destination.state(TID)
    _granted(legs)
    assert legs.destination.state_or_none(TID) is legs.destination.state(TID) is DestinationState.RESERVED


def test_backpressure_refuses_and_prefill_cannot_start() -> None:
    legs = make_legs(num_dst_blocks=2)
    replies = legs.to_destination(legs.source.start(TID, "d0", 10, now=0.0), now=0.0)
    assert isinstance(replies[0].message, ReserveRefused) and "need 3 KV blocks, 2 free" in replies[0].message.reason
    with pytest.raises(ProtocolError):
        legs.source.stream(TID, 0, 0, 4, (0,), now=0.0)  # still RESERVING: nowhere to land
    legs.to_source(replies, now=0.0)
    assert legs.source.outcome(TID) is Outcome.REFUSED and legs.destination.num_refusals == 1
    assert action_for(Outcome.REFUSED, "recompute") is FailureAction.REQUEUE
    assert legs.dst_pool.num_used_blocks == 0


def test_layout_mismatch_is_refused_at_reservation_and_per_chunk() -> None:
    legs = make_legs(layout=OTHER_LAYOUT)
    replies = legs.to_destination(legs.source.start(TID, "d0", 10, now=0.0), now=0.0)
    assert isinstance(replies[0].message, ReserveRefused)
    assert replies[0].message.reason == "KV layout mismatch: model_revision 'rev-1' != expected 'rev-2'"
    # A chunk whose layout differs from the reservation's fails the transfer and frees the blocks (once the source,
    # which may still be writing into them, has answered the abort).
    legs = make_legs()
    dst = _granted(legs)
    bad = LayerChunk(TID, OTHER_LAYOUT, 0, 0, 4, (0,), dst[:1])
    replies = legs.destination.on_message("p0", bad, now=1.0)
    assert isinstance(replies[0].message, Abort) and replies[0].message.cause is AbortCause.FAILED
    assert legs.destination.outcome(TID) is Outcome.FAILED and legs.destination.num_live_transfers == 0
    assert legs.destination.num_fenced_blocks == legs.dst_pool.num_used_blocks == 3
    answers = legs.to_source(replies, now=1.0)
    assert legs.source.outcome(TID) is Outcome.FAILED
    assert [type(a.message) for a in answers] == [Abort] and answers[0].message.cause is AbortCause.FAILED
    assert legs.to_destination(answers, now=1.0) == []
    assert legs.destination.num_fenced_blocks == legs.dst_pool.num_used_blocks == 0
    legs.check()


def test_wrong_handles_and_overlapping_chunks_fail_the_transfer() -> None:
    legs = make_legs()
    dst = _granted(legs)
    wrong = LayerChunk(TID, LAYOUT, 0, 0, 4, (0,), (dst[1],))
    replies = legs.destination.on_message("p0", wrong, 1.0)
    assert "not the reserved ones" in replies[0].message.reason and legs.dst_pool.num_used_blocks == 3  # fenced
    legs.abort_round_trip(replies, now=1.0)
    assert legs.source.outcome(TID) is Outcome.FAILED and legs.dst_pool.num_used_blocks == 0
    legs = make_legs()
    src = tuple(legs.src_pool.allocate(3))
    _granted(legs)
    legs.to_destination(legs.source.stream(TID, 0, 0, 6, src[:2], now=1.0), now=1.0)
    replies = legs.to_destination(legs.source.stream(TID, 0, 4, 6, src[1:], now=1.0), now=1.0)
    assert "overlaps" in replies[0].message.reason and legs.destination.outcome(TID) is Outcome.FAILED
    assert legs.destination.num_fenced_blocks == legs.dst_pool.num_used_blocks == 3  # the source may still write
    legs.abort_round_trip(replies, now=1.0)
    assert legs.dst_pool.num_used_blocks == 0 and legs.destination.num_reserved_blocks == 0
    legs.check()


def test_duplicate_and_late_messages_are_ignored() -> None:
    legs = make_legs()
    src = tuple(legs.src_pool.allocate(3))
    _granted(legs)
    chunk = legs.source.stream(TID, 0, 0, 10, src, now=1.0)
    legs.to_destination([chunk, chunk], now=1.0)
    assert legs.destination.num_ignored_messages == 1 and legs.destination.num_complete_layers(TID) == 1
    answers = legs.to_source(legs.destination.cancel(TID, now=2.0), now=2.0)
    assert legs.source.outcome(TID) is Outcome.CANCELLED and legs.src_pool.num_used_blocks == 3  # only ours
    assert legs.to_destination(chunk, now=3.0) == []  # late chunk after the cancel
    assert legs.destination.num_ignored_messages == 2 and legs.destination.num_fenced_blocks == 3
    assert legs.source.on_message(Ack(TID), now=3.0) == [] and legs.source.num_ignored_messages == 1
    assert legs.destination.cancel(TID, now=3.0) == [] and legs.source.cancel(TID, now=3.0) == []
    assert legs.to_destination(answers, now=3.0) == [] and legs.dst_pool.num_used_blocks == 0  # the fence lifts
    assert legs.to_destination(answers, now=3.0) == [] and legs.dst_pool.num_used_blocks == 0  # once
    again = Abort(TID, AbortCause.CANCELLED, "cancelled again")
    assert legs.source.on_message(again, now=3.0) == []  # an ended leg answers no abort: no ping-pong
    legs.check()


def test_unanswered_reservation_and_missing_layer_expire_on_both_sides() -> None:
    legs = make_legs()
    legs.source.start(TID, "d0", 10, now=0.0)  # the ReserveRequest is lost
    aborts = legs.source.expire(now=LEASE_S)
    assert legs.source.outcome(TID) is Outcome.EXPIRED and aborts[0].message.cause is AbortCause.EXPIRED
    # A dropped layer chunk: the destination's lease runs out, its blocks return, the source hears of it.
    legs = make_legs()
    src = tuple(legs.src_pool.allocate(3))
    _granted(legs)
    legs.to_destination(legs.source.stream(TID, 0, 0, 10, src, now=1.0), now=1.0)
    legs.source.stream(TID, 1, 0, 10, src, now=1.0)  # dropped in transit
    legs.to_destination(legs.source.finish(TID, FIRST, now=1.5), now=1.5)
    assert legs.destination.expire(now=1.0 + LEASE_S - 0.01) == []
    aborts = legs.destination.expire(now=1.5 + LEASE_S)
    # SourceDone had arrived: the source writes no more, so the blocks return at once (no fence).
    assert legs.destination.outcome(TID) is Outcome.EXPIRED and legs.dst_pool.num_used_blocks == 0
    legs.abort_round_trip(aborts, now=1.5 + LEASE_S)
    assert legs.source.outcome(TID) is Outcome.EXPIRED and legs.source.num_held_blocks == 0
    assert legs.dst_pool.num_used_blocks == 0
    legs.check()
    assert action_for(Outcome.EXPIRED, "recompute") is FailureAction.RECOMPUTE
    assert action_for(Outcome.EXPIRED, "fail") is FailureAction.ERROR


def test_complete_but_never_adopted_blocks_go_back_on_lease_expiry() -> None:
    legs = make_legs()
    src = tuple(legs.src_pool.allocate(3))
    _granted(legs)
    for layer in range(2):
        legs.to_destination(legs.source.stream(TID, layer, 0, 10, src, now=1.0), now=1.0)
    legs.to_destination(legs.source.finish(TID, FIRST, now=1.0), now=1.0)
    assert legs.destination.state(TID) is DestinationState.COMPLETE
    legs.destination.expire(now=1.0 + LEASE_S)
    assert legs.destination.state(TID) is DestinationState.EXPIRED and legs.dst_pool.num_used_blocks == 0


@pytest.mark.parametrize("stage", ["reserving", "streaming", "awaiting_ack", "reserved", "receiving"])
@pytest.mark.parametrize("side", ["source", "destination"])
def test_cancellation_from_either_side_in_every_state_frees_everything(stage: str, side: str) -> None:
    legs = make_legs()
    src = tuple(legs.src_pool.allocate(3))
    request = legs.source.start(TID, "d0", 10, now=0.0)
    if stage != "reserving":
        legs.to_source(legs.to_destination(request, now=0.0), now=0.0)
    if stage in ("streaming", "awaiting_ack", "receiving"):
        legs.to_destination(legs.source.stream(TID, 0, 0, 10, src, now=0.5), now=0.5)
    if stage == "awaiting_ack":
        legs.source.finish(TID, FIRST, now=0.6)  # SourceDone still in flight
    if side == "source":
        legs.to_destination(legs.source.cancel(TID, now=1.0, reason="client left"), now=1.0)
    else:
        aborts = legs.destination.cancel(TID, now=1.0) if legs.destination.knows(TID) else []
        if legs.destination.knows(TID):  # no SourceDone yet: the source may still write, the blocks stay out
            assert legs.destination.num_fenced_blocks == legs.dst_pool.num_used_blocks == 3
        answers = legs.to_source(aborts, now=1.0)
        legs.to_destination(legs.source.cancel(TID, now=1.0), now=1.0)  # the router's cancel reaches the source too
        legs.check()
        assert legs.to_destination(answers, now=1.0) == []  # the source's answer lifts the fence
    assert legs.source.outcome(TID) is Outcome.CANCELLED
    if legs.destination.knows(TID):
        assert legs.destination.outcome(TID) is Outcome.CANCELLED
    legs.src_pool.release(src)
    assert legs.src_pool.num_used_blocks == 0 and legs.dst_pool.num_used_blocks == 0
    assert action_for(Outcome.CANCELLED, "fail") is FailureAction.DROP
    legs.check()


def test_peer_loss_fails_live_legs_and_one_transfer_per_sample() -> None:
    legs = make_legs()
    sample0, sample1 = TransferId("req-1", 0), TransferId("req-1", 1)
    _granted(legs, num_tokens=4, tid=sample0)
    _granted(legs, num_tokens=4, tid=sample1)
    assert legs.destination.num_reserved_blocks == 2
    with pytest.raises(ProtocolError):
        legs.source.start(sample0, "d0", 4, now=0.0)
    assert legs.destination.on_peer_lost("p0", now=1.0) == [sample0, sample1]
    assert legs.source.on_peer_lost("d0", now=1.0) == [sample0, sample1]
    assert legs.dst_pool.num_used_blocks == 0 and legs.destination.outcome(sample1) is Outcome.FAILED
    legs.check()


def test_a_complete_transfer_survives_the_loss_of_its_prefill_worker() -> None:
    legs = make_legs()
    src = tuple(legs.src_pool.allocate(3))
    _granted(legs)
    for layer in range(LAYOUT.num_layers):
        legs.to_destination(legs.source.stream(TID, layer, 0, 10, src, now=1.0), now=1.0)
    legs.to_destination(legs.source.finish(TID, FIRST, now=1.0), now=1.0)  # the Ack is lost with the link
    assert legs.destination.on_peer_lost("p0", now=2.0) == []
    assert legs.destination.adopt(TID, now=2.0).block_ids == (0, 1, 2)
    assert legs.source.on_peer_lost("d0", now=2.0) == [TID] and legs.source.num_held_blocks == 0


def test_an_abort_that_overtakes_its_reservation_leaves_nothing_reserved() -> None:
    legs = make_legs()
    reserve = legs.source.start(TID, "d0", 10, now=0.0)
    cancel = legs.source.cancel(TID, now=0.1, reason="client left")
    assert legs.to_destination(cancel, now=0.2) == []  # arrives first (links may reorder)
    assert legs.to_destination(reserve, now=0.3) == []  # stale: no grant, no blocks
    assert legs.destination.outcome(TID) is Outcome.CANCELLED and legs.dst_pool.num_used_blocks == 0
    legs.check()
    legs.destination.expire(now=0.3 + legs.destination.tombstone_s)
    assert not legs.destination.knows(TID)  # the tombstone goes like any ended leg's


def test_a_reservation_makes_room_by_evicting_what_a_cache_holds_unused() -> None:
    """A decode worker's prefix cache may hold the blocks a reservation needs; `make_room` (its cache's evict) frees
    them, so the reservation is refused only when even the evictable cache cannot make room."""
    legs = make_legs(num_dst_blocks=4)
    cached = legs.dst_pool.allocate(3)  # held by a "cache" that lets go when asked

    def evict(num_blocks: int) -> int:
        freed = [cached.pop() for _ in range(min(num_blocks, len(cached)))]
        legs.dst_pool.release(freed)
        return len(freed)

    legs.destination.make_room = evict
    replies = legs.to_destination(legs.source.start(TID, "d0", 10, now=0.0), now=0.0)  # 3 blocks, 1 free
    assert isinstance(replies[0].message, ReserveGranted) and len(cached) == 1
    replies = legs.to_destination(legs.source.start(TransferId("other", 0), "d0", 10, now=0.0), now=0.0)
    assert isinstance(replies[0].message, ReserveRefused)  # 1 cached + 0 free < 3: refused
    legs.check()
