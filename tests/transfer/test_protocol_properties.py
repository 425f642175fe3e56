"""Property test: random interleavings of handoff events, network faults and time, on both legs at once.

The network holds in-flight messages in each direction and may deliver any of them, drop,
duplicate or reorder them; the driver streams, finishes, cancels, fails, adopts and loses peers at
random. After every step both legs and both pools pass `check_invariants`; at the end, once time
has run past every lease and the network is drained, no block is reserved or held on either side.

The machine keeps its own model of the destination's fences (transfer/destination.py): a leg the destination
ends itself in RESERVED or RECEIVING before its SourceDone keeps its blocks until the source's Abort or
SourceDone for it arrives, its lease passes, or the link is lost. It checks the count of fenced blocks
against that model, every destination block against the pool (none leaked, none released twice), and the
point of the fence: while a source still streams into blocks the destination gave up less than a lease ago,
those blocks are not back in the pool.
"""

from __future__ import annotations

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvbaton.transfer import (
    Abort,
    DestinationState,
    Message,
    Outgoing,
    ReserveGranted,
    SourceDone,
    SourceState,
    TransferId,
)
from tests.transfer.helpers import FIRST, LAYOUT, LEASE_S, make_legs

TIDS = tuple(TransferId(f"req-{i // 2}", i % 2) for i in range(3))
NUM_TOKENS = (5, 9, 12)  # 2, 3 and 3 destination blocks: 8 > 6, so reservations compete
FENCEABLE = (DestinationState.RESERVED, DestinationState.RECEIVING)


class HandoffMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.legs = make_legs(num_src_blocks=12, num_dst_blocks=6)
        self.legs.source.tombstone_s = self.legs.destination.tombstone_s = float("inf")
        self.now = 0.0
        self.to_dst: list[Outgoing] = []
        self.to_src: list[Outgoing] = []
        self.src_blocks: dict[TransferId, tuple[int, ...]] = {}  # the prefill request's own blocks
        self.next_chunk: dict[TransferId, int] = {}  # chunk index into (layer, half) order
        self.adopted: list[tuple[int, ...]] = []
        self.request_blocks: dict[TransferId, tuple[int, ...]] = {}  # kept after the request lets go
        # the model of the destination's fences
        self.dst_blocks: dict[TransferId, tuple[int, ...]] = {}  # as granted
        self.fenced: dict[TransferId, float] = {}  # transfer -> when its fence lifts by time
        self.dst_ended_at: dict[TransferId, float] = {}

    # -- the destination's steps, through the fence model -------------------------------------------

    def _destination_step(self, step: str, *args: object) -> list[Outgoing]:
        """Run one destination call; a leg it aborts itself (in RESERVED or RECEIVING, before its SourceDone) is
        fenced for a lease from now."""
        destination = self.legs.destination
        fenceable = {tid for tid in TIDS if destination.knows(tid) and destination.state(tid) in FENCEABLE
                     and not destination.has_first_token(tid)}
        replies = getattr(destination, step)(*args)
        for reply in replies:
            tid = reply.message.transfer_id
            if isinstance(reply.message, ReserveGranted):
                self.dst_blocks[tid] = reply.message.dst_block_ids
            elif isinstance(reply.message, Abort) and tid in fenceable:
                assert tid not in self.fenced
                self.fenced[tid] = self.now + LEASE_S
                event("destination fenced a leg")
        self.to_src += replies
        return replies

    def _to_destination(self, message: Message) -> None:
        if isinstance(message, (Abort, SourceDone)) and self.fenced.pop(message.transfer_id, None) is not None:
            event(f"fence lifted by the source's {type(message).__name__}")
        self._destination_step("on_message", "p0", message, self.now)

    def _to_source(self, message: Message) -> None:
        answer = self.legs.source.on_message(message, self.now)
        # only a live leg answers, and only an abort: with its own, after its last write
        assert all(isinstance(message, Abort) and isinstance(a.message, Abort) for a in answer), answer
        self.to_dst += answer

    @rule(index=st.integers(0, 2))
    def start(self, index: int) -> None:
        tid = TIDS[index]
        if tid in self.src_blocks or not self.legs.src_pool.can_allocate(3):
            return
        self.src_blocks[tid] = tuple(self.legs.src_pool.allocate(LAYOUT.num_blocks_for(NUM_TOKENS[index])))
        self.request_blocks[tid] = self.src_blocks[tid]
        self.next_chunk[tid] = 0
        self.to_dst.append(self.legs.source.start(tid, "d0", NUM_TOKENS[index], self.now))

    @rule(index=st.integers(0, 2))
    def stream_or_finish(self, index: int) -> None:
        tid = TIDS[index]
        if tid not in self.src_blocks or self.legs.source.state(tid) is not SourceState.STREAMING:
            return
        chunk = self.next_chunk[tid]
        if chunk == 2 * LAYOUT.num_layers:
            self.to_dst.append(self.legs.source.finish(tid, FIRST, self.now))
            return
        num_tokens, half = NUM_TOKENS[index], NUM_TOKENS[index] // 2
        first, num = (0, half) if chunk % 2 == 0 else (half, num_tokens - half)
        blocks = LAYOUT.block_range(first, num)
        self.to_dst.append(self.legs.source.stream(tid, chunk // 2, first, num,
                                                   self.src_blocks[tid][blocks.start:blocks.stop], self.now))
        self.next_chunk[tid] = chunk + 1

    @rule()
    def progress(self) -> None:
        """A calm stretch: every transfer takes a step and the network delivers everything in order."""
        for index in range(len(TIDS)):
            self.stream_or_finish(index)
        while self.to_dst or self.to_src:
            if self.to_dst:
                self._to_destination(self.to_dst.pop(0).message)
            if self.to_src:
                self._to_source(self.to_src.pop(0).message)

    @rule(index=st.integers(0, 2))
    def release_request_blocks(self, index: int) -> None:
        """The prefill request leaves its scheduler; only the leg's own references keep the blocks."""
        tid = TIDS[index]
        # The prefill keeps its request's blocks at least until the last chunk is streamed.
        producing = (SourceState.RESERVING, SourceState.STREAMING)
        if self.src_blocks.get(tid) and self.legs.source.state(tid) not in producing:
            self.legs.src_pool.release(self.src_blocks[tid])
            self.src_blocks[tid] = ()

    @precondition(lambda self: self.to_dst)
    @rule(data=st.data(), mode=st.sampled_from(["deliver", "deliver", "deliver", "drop", "duplicate"]))
    def network_to_destination(self, data: st.DataObject, mode: str) -> None:
        item = self.to_dst[data.draw(st.integers(0, len(self.to_dst) - 1))]
        if mode != "duplicate":
            self.to_dst.remove(item)
        if mode != "drop":
            self._to_destination(item.message)

    @precondition(lambda self: self.to_src)
    @rule(data=st.data(), mode=st.sampled_from(["deliver", "deliver", "drop", "duplicate"]))
    def network_to_source(self, data: st.DataObject, mode: str) -> None:
        item = self.to_src[data.draw(st.integers(0, len(self.to_src) - 1))]
        if mode != "duplicate":
            self.to_src.remove(item)
        if mode != "drop":
            self._to_source(item.message)

    @rule(dt=st.sampled_from([0.1, 0.2, 0.5, LEASE_S]))
    def advance_time(self, dt: float) -> None:
        self.now += dt
        self.to_dst += self.legs.source.expire(self.now)
        for tid, until in list(self.fenced.items()):
            if self.now >= until:  # a silent source: the fence lifts after a lease
                del self.fenced[tid]
                event("fence lifted by time")
        self._destination_step("expire", self.now)

    @rule(index=st.integers(0, 2), side=st.sampled_from(["source", "destination"]), fail=st.booleans(),
          roll=st.integers(0, 2))
    def cancel_or_fail(self, index: int, side: str, fail: bool, roll: int) -> None:
        tid = TIDS[index]
        if roll != 0:  # faults on one in three draws, so that many transfers also complete
            return
        if side == "source" and tid in self.src_blocks:
            leg = self.legs.source
            self.to_dst += leg.fail(tid, self.now, "boom") if fail else leg.cancel(tid, self.now)
        elif side == "destination" and self.legs.destination.knows(tid):
            if fail:
                self._destination_step("fail", tid, self.now, "boom")
            else:
                self._destination_step("cancel", tid, self.now)

    @rule(index=st.integers(0, 2))
    def adopt(self, index: int) -> None:
        tid = TIDS[index]
        if self.legs.destination.knows(tid) and self.legs.destination.state(tid) is DestinationState.COMPLETE:
            self.adopted.append(self.legs.destination.adopt(tid, self.now).block_ids)

    @rule(roll=st.integers(0, 4))
    def lose_peers(self, roll: int) -> None:
        if roll != 0:
            return
        self.legs.source.on_peer_lost("d0", self.now)
        self.legs.destination.on_peer_lost("p0", self.now)  # peer_lost_fence_s 0: every fence lifts at once
        self.fenced.clear()
        self.to_dst.clear()
        self.to_src.clear()

    @invariant()
    def consistent(self) -> None:
        self.legs.check()
        destination, dst_pool = self.legs.destination, self.legs.dst_pool
        for tid in TIDS:
            if destination.knows(tid) and destination.state(tid) not in FENCEABLE + (DestinationState.COMPLETE,):
                self.dst_ended_at.setdefault(tid, self.now)  # time moves only before an expire: it ended now
        assert destination.num_fenced_blocks == sum(len(self.dst_blocks[tid]) for tid in self.fenced)
        # every destination block is free, reserved or fenced by one leg, or the engine's: none leaked or freed twice
        assert dst_pool.num_used_blocks == destination.num_reserved_blocks + sum(map(len, self.adopted))
        for tid in self.src_blocks:
            ended_at = self.dst_ended_at.get(tid)
            if self.legs.source.state(tid) is SourceState.STREAMING and ended_at is not None \
                    and self.now < ended_at + LEASE_S:
                # the source may still write into the blocks the destination gave up: they must stay out of the pool
                assert tid in self.fenced, f"{tid}: the source streams into blocks no longer fenced"
                assert all(dst_pool.ref_count(b) > 0 for b in self.dst_blocks[tid])
        for tid in self.src_blocks:
            if self.legs.source.state(tid) is SourceState.DONE:
                # the source only lets go after the destination had every layer and the first token
                assert self.legs.destination.was_completed(tid)
            if self.legs.source.state(tid) is SourceState.AWAITING_ACK:
                # every streamed source block stays allocated until the ack, whoever else let go of it
                assert all(self.legs.src_pool.ref_count(b) > 0 for b in self.request_blocks[tid])

    def teardown(self) -> None:
        for _ in range(4):  # drain: late messages may open (and lease-expire) one more reservation
            while self.to_dst or self.to_src:
                if self.to_dst:
                    self.to_src += self.legs.destination.on_message("p0", self.to_dst.pop(0).message, self.now)
                if self.to_src:
                    self.to_dst += self.legs.source.on_message(self.to_src.pop(0).message, self.now)
            self.now += 2 * LEASE_S
            self.to_dst += self.legs.source.expire(self.now)
            self.to_src += self.legs.destination.expire(self.now)
        assert not self.to_dst and not self.to_src
        for tid in self.src_blocks:
            event(f"source {self.legs.source.state(tid).value}")
        event(f"adopted {len(self.adopted)}")
        for blocks in self.src_blocks.values():
            self.legs.src_pool.release(blocks)
        for blocks in self.adopted:
            self.legs.dst_pool.release(blocks)  # the decode engine finishes those requests
        self.legs.check()
        assert self.legs.source.num_live_transfers == 0 and self.legs.source.num_held_blocks == 0
        assert self.legs.destination.num_live_transfers == 0 and self.legs.destination.num_reserved_blocks == 0
        assert self.legs.destination.num_fenced_blocks == 0
        assert self.legs.src_pool.num_used_blocks == 0 and self.legs.dst_pool.num_used_blocks == 0


HandoffMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=50, deadline=None, derandomize=True)
test_handoff_machine = HandoffMachine.TestCase
