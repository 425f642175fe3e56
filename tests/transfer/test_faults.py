"""Scripted faults on real links: each ends within bounded time, cleanly, with zero blocks held on both workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from kvbaton.transfer import DestinationState, FailureAction, LayerChunk, Outcome, SourceDone, TransferId, action_for
from kvbaton.transfer.driver import send_all
from kvbaton.transfer.faults import FaultAction, FaultRule, FaultyTransport, InjectedFault
from tests.transfer.transport_helpers import (
    FIRST,
    KINDS,
    LAYOUT,
    Handoff,
    assert_kv_equal,
    make_handoff,
    open_link,
    shm_files,
    wait_until,
)

TID = TransferId("req-3", 0)
LEASE_S = 5.0
NUM_TOKENS = 10


@pytest.fixture(autouse=True)
def no_leaked_shm() -> Iterator[None]:
    before = shm_files()
    yield
    assert shm_files() == before, "a shared-memory segment was left in /dev/shm"


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


def _faulty(handoff: Handoff, *rules: FaultRule) -> FaultyTransport:
    faulty = FaultyTransport(handoff.link.sender, list(rules), clock=lambda: handoff.now)
    handoff.link.sender = faulty
    return faulty


def _stream_all(handoff: Handoff, src_blocks: tuple[int, ...]) -> None:
    for layer in range(LAYOUT.num_layers):
        handoff.stream_layer(TID, layer, 0, NUM_TOKENS, src_blocks)


def _assert_clean(handoff: Handoff, src_blocks: tuple[int, ...]) -> None:
    handoff.src_pool.release(src_blocks)
    for leg in (handoff.source, handoff.destination):
        leg.check_invariants()
        assert leg.num_live_transfers == 0
    assert handoff.src_pool.num_used_blocks == 0 and handoff.dst_pool.num_used_blocks == 0


def _start(handoff: Handoff) -> tuple[int, ...]:
    src_blocks = tuple(handoff.src_pool.allocate(LAYOUT.num_blocks_for(NUM_TOKENS)))
    handoff.reserve(TID, NUM_TOKENS)
    return src_blocks


def test_dropped_layer_expires_the_lease_then_recompute(kind: str) -> None:
    with open_link(kind) as link:
        handoff = make_handoff(link, lease_s=LEASE_S)
        faulty = _faulty(handoff, FaultRule(FaultAction.DROP, LayerChunk, layer_index=1))
        src_blocks = _start(handoff)
        _stream_all(handoff, src_blocks)
        send_all(faulty, handoff.source.finish(TID, FIRST, handoff.now))
        wait_until(lambda: handoff.destination.num_complete_layers(TID) == 2
                   and handoff.destination.has_first_token(TID), handoff.pump)
        assert not handoff.destination.is_layer_complete(TID, 1)
        assert handoff.destination.state(TID) is DestinationState.RECEIVING
        handoff.now += LEASE_S
        wait_until(lambda: handoff.source.outcome(TID) is Outcome.EXPIRED, handoff.pump)
        assert handoff.destination.outcome(TID) is Outcome.EXPIRED
        assert action_for(handoff.destination.outcome(TID), "recompute") is FailureAction.RECOMPUTE
        assert [action for action, _ in faulty.fired] == [FaultAction.DROP]
        _assert_clean(handoff, src_blocks)


def test_transfer_delayed_past_its_lease_is_reclaimed_and_the_late_message_ignored(kind: str) -> None:
    with open_link(kind) as link:
        handoff = make_handoff(link, lease_s=LEASE_S)
        faulty = _faulty(handoff, FaultRule(FaultAction.DELAY, SourceDone, delay_s=2 * LEASE_S))
        src_blocks = _start(handoff)
        _stream_all(handoff, src_blocks)
        send_all(faulty, handoff.source.finish(TID, FIRST, handoff.now))
        wait_until(lambda: handoff.destination.num_complete_layers(TID) == LAYOUT.num_layers, handoff.pump)
        handoff.now += LEASE_S  # both leases run out before the delayed SourceDone is released
        wait_until(lambda: handoff.source.outcome(TID) is Outcome.EXPIRED, handoff.pump)
        handoff.now += LEASE_S
        ignored = handoff.destination.num_ignored_messages
        wait_until(lambda: handoff.destination.num_ignored_messages > ignored, handoff.pump)  # the late SourceDone
        assert handoff.destination.outcome(TID) is Outcome.EXPIRED
        _assert_clean(handoff, src_blocks)


@pytest.mark.parametrize("action", [FaultAction.FAIL_BEFORE, FaultAction.FAIL_DURING, FaultAction.FAIL_AFTER])
def test_prefill_failure_around_a_layer_ends_the_decode_leg_at_once(kind: str, action: FaultAction) -> None:
    with open_link(kind) as link:
        handoff = make_handoff(link, lease_s=LEASE_S)
        _faulty(handoff, FaultRule(action, LayerChunk, layer_index=1))
        src_blocks = _start(handoff)
        handoff.stream_layer(TID, 0, 0, NUM_TOKENS, src_blocks)
        with pytest.raises(InjectedFault):
            handoff.stream_layer(TID, 1, 0, NUM_TOKENS, src_blocks)
        expected_layer1 = {FaultAction.FAIL_BEFORE: 0, FaultAction.FAIL_DURING: NUM_TOKENS // 2,
                           FaultAction.FAIL_AFTER: NUM_TOKENS}[action]
        wait_until(lambda: handoff.destination.num_tokens_received(TID, 1) == expected_layer1
                   and handoff.destination.num_complete_layers(TID) >= 1, handoff.pump)
        assert handoff.destination.is_layer_complete(TID, 1) is (action is FaultAction.FAIL_AFTER)
        if action is FaultAction.FAIL_AFTER:
            assert_kv_equal(handoff, src_blocks, handoff.source.dst_block_ids(TID), NUM_TOKENS, range(2))
        send_all(handoff.link.sender, handoff.source.fail(TID, handoff.now, "prefill crashed"))
        wait_until(lambda: handoff.destination.outcome(TID) is Outcome.FAILED, handoff.pump)  # no lease wait
        assert action_for(Outcome.FAILED, "fail") is FailureAction.ERROR
        _assert_clean(handoff, src_blocks)


def test_killed_link_fails_both_legs(kind: str) -> None:
    with open_link(kind) as link:
        handoff = make_handoff(link, lease_s=LEASE_S)
        _faulty(handoff, FaultRule(FaultAction.KILL_PEER, LayerChunk, layer_index=2))
        src_blocks = _start(handoff)
        with pytest.raises(InjectedFault):
            _stream_all(handoff, src_blocks)
        wait_until(lambda: handoff.source.outcome(TID) is Outcome.FAILED
                   and handoff.destination.outcome(TID) is Outcome.FAILED, handoff.pump)
        assert "lost the link" in handoff.destination.reason(TID)
        _assert_clean(handoff, src_blocks)


def test_decode_refuses_the_reservation_when_full(kind: str) -> None:
    with open_link(kind) as link:
        handoff = make_handoff(link)
        busy = handoff.dst_pool.allocate(handoff.dst_pool.num_blocks - 2)
        send_all(link.sender, handoff.source.start(TID, link.peer, NUM_TOKENS, handoff.now))
        wait_until(lambda: handoff.source.outcome(TID) is Outcome.REFUSED, handoff.pump)
        assert "need 3 KV blocks, 2 free" in handoff.source.reason(TID)
        assert action_for(Outcome.REFUSED, "recompute") is FailureAction.REQUEUE
        handoff.dst_pool.release(busy)
        _assert_clean(handoff, ())


@pytest.mark.parametrize("stage", ["queued", "prefilling", "transferring", "decoding"])
def test_cancellation_in_each_request_state_reaches_the_other_worker(kind: str, stage: str) -> None:
    with open_link(kind) as link:
        handoff = make_handoff(link)
        src_blocks = tuple(handoff.src_pool.allocate(LAYOUT.num_blocks_for(NUM_TOKENS)))
        send_all(link.sender, handoff.source.start(TID, link.peer, NUM_TOKENS, handoff.now))
        if stage != "queued":  # queued: the reservation request is still in flight
            wait_until(lambda: handoff.source.state(TID).value == "streaming", handoff.pump)
            handoff.stream_layer(TID, 0, 0, NUM_TOKENS, src_blocks)
        if stage in ("transferring", "decoding"):
            for layer in range(1, LAYOUT.num_layers):
                handoff.stream_layer(TID, layer, 0, NUM_TOKENS, src_blocks)
            send_all(link.sender, handoff.source.finish(TID, FIRST, handoff.now))
        if stage == "decoding":
            wait_until(lambda: handoff.source.outcome(TID) is Outcome.COMPLETED, handoff.pump)
            adopted = handoff.destination.adopt(TID, handoff.now)
            # the engine owns the blocks now: protocol cancellation is a no-op, the engine frees them
            assert handoff.destination.cancel(TID, handoff.now) == [] and handoff.source.cancel(TID, 0.0) == []
            handoff.dst_pool.release(adopted.block_ids)
        else:
            send_all(link.sender, handoff.source.cancel(TID, handoff.now, "client disconnected"))
            wait_until(lambda: handoff.destination.knows(TID)
                       and handoff.destination.outcome(TID) is Outcome.CANCELLED, handoff.pump)
            assert handoff.source.outcome(TID) is Outcome.CANCELLED
        _assert_clean(handoff, src_blocks)


_CHILD = textwrap.dedent("""
    import sys, time
    from kvbaton.cache.block_pool import BlockPool
    from kvbaton.transfer import HandoffSource, TransferId
    from kvbaton.transfer.driver import pump_source, send_all
    from kvbaton.transfer.transport_shm import ShmKVSender
    from kvbaton.transfer.transport_tcp import TcpKVSender
    from tests.transfer.transport_helpers import LAYOUT, SECRET, random_kv
    kind, port = sys.argv[1], int(sys.argv[2])
    sender = (TcpKVSender if kind == "tcp" else ShmKVSender)("p9", LAYOUT, secret=SECRET)
    peer = sender.connect(("127.0.0.1", port))
    pool, kv, tid = BlockPool(8), random_kv(LAYOUT, 8, 5), TransferId("req-3", 0)
    source = HandoffSource(LAYOUT, pool, 30.0)
    send_all(sender, source.start(tid, peer, 10, 0.0))
    while source.state(tid).value == "reserving":
        pump_source(sender, source, 0.0, 0.05)
    blocks = tuple(pool.allocate(3))
    chunk = source.stream(tid, 0, 0, 10, blocks, 0.0)
    sender.send(chunk.peer, chunk.message, kv)
    print("streamed", flush=True)
    time.sleep(60)  # killed here, mid-transfer
""")


@pytest.mark.parametrize("kind_", ["tcp", "shm"])
def test_prefill_process_killed_mid_transfer_frees_the_reservation(kind_: str) -> None:
    with open_link(kind_) as link:
        handoff = make_handoff(link, lease_s=30.0)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        child = subprocess.Popen([sys.executable, "-c", _CHILD, kind_, str(link.receiver.address[1])],
                                 cwd=root, stdout=subprocess.PIPE, text=True)
        try:
            wait_until(lambda: handoff.destination.knows(TID) and handoff.destination.num_complete_layers(TID) == 1,
                       lambda: handoff.pump(0.05), timeout_s=30.0)
            assert child.stdout is not None and child.stdout.readline().strip() == "streamed"
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=10)
            wait_until(lambda: handoff.destination.outcome(TID) is Outcome.FAILED, lambda: handoff.pump(0.05))
            assert "lost the link to p9" in handoff.destination.reason(TID)
            assert action_for(Outcome.FAILED, "recompute") is FailureAction.RECOMPUTE
            assert handoff.dst_pool.num_used_blocks == 0
        finally:
            if child.poll() is None:
                os.kill(child.pid, signal.SIGKILL)
                child.wait(timeout=10)
            if child.stdout is not None:
                child.stdout.close()
