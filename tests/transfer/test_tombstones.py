"""Ended legs are forgotten exactly `tombstone_s` after they end, at a cost that does not grow with how many are kept."""

from __future__ import annotations

from kvbaton.cache.block_pool import BlockPool
from kvbaton.transfer import HandoffSource
from tests.transfer.helpers import LAYOUT, LEASE_S, make_legs


class _NoScan(dict):
    """A leg table that fails any pass over all its legs (lookups and deletions stay allowed)."""

    def __iter__(self):
        raise AssertionError("expire walked every leg")

    def items(self):
        raise AssertionError("expire walked every leg")

    def values(self):
        raise AssertionError("expire walked every leg")


def test_tombstones_go_at_their_own_end_time_whatever_order_they_ended_in() -> None:
    source = HandoffSource(LAYOUT, BlockPool(4), LEASE_S, tombstone_s=10.0)
    ends = {"a": 3.0, "b": 1.0, "c": 2.0, "d": 1.0}  # not in id order, not in start order
    for tid in ends:
        source.start(tid, "d0", 4, now=0.0)
    for tid, at in ends.items():
        source.cancel(tid, now=at)
    source.start("live", "d0", 4, now=0.0)
    source.expire(now=10.9)
    assert [tid for tid in ends if source.state_or_none(tid) is not None] == ["a", "b", "c", "d"]
    source.expire(now=11.0)  # b and d ended at 1.0
    assert [tid for tid in ends if source.state_or_none(tid) is not None] == ["a", "c"]
    source.expire(now=13.0)
    assert [tid for tid in ends if source.state_or_none(tid) is not None] == []
    assert source.state_or_none("live") is not None  # its lease ended it at 10.9: a tombstone until 20.9
    source.check_invariants()


def test_an_id_started_again_after_its_tombstone_went_keeps_its_new_leg() -> None:
    source = HandoffSource(LAYOUT, BlockPool(4), LEASE_S, tombstone_s=1.0)
    source.start("x", "d0", 4, now=0.0)
    source.cancel("x", now=0.0)
    source.expire(now=1.0)
    assert source.state_or_none("x") is None
    source.start("x", "d0", 4, now=2.0)
    source.cancel("x", now=2.5)
    source.expire(now=3.0)  # 0.5 s after its second ending: still a tombstone
    assert source.state_or_none("x") is not None
    source.check_invariants()


def test_a_leg_ended_by_this_expiry_is_kept_even_with_no_tombstone_time() -> None:
    source = HandoffSource(LAYOUT, BlockPool(4), LEASE_S, tombstone_s=0.0)
    source.start("x", "d0", 4, now=0.0)
    assert len(source.expire(now=LEASE_S)) == 1  # the lease ran out: aborted now, forgotten at the next expire
    assert source.state_or_none("x") is not None
    source.expire(now=LEASE_S)
    assert source.state_or_none("x") is None


def test_expire_does_not_walk_the_tombstones() -> None:
    legs = make_legs()
    for index in range(2000):
        tid = f"t{index}"
        legs.source.start(tid, "d0", 4, now=float(index))  # the reservation is never delivered:
        legs.to_destination(legs.source.cancel(tid, now=float(index)), now=float(index))  # an early abort
    assert legs.source.num_live_transfers == 0 and len(legs.source._legs) == 2000
    for table in (legs.source, legs.destination):
        table._legs = _NoScan(table._legs)
        assert table.expire(now=600.0 + 99.5) == []  # forgets t0..t99 and looks at nothing else
        table._legs = dict(table._legs)
    assert legs.source.state_or_none("t99") is None and legs.source.state_or_none("t100") is not None
    assert not legs.destination.knows("t99") and legs.destination.knows("t100")
    legs.check()
