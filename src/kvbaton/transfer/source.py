"""The prefill side of handoffs: reserve on the decode worker, stream layer chunks, hold source blocks until the ack.

One `HandoffSource` per prefill worker drives every outgoing transfer. It never reads a clock: `now`
(seconds) is passed to each call, so the simulator drives the same code with simulated time.

Block ownership: while a leg is STREAMING or AWAITING_ACK it holds one extra reference (in the
worker's `BlockPool`) on every source block it has streamed, so the blocks stay valid even if the
request has already left the scheduler. The references are dropped exactly once, when the leg
ends: on the ack (DONE), or on cancel / failure / lease expiry.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvbaton.transfer.legs import LegTable
from kvbaton.transfer.messages import (
    Abort,
    AbortCause,
    Ack,
    FirstToken,
    LayerChunk,
    Message,
    Outgoing,
    ReserveGranted,
    ReserveRefused,
    ReserveRequest,
    SourceDone,
    TransferId,
)


def num_due_to_reserve(ahead_tokens: int, waiting_prompt_tokens: Iterable[int], reserve_ahead_tokens: int) -> int:
    """Late reservation: how many handoffs at the head of a prefill worker's FIFO (prompt lengths in FIFO order)
    ask for their decode blocks now. The head goes while the worker has at most `reserve_ahead_tokens` prompt
    tokens to compute ahead of it (`ahead_tokens`: queued, or of handoffs reserving); each one that goes adds its
    prompt. The live prefill worker and the simulator both apply this rule."""
    num_due = 0
    for prompt_tokens in waiting_prompt_tokens:
        if ahead_tokens > reserve_ahead_tokens:
            break
        ahead_tokens += prompt_tokens
        num_due += 1
    return num_due
from kvbaton.transfer.states import SOURCE_LIVE, SOURCE_TRANSITIONS, Outcome, ProtocolError, SourceState, source_outcome

_END_STATE = {AbortCause.CANCELLED: SourceState.CANCELLED, AbortCause.FAILED: SourceState.FAILED,
              AbortCause.EXPIRED: SourceState.EXPIRED}


@dataclass(slots=True)
class _SourceLeg:
    transfer_id: TransferId
    peer: str
    num_tokens: int
    state: SourceState
    lease_expires_at: float
    dst_block_ids: tuple[int, ...] = ()
    held_block_ids: list[int] = field(default_factory=list)  # one reference each, taken by this leg
    held_set: set[int] = field(default_factory=set)  # the same ids, for the per-chunk membership test
    ended_at: float = 0.0
    reason: str = ""


class HandoffSource(LegTable[_SourceLeg]):
    """All outgoing handoffs of one prefill worker."""

    live_states = SOURCE_LIVE
    transitions = SOURCE_TRANSITIONS
    end_states = _END_STATE
    peer_lost_states = SOURCE_LIVE  # nothing can be streamed or acknowledged without the peer

    # -- queries ---------------------------------------------------------------------------------

    def outcome(self, transfer_id: TransferId) -> Outcome | None:
        return source_outcome(self._leg(transfer_id).state)

    def dst_block_ids(self, transfer_id: TransferId) -> tuple[int, ...]:
        return self._leg(transfer_id).dst_block_ids

    @property
    def num_held_blocks(self) -> int:
        return sum(len(self._legs[tid].held_block_ids) for tid in self._live)  # only live legs hold blocks

    # -- caller-driven steps ---------------------------------------------------------------------

    def start(self, transfer_id: TransferId, peer: str, num_tokens: int, now: float) -> Outgoing:
        """Ask decode worker `peer` to reserve blocks; the prefill may start only once it is granted."""
        if transfer_id in self._legs:
            raise ProtocolError(f"transfer {transfer_id} was already started")
        if num_tokens <= 0:
            raise ProtocolError(f"transfer {transfer_id}: num_tokens must be positive, got {num_tokens}")
        self._add(_SourceLeg(transfer_id, peer, num_tokens, SourceState.RESERVING, now + self.lease_s))
        return Outgoing(peer, ReserveRequest(transfer_id, self.layout, num_tokens))

    def stream(self, transfer_id: TransferId, layer_index: int, first_position: int, num_valid_tokens: int,
               src_block_ids: tuple[int, ...], now: float) -> Outgoing:
        """The chunk message for KV just produced; the caller's transport moves the bytes with it."""
        leg = self._live_leg(transfer_id, SourceState.STREAMING)
        blocks = self.layout.block_range(first_position, num_valid_tokens)
        if not 0 <= layer_index < self.layout.num_layers:
            raise ProtocolError(f"transfer {transfer_id}: layer {layer_index} out of range")
        if num_valid_tokens <= 0 or first_position < 0 or first_position + num_valid_tokens > leg.num_tokens:
            raise ProtocolError(f"transfer {transfer_id}: positions [{first_position}, "
                                f"{first_position + num_valid_tokens}) outside [0, {leg.num_tokens})")
        if len(src_block_ids) != len(blocks):
            raise ProtocolError(f"transfer {transfer_id}: {len(src_block_ids)} source blocks for {len(blocks)} slots")
        # Every layer of a step streams the same table: after the first, the leg already holds it all.
        held_set = leg.held_set
        if not held_set:  # the first chunk: nothing held yet
            new_block_ids = sorted(set(src_block_ids))
        elif held_set.issuperset(src_block_ids):
            new_block_ids = []
        else:
            new_block_ids = sorted(set(src_block_ids) - held_set)
        if new_block_ids:
            self.pool.ref(new_block_ids)
            leg.held_block_ids.extend(new_block_ids)
            held_set.update(new_block_ids)
        leg.lease_expires_at = now + self.lease_s
        dst_block_ids = leg.dst_block_ids[blocks.start:blocks.stop]
        return Outgoing(leg.peer, LayerChunk(transfer_id, self.layout, layer_index, first_position,
                                                        num_valid_tokens, tuple(src_block_ids), dst_block_ids))

    def release_held(self, transfer_id: TransferId) -> None:
        """The leg's request was preempted, and its recompute may need the blocks the leg streamed from: let go of
        them, the leg staying live. Their KV has already left (every `KVTransport` reads a chunk's bytes before
        its send returns), and the recompute streams only positions not sent yet, from its new blocks."""
        leg = self._legs.get(transfer_id)
        if leg is not None and leg.held_block_ids:
            self._release_blocks(leg)

    def finish(self, transfer_id: TransferId, first_token: FirstToken, now: float) -> Outgoing:
        """Every chunk is sent: tell the destination, then wait (holding the blocks) for its ack."""
        leg = self._live_leg(transfer_id, SourceState.STREAMING)
        self._move(leg, SourceState.AWAITING_ACK)
        leg.lease_expires_at = now + self.lease_s
        return Outgoing(leg.peer, SourceDone(transfer_id, leg.num_tokens, first_token))

    # -- messages from the destination -----------------------------------------------------------

    def on_message(self, message: Message, now: float) -> list[Outgoing]:
        """Apply a message from the decode worker; late, duplicate and unknown ones are ignored."""
        leg = self._legs.get(message.transfer_id)
        if leg is None or leg.state not in SOURCE_LIVE:
            self.num_ignored_messages += 1
            return []
        if isinstance(message, ReserveGranted) and leg.state is SourceState.RESERVING:
            if len(message.dst_block_ids) != self.layout.num_blocks_for(leg.num_tokens):
                return self._abort(leg.transfer_id, AbortCause.FAILED, "grant has the wrong number of blocks", now)
            leg.dst_block_ids = message.dst_block_ids
            leg.lease_expires_at = now + self.lease_s
            self._move(leg, SourceState.STREAMING)
        elif isinstance(message, ReserveRefused) and leg.state is SourceState.RESERVING:
            self._end(leg, SourceState.REFUSED, message.reason, now)
        elif isinstance(message, Ack) and leg.state is SourceState.AWAITING_ACK:
            self._end(leg, SourceState.DONE, "", now)
        elif isinstance(message, Abort):
            self._end(leg, _END_STATE[message.cause], f"peer: {message.reason}", now)
            # Sent after this leg's last write: the destination keeps the blocks it reserved out of its pool
            # until it knows we stopped writing into them (see transfer/destination.py, fencing).
            return [Outgoing(leg.peer, Abort(leg.transfer_id, message.cause, "stopped on the peer's abort"))]
        else:
            self.num_ignored_messages += 1
        return []

    # -- internals -------------------------------------------------------------------------------

    def _release_blocks(self, leg: _SourceLeg) -> None:
        self.pool.release(leg.held_block_ids)
        leg.held_block_ids = []
        leg.held_set = set()

    def _live_leg(self, transfer_id: TransferId, expected: SourceState) -> _SourceLeg:
        leg = self._leg(transfer_id)
        if leg.state is not expected:
            raise ProtocolError(f"transfer {transfer_id} is {leg.state.value}, not {expected.value}")
        return leg

    def check_invariants(self) -> None:
        """Raise AssertionError if a leg's blocks or state disagree with the pool or each other."""
        self._check_live_ids()
        for leg in self._legs.values():
            assert len(set(leg.held_block_ids)) == len(leg.held_block_ids), f"{leg.transfer_id} holds a block twice"
            assert leg.held_set == set(leg.held_block_ids), f"{leg.transfer_id}: held set and list differ"
            if leg.state not in (SourceState.STREAMING, SourceState.AWAITING_ACK):
                assert not leg.held_block_ids, f"{leg.transfer_id} is {leg.state.value} but holds blocks"
            if leg.state is not SourceState.RESERVING and leg.state in SOURCE_LIVE:
                assert len(leg.dst_block_ids) == self.layout.num_blocks_for(leg.num_tokens)
        holders: dict[int, int] = {}
        for leg in self._legs.values():
            for block_id in leg.held_block_ids:
                holders[block_id] = holders.get(block_id, 0) + 1
        for block_id, num_holders in holders.items():
            assert self.pool.ref_count(block_id) >= num_holders, f"block {block_id} has fewer refs than holders"
