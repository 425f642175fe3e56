"""Bookkeeping both handoff legs share: the table of transfers, leases, endings and tombstones.

`HandoffSource` and `HandoffDestination` differ in their states and messages, not in how a leg
ends: an ending (ack, adoption, cancel, failure, lease expiry, a lost peer) moves the leg to a
terminal state, releases the blocks it holds exactly once, and keeps it as a tombstone for
`tombstone_s` so that late messages for it stay ignored.

The table keeps the ids of its live legs and a heap of its tombstones by end time next to the legs,
so that `expire` costs what is live plus what it forgets, not every tombstone of the last `tombstone_s`.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from enum import Enum
from typing import ClassVar, Generic, Protocol, TypeVar

from kvbaton.cache.block_pool import BlockPool
from kvbaton.transfer.layout import KVLayout
from kvbaton.transfer.messages import Abort, AbortCause, Outgoing, TransferId
from kvbaton.transfer.states import ProtocolError


class Leg(Protocol):
    transfer_id: TransferId
    peer: str
    state: Enum
    lease_expires_at: float
    ended_at: float
    reason: str


LegT = TypeVar("LegT", bound=Leg)


class LegTable(ABC, Generic[LegT]):
    """The transfers of one worker on one side; subclasses name their states and release their blocks."""

    live_states: ClassVar[frozenset]  # states in which a leg holds blocks and may still change
    transitions: ClassVar[dict]  # state -> the states it may move to
    end_states: ClassVar[dict[AbortCause, Enum]]  # how an abort of each cause ends a live leg
    peer_lost_states: ClassVar[frozenset]  # states in which losing the peer fails the leg

    def __init__(self, layout: KVLayout, pool: BlockPool, lease_s: float, tombstone_s: float = 600.0) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        self.layout = layout
        self.pool = pool
        self.lease_s = lease_s
        self.tombstone_s = tombstone_s  # ended legs are remembered this long so late messages stay ignored
        self._legs: dict[TransferId, LegT] = {}
        self._live: dict[TransferId, None] = {}  # ids of the legs in live_states, as an ordered set
        self._tombstones: list[tuple[float, TransferId]] = []  # heap of (ended_at, id), one per ending
        self.num_ignored_messages = 0

    def state(self, transfer_id: TransferId) -> Enum:
        return self._leg(transfer_id).state

    def state_or_none(self, transfer_id: TransferId) -> Enum | None:
        """The leg's state; None when there is no such leg (never started, or ended and forgotten)."""
        leg = self._legs.get(transfer_id)
        return leg.state if leg is not None else None

    def reason(self, transfer_id: TransferId) -> str:
        return self._leg(transfer_id).reason

    @property
    def num_live_transfers(self) -> int:
        return len(self._live)

    def cancel(self, transfer_id: TransferId, now: float, reason: str = "cancelled") -> list[Outgoing]:
        """End the leg in any live state (releasing its blocks) and tell the peer; a no-op on an ended one."""
        return self._abort(transfer_id, AbortCause.CANCELLED, reason, now)

    def fail(self, transfer_id: TransferId, now: float, reason: str) -> list[Outgoing]:
        """This side failed (compute, transport): end the leg and the peer's."""
        return self._abort(transfer_id, AbortCause.FAILED, reason, now)

    def on_peer_lost(self, peer: str, now: float) -> list[TransferId]:
        """The link to `peer` is gone: its legs in `peer_lost_states` fail (nothing can reach it any more)."""
        lost = sorted(leg.transfer_id for leg in self._legs.values()
                      if leg.peer == peer and leg.state in self.peer_lost_states)
        failed = self.end_states[AbortCause.FAILED]
        for transfer_id in lost:
            self._end(self._legs[transfer_id], failed, f"lost the link to {peer}", now)
        return lost

    def expire(self, now: float) -> list[Outgoing]:
        """End every live leg whose lease ran out (telling its peer), and forget old ended legs."""
        # Forgetting has no effect but on the table, so it is done first: exactly the legs ended before
        # this call and past their tombstone time go (a leg this call ends is kept, even with tombstone_s 0).
        tombstones = self._tombstones
        while tombstones and now >= tombstones[0][0] + self.tombstone_s:
            ended_at, transfer_id = heapq.heappop(tombstones)
            leg = self._legs.get(transfer_id)
            if leg is not None and leg.state not in self.live_states and leg.ended_at == ended_at:
                del self._legs[transfer_id]
        # Leases end in id order: the aborts, and the pool releases they make, keep a sorted pass's order.
        outgoing: list[Outgoing] = []
        legs = self._legs
        for transfer_id in sorted(tid for tid in self._live if now >= legs[tid].lease_expires_at):
            leg = legs[transfer_id]
            outgoing += self._abort(transfer_id, AbortCause.EXPIRED, f"lease expired in {leg.state.value}", now)
        return outgoing

    def _add(self, leg: LegT) -> None:
        """A new leg: live, or already ended (then a tombstone from its `ended_at`)."""
        self._legs[leg.transfer_id] = leg
        if leg.state in self.live_states:
            self._live[leg.transfer_id] = None
        else:
            heapq.heappush(self._tombstones, (leg.ended_at, leg.transfer_id))

    def _mark_ended(self, leg: LegT, now: float) -> None:
        """The leg just moved out of live_states: it is a tombstone from `now`."""
        leg.ended_at = now
        del self._live[leg.transfer_id]
        heapq.heappush(self._tombstones, (now, leg.transfer_id))

    def _check_live_ids(self) -> None:
        live = {tid for tid, leg in self._legs.items() if leg.state in self.live_states}
        assert set(self._live) == live, f"live ids {sorted(self._live)} differ from live legs {sorted(live)}"

    def _leg(self, transfer_id: TransferId) -> LegT:
        leg = self._legs.get(transfer_id)
        if leg is None:
            raise ProtocolError(f"unknown transfer {transfer_id}")
        return leg

    def _abort(self, transfer_id: TransferId, cause: AbortCause, reason: str, now: float) -> list[Outgoing]:
        leg = self._legs.get(transfer_id)
        if leg is None or leg.state not in self.live_states:
            return []
        self._end(leg, self.end_states[cause], reason, now)
        return [Outgoing(leg.peer, Abort(transfer_id, cause, reason))]

    def _end(self, leg: LegT, state: Enum, reason: str, now: float) -> None:
        self._move(leg, state)
        self._release_blocks(leg)
        self._mark_ended(leg, now)
        leg.reason = reason

    def _move(self, leg: LegT, state: Enum) -> None:
        assert state in self.transitions.get(leg.state, ()), f"{leg.transfer_id}: {leg.state} -> {state}"
        leg.state = state

    @abstractmethod
    def _release_blocks(self, leg: LegT) -> None:
        """Drop the pool references the leg holds; called exactly once, when it ends."""
