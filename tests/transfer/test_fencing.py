"""Fencing: blocks of a leg the destination ended itself stay out of its pool while the source may still write.

The source writes into the destination's reserved blocks until the destination's Abort reaches it (through its
own mapping for shm and in-process links, through the decode worker's receiver thread for tcp). Before fencing,
the destination released them at once, so another request could be given blocks that a stale layer then
overwrote. Now they go back only when the source's Abort (its answer to ours) or SourceDone arrives, when a lease
passes, or when the link dies (at once, or after the transport's write grace). See transfer/destination.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvbaton.cache.block_pool import BlockPool
from kvbaton.transfer import (
    Abort,
    AbortCause,
    Ack,
    DestinationState,
    HandoffSource,
    Outcome,
    Outgoing,
    ReserveGranted,
    ReserveRequest,
    SourceDone,
    SourceState,
    TransferId,
)
from kvbaton.transfer.driver import send_all
from tests.transfer import transport_helpers as th
from tests.transfer.helpers import FIRST, LAYOUT, LEASE_S, Legs, make_legs

pytestmark = pytest.mark.timeout(30)

TID = TransferId("req-f", 0)
NUM_TOKENS = 10  # 3 blocks of 4 on both sides


@pytest.fixture(autouse=True)
def no_leaked_shm() -> Iterator[None]:
    before = th.shm_files()
    yield
    assert th.shm_files() == before, "a shared-memory segment was left in /dev/shm"


# -- the protocol legs alone ------------------------------------------------------------------------------------


def _granted(legs: Legs, tid: TransferId = TID, num_tokens: int = NUM_TOKENS, now: float = 0.0) -> tuple[int, ...]:
    """Reserve on the destination and deliver the grant; returns the source's own blocks for the request."""
    src = tuple(legs.src_pool.allocate(LAYOUT.num_blocks_for(num_tokens)))
    replies = legs.to_destination(legs.source.start(tid, "d0", num_tokens, now), now)
    assert isinstance(replies[0].message, ReserveGranted)
    assert legs.to_source(replies, now) == []
    return src


def _stream(legs: Legs, src: tuple[int, ...], layer: int, now: float, tid: TransferId = TID,
            num_tokens: int = NUM_TOKENS) -> list[Outgoing]:
    return legs.to_destination(legs.source.stream(tid, layer, 0, num_tokens, src, now), now)


def _free_blocks_exclude(legs: Legs, blocks: tuple[int, ...]) -> None:
    """Another request takes every free block of the destination: it must not be given any of `blocks`."""
    others = legs.dst_pool.allocate(legs.dst_pool.num_free_blocks)
    assert not set(blocks) & set(others), f"fenced blocks {set(blocks) & set(others)} were handed out"
    legs.dst_pool.release(others)


def _cancelled_mid_stream(cancel_at: float) -> tuple[Legs, tuple[int, ...], tuple[int, ...], list[Outgoing]]:
    """A leg that received layer 0, cancelled by the destination at `cancel_at`: (legs, src, dst, its aborts)."""
    legs = make_legs()
    src = _granted(legs)
    dst = legs.source.dst_block_ids(TID)
    _stream(legs, src, 0, 1.0)
    return legs, src, dst, legs.destination.cancel(TID, now=cancel_at)


def _assert_fenced(legs: Legs, blocks: tuple[int, ...]) -> None:
    assert legs.destination.num_fenced_blocks == legs.destination.num_reserved_blocks == len(blocks)
    assert legs.dst_pool.num_used_blocks == len(blocks)
    assert all(legs.dst_pool.ref_count(b) == 1 for b in blocks)
    _free_blocks_exclude(legs, blocks)
    legs.check()


def _assert_released(legs: Legs) -> None:
    assert legs.destination.num_fenced_blocks == legs.destination.num_reserved_blocks == 0
    assert legs.dst_pool.num_used_blocks == 0
    legs.check()


@pytest.mark.parametrize("ending", ["cancel-reserved", "cancel", "fail", "expire", "bad-chunk"])
def test_a_leg_the_destination_ends_stays_fenced_until_the_sources_abort(ending: str) -> None:
    legs = make_legs()
    src = _granted(legs)
    dst = legs.source.dst_block_ids(TID)
    now = 1.0
    if ending != "cancel-reserved":
        assert _stream(legs, src, 0, now) == []
        assert legs.destination.state(TID) is DestinationState.RECEIVING
    if ending == "expire":
        now += LEASE_S
        aborts = legs.destination.expire(now)
    elif ending == "fail":
        aborts = legs.destination.fail(TID, now, "decode worker failed")
    elif ending == "bad-chunk":
        aborts = legs.to_destination(legs.source.stream(TID, 0, 0, 6, src[:2], now), now)  # overlaps layer 0
    else:
        aborts = legs.destination.cancel(TID, now)
    cause = {"expire": AbortCause.EXPIRED, "fail": AbortCause.FAILED, "bad-chunk": AbortCause.FAILED}.get(
        ending, AbortCause.CANCELLED)
    assert [(type(a.message), a.message.cause) for a in aborts] == [(Abort, cause)]
    assert legs.destination.num_live_transfers == 0 and legs.destination.outcome(TID) is Outcome(cause.value)
    _assert_fenced(legs, dst)
    # the source, not yet aware, streams its next layer: the chunk is ignored, the fence holds
    assert _stream(legs, src, 1, now) == []
    _assert_fenced(legs, dst)
    answers = legs.to_source(aborts, now)
    assert legs.source.outcome(TID) is Outcome(cause.value) and legs.source.num_held_blocks == 0
    assert [(type(a.message), a.message.cause, a.peer) for a in answers] == [(Abort, cause, "d0")]
    _assert_fenced(legs, dst)  # still in flight
    assert legs.to_destination(answers, now) == []  # the fence lifts; the destination answers nothing (no ping-pong)
    _assert_released(legs)
    assert legs.to_destination(answers, now) == []  # a duplicate of the answer releases nothing twice
    _assert_released(legs)
    assert legs.destination.outcome(TID) is Outcome(cause.value)  # the leg is remembered, without blocks
    legs.src_pool.release(src)


def test_a_source_done_that_crossed_the_abort_lifts_the_fence() -> None:
    legs = make_legs()
    src = _granted(legs)
    dst = legs.source.dst_block_ids(TID)
    for layer in range(LAYOUT.num_layers):
        _stream(legs, src, layer, 1.0)
    done = legs.source.finish(TID, FIRST, now=1.0)  # in flight while the destination cancels
    aborts = legs.destination.cancel(TID, now=1.0)
    _assert_fenced(legs, dst)
    assert legs.to_destination(done, now=1.1) == []  # no Ack for an ended leg; sent after the last write: fence lifts
    _assert_released(legs)
    assert legs.destination.outcome(TID) is Outcome.CANCELLED and not legs.destination.was_completed(TID)
    assert legs.source.state(TID) is SourceState.AWAITING_ACK
    answers = legs.to_source(aborts, now=1.2)
    assert legs.source.outcome(TID) is Outcome.CANCELLED and legs.source.num_held_blocks == 0
    ignored = legs.destination.num_ignored_messages
    assert legs.to_destination(answers, now=1.3) == []  # nothing to lift any more, nothing sent back
    assert legs.destination.num_ignored_messages == ignored + 1
    _assert_released(legs)
    legs.src_pool.release(src)


def test_the_fence_lifts_after_a_lease_when_the_source_stays_silent() -> None:
    legs, src, dst, aborts = _cancelled_mid_stream(2.0)  # the Abort is lost; the source says nothing
    for now in (2.0, 3.0, 2.0 + LEASE_S - 0.01):
        assert legs.destination.expire(now) == []
        _assert_fenced(legs, dst)
    assert legs.destination.expire(2.0 + LEASE_S) == []
    _assert_released(legs)
    assert legs.destination.knows(TID) and legs.destination.outcome(TID) is Outcome.CANCELLED  # a tombstone
    # a late answer (the Abort was only slow) changes nothing
    answers = legs.to_source(aborts, now=8.0)
    assert legs.to_destination(answers, now=8.0) == []
    _assert_released(legs)
    legs.src_pool.release(src)


def test_only_the_legs_own_source_lifts_its_fence() -> None:
    legs, src, dst, aborts = _cancelled_mid_stream(1.0)
    # another prefill worker's Abort or SourceDone for the same id says nothing about p0's writes
    assert legs.destination.on_message("p1", Abort(TID, AbortCause.CANCELLED, "not mine"), 1.0) == []
    assert legs.destination.on_message("p1", SourceDone(TID, NUM_TOKENS, FIRST), 1.0) == []
    _assert_fenced(legs, dst)
    # nor do p0's other messages: a duplicate reservation is stale (no grant, nothing reserved), an Ack is ignored
    assert legs.destination.on_message("p0", ReserveRequest(TID, LAYOUT, NUM_TOKENS), 1.0) == []
    assert legs.destination.on_message("p0", Ack(TID), 1.0) == []
    assert legs.destination.num_fenced_blocks == 3 and legs.dst_pool.num_used_blocks == 3
    legs.destination.check_invariants()
    legs.abort_round_trip(aborts, now=1.5)
    _assert_released(legs)
    legs.src_pool.release(src)


def test_losing_the_link_lifts_fences_at_once_without_a_write_grace() -> None:
    legs = make_legs(num_dst_blocks=16)
    other = TransferId("req-g", 0)
    src = _granted(legs)
    other_src = _granted(legs, other)
    _stream(legs, src, 0, 1.0)
    _stream(legs, other_src, 0, 1.0, tid=other)
    legs.destination.cancel(TID, now=1.0)
    assert legs.destination.num_fenced_blocks == 3 and legs.dst_pool.num_used_blocks == 6
    legs.check()
    assert legs.destination.peer_lost_fence_s == 0.0
    assert legs.destination.on_peer_lost("p0", now=2.0) == [other]  # the live leg fails, unfenced
    assert legs.destination.outcome(other) is Outcome.FAILED
    _assert_released(legs)
    legs.src_pool.release(src + other_src)


def test_losing_the_link_with_a_write_grace_fences_its_legs_for_the_grace_only() -> None:
    legs = make_legs(num_dst_blocks=16)
    legs.destination.peer_lost_fence_s = 2.0  # as on an shm receiver: the peer may write once more
    fenced, live, complete, elsewhere = (TransferId(f"req-{i}", 0) for i in range(4))
    src = _granted(legs, fenced)
    live_src = _granted(legs, live)
    complete_src = _granted(legs, complete, num_tokens=4)
    _stream(legs, src, 0, 1.0, tid=fenced)
    _stream(legs, live_src, 0, 1.0, tid=live)
    for layer in range(LAYOUT.num_layers):
        _stream(legs, complete_src, layer, 1.0, tid=complete, num_tokens=4)
    assert [r.message for r in legs.to_destination(legs.source.finish(complete, FIRST, 1.0), 1.0)] == [Ack(complete)]
    # a leg of another prefill worker p1, fenced too
    p1_pool = BlockPool(4)
    p1, p1_src = HandoffSource(LAYOUT, p1_pool, LEASE_S), tuple(p1_pool.allocate(1))
    grant = legs.to_destination(p1.start(elsewhere, "d0", 4, 1.0), 1.0, peer="p1")
    assert p1.on_message(grant[0].message, 1.0) == []
    legs.to_destination(p1.stream(elsewhere, 0, 0, 4, p1_src, 1.0), 1.0, peer="p1")
    legs.destination.cancel(elsewhere, now=1.0)  # fenced until 1.0 + LEASE_S
    legs.destination.cancel(fenced, now=1.0)  # fenced until 1.0 + LEASE_S
    assert legs.destination.num_fenced_blocks == 4
    assert legs.destination.on_peer_lost("p0", now=2.0) == [live]
    # the failed live leg and the leg fenced already: held until 2.0 + the grace; the COMPLETE one keeps its KV
    assert legs.destination.num_fenced_blocks == 3 + 3 + 1 and legs.dst_pool.num_used_blocks == 3 + 3 + 1 + 1
    adopted = legs.destination.adopt(complete, now=2.5)  # the engine's now
    legs.check()
    assert legs.destination.expire(3.99) == [] and legs.destination.num_fenced_blocks == 7
    legs.check()
    assert legs.destination.expire(4.0) == []
    assert legs.destination.num_fenced_blocks == 1 and legs.dst_pool.num_used_blocks == 1 + 1  # p1's stays
    legs.check()
    assert legs.destination.expire(1.0 + LEASE_S) == []  # p1 never answered: its lease lifts it
    assert legs.destination.num_fenced_blocks == 0 and legs.dst_pool.num_used_blocks == 1
    legs.dst_pool.release(adopted.block_ids)
    _assert_released(legs)
    legs.src_pool.release(src + live_src + complete_src)


def test_a_fenced_leg_is_never_forgotten_with_its_blocks() -> None:
    legs = make_legs()
    legs.destination.tombstone_s = 1.0  # shorter than the lease: the leg would be forgotten inside its fence
    src = _granted(legs)
    dst = legs.source.dst_block_ids(TID)
    _stream(legs, src, 0, 0.5)
    aborts = legs.destination.cancel(TID, now=0.5)
    assert legs.destination.expire(1.0) == []
    assert legs.destination.knows(TID)
    _assert_fenced(legs, dst)
    assert legs.destination.expire(1.5) == []  # its tombstone is up: it goes, and its blocks with it
    assert not legs.destination.knows(TID)
    _assert_released(legs)
    # the answer arrives after the leg was forgotten: nothing is released twice or reserved
    assert legs.to_destination(legs.to_source(aborts, 2.0), 2.0) == []
    _assert_released(legs)
    legs.src_pool.release(src)


@pytest.mark.parametrize("case", ["complete-cancel", "complete-expire", "first-token-cancel", "first-token-expire"])
def test_a_leg_ended_after_its_source_done_is_not_fenced(case: str) -> None:
    """SourceDone is sent after the source's last write: a leg that had it frees its blocks at once."""
    legs = make_legs()
    src = _granted(legs)
    layers = range(LAYOUT.num_layers) if case.startswith("complete") else range(1)  # else a layer is lost
    for layer in layers:
        _stream(legs, src, layer, 1.0)
    replies = legs.to_destination(legs.source.finish(TID, FIRST, 1.0), 1.0)
    assert legs.destination.has_first_token(TID)
    if case.startswith("complete"):
        assert legs.destination.state(TID) is DestinationState.COMPLETE
        assert legs.to_source(replies, 1.0) == [] and legs.source.outcome(TID) is Outcome.COMPLETED
    else:
        assert replies == [] and legs.destination.state(TID) is DestinationState.RECEIVING
    if case.endswith("cancel"):
        aborts = legs.destination.cancel(TID, now=2.0)
    else:
        assert legs.destination.expire(1.0 + LEASE_S - 0.01) == []
        aborts = legs.destination.expire(1.0 + LEASE_S)
    assert [type(a.message) for a in aborts] == [Abort]
    _assert_released(legs)
    answers = legs.to_source(aborts, 7.0)
    assert len(answers) == (0 if case.startswith("complete") else 1)  # a DONE source answers nothing
    assert legs.to_destination(answers, 7.0) == []
    _assert_released(legs)
    legs.src_pool.release(src)


# -- real transports --------------------------------------------------------------------------------------------


def _receiving(handoff: th.Handoff, num_tokens: int = 8) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Reserve and land layer 0: the destination leg is RECEIVING. Returns (source blocks, destination blocks)."""
    src = tuple(handoff.src_pool.allocate(th.LAYOUT.num_blocks_for(num_tokens)))
    handoff.reserve(TID, num_tokens)
    handoff.stream_layer(TID, 0, 0, num_tokens, src)
    th.wait_until(lambda: handoff.destination.state(TID) is DestinationState.RECEIVING, handoff.pump)
    return src, handoff.source.dst_block_ids(TID)


@pytest.mark.parametrize("kind", th.KINDS)
def test_a_stale_layer_after_the_destinations_cancel_lands_only_in_fenced_blocks(kind: str) -> None:
    with th.open_link(kind) as link:
        handoff = th.make_handoff(link)
        src, dst = _receiving(handoff)
        aborts = handoff.destination.cancel(TID, handoff.now)  # the Abort is not sent yet
        assert handoff.destination.num_fenced_blocks == handoff.dst_pool.num_used_blocks == len(dst)
        # another request takes every block the pool can give: none of the leg's is among them
        others = handoff.dst_pool.allocate(handoff.dst_pool.num_free_blocks)
        assert not set(dst) & set(others) and handoff.dst_pool.num_free_blocks == 0
        # the prefill worker, not yet aware, streams its next layer into the reserved blocks
        handoff.stream_layer(TID, 1, 0, 8, src)
        assert send_all(link.receiver, aborts) == []
        th.wait_until(lambda: handoff.destination.num_fenced_blocks == 0, handoff.pump)
        assert handoff.source.outcome(TID) is Outcome.CANCELLED and handoff.source.num_held_blocks == 0
        assert handoff.destination.outcome(TID) is Outcome.CANCELLED
        handoff.destination.check_invariants()
        # the stale layer did land, in the fenced blocks; the other request's blocks were never touched
        th.assert_kv_equal(handoff, src, dst, 8, range(2))
        assert not np.any(link.dst_kv[:, :, sorted(others)]), "a stale write reached blocks given to another request"
        # only now are the leg's blocks free for another request
        assert sorted(handoff.dst_pool.allocate(len(dst))) == sorted(dst)
        handoff.dst_pool.release(list(dst) + others)
        handoff.src_pool.release(src)
        for _ in range(3):
            handoff.pump()
        assert handoff.dst_pool.num_used_blocks == 0 and handoff.src_pool.num_used_blocks == 0
        handoff.dst_pool.check_invariants()


@pytest.mark.parametrize("kind", th.KINDS)
def test_a_lost_link_holds_the_blocks_for_the_transports_write_grace(kind: str) -> None:
    with th.open_link(kind) as link:
        handoff = th.make_handoff(link)
        grace = link.receiver.peer_lost_write_grace_s
        assert grace == (2.0 if kind == "shm" else 0.0)  # shm writes through its own mapping, then sends
        handoff.destination.peer_lost_fence_s = grace  # as the decode worker builds it (engine/handoff_decode.py)
        src, dst = _receiving(handoff)
        link.sender.disconnect(link.peer)
        th.wait_until(lambda: handoff.destination.state(TID) is DestinationState.FAILED, handoff.pump)
        th.wait_until(lambda: handoff.source.outcome(TID) is Outcome.FAILED, handoff.pump)
        assert handoff.destination.num_fenced_blocks == handoff.dst_pool.num_used_blocks == (len(dst) if grace else 0)
        handoff.destination.check_invariants()
        handoff.now = grace - 0.01
        handoff.pump()
        assert handoff.destination.num_fenced_blocks == (len(dst) if grace else 0)
        handoff.now = grace
        handoff.pump()
        assert handoff.destination.num_fenced_blocks == handoff.dst_pool.num_used_blocks == 0
        handoff.destination.check_invariants()
        handoff.src_pool.release(src)
        assert handoff.src_pool.num_used_blocks == 0
