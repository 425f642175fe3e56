"""The decode side of handoffs: reserve blocks or refuse, record per-layer completion, ack, hand the KV over.

One `HandoffDestination` per decode worker. Time (`now`, seconds) is passed in. A reservation
allocates the request's blocks from the worker's `BlockPool` up front (evicting what the worker's
prefix cache holds unused, through `make_room`, when free blocks are short) — a prefill never computes
KV that has nowhere to land — and holds their single reference until the leg ends: `adopt` passes
the reference to the decode engine, every other ending releases it. A layer is readable only when
every position of the prompt has arrived for it; chunks that duplicate an earlier one are ignored,
chunks that contradict the reservation fail the transfer.

Fencing: when this side ends a leg (cancel, failure, lease expiry) while its source may still be
streaming, the source keeps writing into the reserved blocks until our Abort reaches it: through its
own mapping (shm, in-process) or through our receiver (tcp). So those blocks go back to the pool only
once the source is known to have stopped: its Abort (it answers ours with one) or its SourceDone
arrives, or `lease_s` passes; when its link dies, at once (or after `peer_lost_fence_s`, the time a
peer writing through its own mapping may take to notice). Until then they stay out of the pool,
where no other request can be given them and then read another's stale KV.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvbaton.cache.block_pool import BlockPool
from kvbaton.transfer.layout import KVLayout
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
from kvbaton.transfer.states import (
    DESTINATION_LIVE,
    DESTINATION_TRANSITIONS,
    DestinationState,
    Outcome,
    ProtocolError,
    destination_outcome,
)

_END_STATE = {AbortCause.CANCELLED: DestinationState.CANCELLED, AbortCause.FAILED: DestinationState.FAILED,
              AbortCause.EXPIRED: DestinationState.EXPIRED}


@dataclass(frozen=True, slots=True)
class AdoptedKV:
    """What the decode engine gets: the blocks (with their references) and where decoding starts."""

    transfer_id: TransferId
    block_ids: tuple[int, ...]
    num_tokens: int
    first_token: FirstToken


@dataclass(slots=True)
class _DestinationLeg:
    transfer_id: TransferId
    peer: str
    num_tokens: int
    block_ids: tuple[int, ...]
    state: DestinationState
    lease_expires_at: float
    chunks: list[dict[int, int]]  # per layer: first_position -> num_valid_tokens of each chunk received
    tokens_received: list[int]  # per layer
    first_token: FirstToken | None = None
    ended_at: float = 0.0
    reason: str = ""
    was_completed: bool = False
    num_complete_layers: int = 0
    fenced_until: float | None = None  # ended by us while the source may still write: blocks held until then


class HandoffDestination(LegTable[_DestinationLeg]):
    """All incoming handoffs of one decode worker."""

    live_states = DESTINATION_LIVE
    transitions = DESTINATION_TRANSITIONS
    end_states = _END_STATE
    # A COMPLETE leg keeps its KV when the source goes away: everything has arrived already.
    peer_lost_states = frozenset({DestinationState.RESERVED, DestinationState.RECEIVING})

    def __init__(self, layout: KVLayout, pool: BlockPool, lease_s: float, tombstone_s: float = 600.0,
                 make_room: Callable[[int], object] | None = None, peer_lost_fence_s: float = 0.0) -> None:
        super().__init__(layout, pool, lease_s, tombstone_s)
        self._fenced: dict[TransferId, None] = {}  # ids of the ended legs whose blocks are fenced
        self.num_grants = 0
        self.num_refusals = 0
        self.peer_lost_fence_s = peer_lost_fence_s  # KVTransport.peer_lost_write_grace_s of our end
        # Frees n blocks the worker's prefix cache holds unused, if it holds that many (RadixCache.make_room), so
        # that a reservation is refused only when even the evictable cache cannot make room; None: reserve from
        # free blocks alone.
        self.make_room = make_room

    # -- queries ---------------------------------------------------------------------------------

    def outcome(self, transfer_id: TransferId) -> Outcome | None:
        return destination_outcome(self._leg(transfer_id).state)

    def was_completed(self, transfer_id: TransferId) -> bool:
        return self._leg(transfer_id).was_completed

    def is_layer_complete(self, transfer_id: TransferId, layer_index: int) -> bool:
        """True only when every prompt position of `layer_index` has arrived: before that, do not read it."""
        leg = self._leg(transfer_id)
        return leg.state in DESTINATION_LIVE and leg.tokens_received[layer_index] == leg.num_tokens

    def num_complete_layers(self, transfer_id: TransferId) -> int:
        return self._leg(transfer_id).num_complete_layers

    def num_tokens_received(self, transfer_id: TransferId, layer_index: int) -> int:
        return self._leg(transfer_id).tokens_received[layer_index]

    def has_first_token(self, transfer_id: TransferId) -> bool:
        """SourceDone arrived: the prefill sent every chunk and the token decoding starts from."""
        return self._leg(transfer_id).first_token is not None

    def knows(self, transfer_id: TransferId) -> bool:
        return transfer_id in self._legs

    def complete_transfer_ids(self) -> list[TransferId]:
        """Transfers whose KV is complete and waiting for `adopt`, in id order."""
        return sorted(tid for tid in self._live if self._legs[tid].state is DestinationState.COMPLETE)

    @property
    def num_reserved_blocks(self) -> int:
        """Blocks held outside the engine: reserved by live legs, or fenced after a leg we ended."""
        return sum(len(self._legs[tid].block_ids) for tid in self._live) + self.num_fenced_blocks

    @property
    def num_fenced_blocks(self) -> int:
        return sum(len(self._legs[tid].block_ids) for tid in self._fenced)

    # -- caller-driven steps ---------------------------------------------------------------------

    def adopt(self, transfer_id: TransferId, now: float) -> AdoptedKV:
        """Hand a COMPLETE transfer's blocks to the decode engine; their references become the engine's."""
        leg = self._leg(transfer_id)
        if leg.state is not DestinationState.COMPLETE:
            raise ProtocolError(f"transfer {transfer_id} is {leg.state.value}, not complete")
        assert leg.first_token is not None
        self._move(leg, DestinationState.ADOPTED)
        self._mark_ended(leg, now)
        return AdoptedKV(transfer_id, leg.block_ids, leg.num_tokens, leg.first_token)

    # -- messages from the source ----------------------------------------------------------------

    def on_message(self, peer: str, message: Message, now: float) -> list[Outgoing]:
        """Apply a message from prefill worker `peer`; returns the replies to send back to it."""
        if isinstance(message, ReserveRequest):
            return self._on_reserve(peer, message, now)
        leg = self._legs.get(message.transfer_id)
        if leg is None and isinstance(message, Abort):
            # The abort overtook its own reservation (links may reorder): remember the transfer as ended, so the
            # reservation, when it comes, is stale and reserves nothing (else its blocks sat idle a whole lease).
            self._add(_DestinationLeg(
                message.transfer_id, peer, 0, (), _END_STATE[message.cause], now, [], [], ended_at=now,
                reason=f"peer: {message.reason} (before its reservation)"))
            return []
        if leg is not None and leg.fenced_until is not None and leg.peer == peer and isinstance(
                message, (Abort, SourceDone)):
            self._lift_fence(leg)  # the source sent this after its last write: the blocks are ours again
            return []
        if leg is None or leg.state not in DESTINATION_LIVE or leg.peer != peer:
            self.num_ignored_messages += 1
            return []
        if isinstance(message, LayerChunk):
            return self._on_chunk(leg, message, now)
        if isinstance(message, SourceDone):
            if leg.first_token is None and message.num_tokens == leg.num_tokens:
                leg.first_token = message.first_token
                leg.lease_expires_at = now + self.lease_s
                return self._complete_if_ready(leg, now)
            if message.num_tokens != leg.num_tokens:
                return self._abort(leg.transfer_id, AbortCause.FAILED, "SourceDone token count differs", now)
        elif isinstance(message, Abort):
            self._end(leg, _END_STATE[message.cause], f"peer: {message.reason}", now)
            return []
        self.num_ignored_messages += 1
        return []

    def _on_reserve(self, peer: str, message: ReserveRequest, now: float) -> list[Outgoing]:
        transfer_id = message.transfer_id
        leg = self._legs.get(transfer_id)
        if leg is not None:
            # A duplicate of a live reservation re-sends the same grant; one for an ended leg is stale.
            if leg.state in (DestinationState.RESERVED, DestinationState.RECEIVING) and leg.peer == peer:
                return [Outgoing(peer, ReserveGranted(transfer_id, leg.block_ids))]
            self.num_ignored_messages += 1
            return []
        mismatch = self.layout.mismatch(message.layout)
        num_blocks = self.layout.num_blocks_for(message.num_tokens)
        shortfall = num_blocks - self.pool.num_free_blocks
        if not mismatch and message.num_tokens > 0 and shortfall > 0 and self.make_room is not None:
            self.make_room(shortfall)
        if mismatch or message.num_tokens <= 0 or not self.pool.can_allocate(num_blocks):
            self.num_refusals += 1
            reason = mismatch or (f"need {num_blocks} KV blocks, {self.pool.num_free_blocks} free"
                                  if message.num_tokens > 0 else "empty transfer")
            return [Outgoing(peer, ReserveRefused(transfer_id, reason))]
        block_ids = tuple(self.pool.allocate(num_blocks))
        self.num_grants += 1
        num_layers = self.layout.num_layers
        self._add(_DestinationLeg(
            transfer_id, peer, message.num_tokens, block_ids, DestinationState.RESERVED, now + self.lease_s,
            [{} for _ in range(num_layers)], [0] * num_layers))
        return [Outgoing(peer, ReserveGranted(transfer_id, block_ids))]

    def _on_chunk(self, leg: _DestinationLeg, chunk: LayerChunk, now: float) -> list[Outgoing]:
        problem = self._chunk_problem(leg, chunk)
        if problem:
            return self._abort(leg.transfer_id, AbortCause.FAILED, problem, now)
        seen = leg.chunks[chunk.layer_index]
        if seen.get(chunk.first_position) == chunk.num_valid_tokens:
            self.num_ignored_messages += 1  # an exact duplicate: already counted
            return []
        overlaps = any(first < chunk.end_position and chunk.first_position < first + num
                       for first, num in seen.items())
        if overlaps or leg.state is DestinationState.COMPLETE:
            return self._abort(leg.transfer_id, AbortCause.FAILED, f"chunk {chunk.first_position}+"
                               f"{chunk.num_valid_tokens} of layer {chunk.layer_index} overlaps another", now)
        seen[chunk.first_position] = chunk.num_valid_tokens
        leg.tokens_received[chunk.layer_index] += chunk.num_valid_tokens
        if leg.tokens_received[chunk.layer_index] == leg.num_tokens:
            leg.num_complete_layers += 1
        leg.lease_expires_at = now + self.lease_s
        if leg.state is DestinationState.RESERVED:
            self._move(leg, DestinationState.RECEIVING)
        return self._complete_if_ready(leg, now)

    def _chunk_problem(self, leg: _DestinationLeg, chunk: LayerChunk) -> str:
        mismatch = self.layout.mismatch(chunk.layout)
        if mismatch:
            return mismatch
        if not 0 <= chunk.layer_index < self.layout.num_layers:
            return f"layer {chunk.layer_index} out of range"
        if chunk.num_valid_tokens <= 0 or chunk.first_position < 0 or chunk.end_position > leg.num_tokens:
            return f"positions [{chunk.first_position}, {chunk.end_position}) outside [0, {leg.num_tokens})"
        blocks = self.layout.block_range(chunk.first_position, chunk.num_valid_tokens)
        if chunk.dst_block_ids != leg.block_ids[blocks.start:blocks.stop]:
            return f"destination handles {chunk.dst_block_ids} are not the reserved ones"
        if len(chunk.src_block_ids) != len(blocks):
            return f"{len(chunk.src_block_ids)} source handles for {len(blocks)} blocks"
        return ""

    def _complete_if_ready(self, leg: _DestinationLeg, now: float) -> list[Outgoing]:
        if leg.first_token is None or leg.num_complete_layers < self.layout.num_layers:
            return []
        self._move(leg, DestinationState.COMPLETE)
        leg.was_completed = True
        leg.lease_expires_at = now + self.lease_s  # the engine must adopt within a lease, or the blocks go back
        return [Outgoing(leg.peer, Ack(leg.transfer_id))]

    # -- endings and fences ----------------------------------------------------------------------

    def _abort(self, transfer_id: TransferId, cause: AbortCause, reason: str, now: float) -> list[Outgoing]:
        """This side ends the leg: fenced when its source may still be writing (before its SourceDone)."""
        leg = self._legs.get(transfer_id)
        if leg is not None and leg.state in self.peer_lost_states and leg.first_token is None:
            self._fence(leg, now + self.lease_s)  # set first: `_end` then keeps the blocks
        return super()._abort(transfer_id, cause, reason, now)

    def on_peer_lost(self, peer: str, now: float) -> list[TransferId]:
        """The link to `peer` is gone: its live legs fail, and fences on its legs lift (after the grace a peer
        writing through its own mapping has, if any)."""
        grace_until = now + self.peer_lost_fence_s
        for transfer_id in sorted(self._legs):
            leg = self._legs[transfer_id]
            if leg.peer != peer:
                continue
            if leg.state in self.peer_lost_states and leg.first_token is None and self.peer_lost_fence_s > 0:
                self._fence(leg, grace_until)
            elif leg.fenced_until is not None:
                if self.peer_lost_fence_s > 0:
                    leg.fenced_until = min(leg.fenced_until, grace_until)
                else:
                    self._lift_fence(leg)
        return super().on_peer_lost(peer, now)

    def expire(self, now: float) -> list[Outgoing]:
        """Lift the fences whose time is up (before a leg could be forgotten with them), then as `LegTable`."""
        tombstone_s = self.tombstone_s
        due = [transfer_id for transfer_id in self._fenced if now >= self._legs[transfer_id].fenced_until
               or now >= self._legs[transfer_id].ended_at + tombstone_s]
        for transfer_id in sorted(due):  # in id order, as the pool releases of `LegTable.expire`
            self._lift_fence(self._legs[transfer_id])
        return super().expire(now)

    def _fence(self, leg: _DestinationLeg, until: float) -> None:
        leg.fenced_until = until
        self._fenced[leg.transfer_id] = None

    def _lift_fence(self, leg: _DestinationLeg) -> None:
        leg.fenced_until = None
        del self._fenced[leg.transfer_id]
        self.pool.release(leg.block_ids)

    def _release_blocks(self, leg: _DestinationLeg) -> None:
        if leg.fenced_until is None:
            self.pool.release(leg.block_ids)

    def check_invariants(self) -> None:
        """Raise AssertionError if reservations overlap, disagree with the pool, or counts drift."""
        self._check_live_ids()
        fenced = {tid for tid, leg in self._legs.items() if leg.fenced_until is not None}
        assert set(self._fenced) == fenced, f"fenced ids {sorted(self._fenced)} differ from {sorted(fenced)}"
        owners: dict[int, TransferId] = {}
        for leg in self._legs.values():
            live = leg.state in DESTINATION_LIVE
            assert not (live and leg.fenced_until is not None), f"{leg.transfer_id} is fenced but live"
            if not live and leg.fenced_until is None:
                continue  # holds no block
            held = "reserved" if live else "fenced"
            for block_id in leg.block_ids:
                assert block_id not in owners, f"block {block_id} held by {owners[block_id]} and {leg.transfer_id}"
                owners[block_id] = leg.transfer_id
                assert self.pool.ref_count(block_id) >= 1, f"{held} block {block_id} is free in the pool"
            if not live:
                continue
            assert len(leg.block_ids) == self.layout.num_blocks_for(leg.num_tokens), f"{leg.transfer_id} block count"
            assert leg.tokens_received == [sum(chunks.values()) for chunks in leg.chunks]
            assert all(0 <= n <= leg.num_tokens for n in leg.tokens_received)
            assert leg.num_complete_layers == sum(n == leg.num_tokens for n in leg.tokens_received)
            if leg.state is DestinationState.COMPLETE:
                assert leg.num_complete_layers == self.layout.num_layers and leg.first_token is not None
