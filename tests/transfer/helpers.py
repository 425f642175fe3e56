"""Factories shared by the transfer tests: a small layout, pools and a pair of protocol legs."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvbaton.cache.block_pool import BlockPool
from kvbaton.transfer import FirstToken, HandoffDestination, HandoffSource, KVLayout, Outgoing

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

    def to_source(self, outgoing: list[Outgoing], now: float) -> None:
        for item in outgoing:
            assert item.peer == "p0"
            assert self.source.on_message(item.message, now) == []

    def check(self) -> None:
        self.source.check_invariants()
        self.destination.check_invariants()
        self.src_pool.check_invariants()
        self.dst_pool.check_invariants()


def make_legs(num_src_blocks: int = 16, num_dst_blocks: int = 8, layout: KVLayout = LAYOUT) -> Legs:
    src_pool, dst_pool = BlockPool(num_src_blocks), BlockPool(num_dst_blocks)
    return Legs(HandoffSource(LAYOUT, src_pool, LEASE_S), HandoffDestination(layout, dst_pool, LEASE_S),
                src_pool, dst_pool)
