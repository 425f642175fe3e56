"""Factories shared by the transfer tests: a small layout, pools and a pair of protocol legs."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvbaton.cache.block_pool import BlockPool
from kvbaton.transfer import Abort, FirstToken, HandoffDestination, HandoffSource, KVLayout, Outgoing

LAYOUT = KVLayout("rev-1", "float32", block_size=4, num_layers=2, num_kv_heads=2, head_dim=3)
OTHER_LAYOUT = replace(LAYOUT, model_revision="rev-2")
FIRST = FirstToken(token_id=42, logprob=-0.5, top_logprobs=((42, -0.5), (7, -1.5)), num_cached_tokens=32)
LEASE_S = 5.0


@dataclass
class Legs:
    source: HandoffSource
    destination: HandoffDestination
    src_pool: BlockPool
    dst_pool: BlockPool

    def to_destination(self, outgoing: list[Outgoing] | Outgoing, now: float, peer: str = "p0") -> list[Outgoing]:
        """Deliver source messages to the destination; returns its replies."""
        items = outgoing if isinstance(outgoing, list) else [outgoing]
        replies: list[Outgoing] = []
        for item in items:
            assert item.peer == "d0"
            replies += self.destination.on_message(peer, item.message, now)
        return replies

    def to_source(self, outgoing: list[Outgoing], now: float) -> list[Outgoing]:
        """Deliver destination messages to the source; returns its replies: only a live leg answers an Abort
        (with its own, sent after its last write into the destination's blocks), nothing else is answered."""
        replies: list[Outgoing] = []
        for item in outgoing:
            assert item.peer == "p0"
            answer = self.source.on_message(item.message, now)
            assert all(isinstance(item.message, Abort) and isinstance(r.message, Abort) and r.peer == "d0"
                       and r.message.transfer_id == item.message.transfer_id for r in answer), answer
            replies += answer
        return replies

    def abort_round_trip(self, aborts: list[Outgoing], now: float) -> None:
        """The destination's own aborts reach the source and the source's answers come back (lifting the
        destination's fences); the destination answers those with nothing: no ping-pong."""
        assert self.to_destination(self.to_source(aborts, now), now) == []

    def check(self) -> None:
        self.source.check_invariants()
        self.destination.check_invariants()
        self.src_pool.check_invariants()
        self.dst_pool.check_invariants()


def make_legs(num_src_blocks: int = 16, num_dst_blocks: int = 8, layout: KVLayout = LAYOUT) -> Legs:
    src_pool, dst_pool = BlockPool(num_src_blocks), BlockPool(num_dst_blocks)
    return Legs(HandoffSource(LAYOUT, src_pool, LEASE_S), HandoffDestination(layout, dst_pool, LEASE_S),
                src_pool, dst_pool)
