"""Which store node holds which block, as a reader of the store's events knows it (a router; several may each keep one).

Fed only by the nodes' `StoreEvent` streams (`kvbaton.cache.kv_store`), in seq order per node, as the
router's prefix index is fed by the workers' KV events: a gap returns False and the reader resyncs from
that node's `snapshot`; events at or below the last applied seq are duplicates and are skipped; CLEARED
(the node was lost) forgets everything it held. Nothing here is shared between readers, so any number
of routers keep their own directory from the same streams. It may lag the store: a load planned from it
can find a block gone, and then recomputes it.

A private directory (`private=True`) describes a store whose nodes serve only their own workers (islands:
one store per node): a reader's `sources` are its own node's copies, never another node's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvbaton.cache.kv_store import TIERS, NodeId, StoreEvent, choose_source


class StoreDirectory:
    def __init__(self, private: bool = False) -> None:
        self.private = private  # a reader loads from its own node only
        self._where: dict[int, dict[NodeId, str]] = {}  # hash -> node -> tier
        self._held: dict[NodeId, set[int]] = {}
        self._last_seq: dict[NodeId, int] = {}

    # ---- reads ---------------------------------------------------------------------------------
    def locations(self, block_hash: int) -> dict[NodeId, str]:
        return self._where.get(block_hash, {})

    def match(self, block_hashes: Sequence[int], start: int = 0) -> int:
        """How many of `block_hashes[start:]`, leading, some node holds."""
        where = self._where
        num = 0
        for block_hash in block_hashes[start:]:
            if block_hash not in where:
                break
            num += 1
        return num

    def sources(self, block_hashes: Sequence[int], reader: NodeId) -> list[tuple[NodeId, str]]:
        """Where a reader on node `reader` would load each leading held block from (`choose_source`); private:
        the leading blocks its own node holds."""
        out = []
        private = self.private
        for block_hash in block_hashes:
            holders = self._where.get(block_hash)
            if not holders or (private and reader not in holders):
                break
            out.append(choose_source(holders, reader))
        return out

    def num_blocks(self, node_id: NodeId) -> int:
        return len(self._held.get(node_id, ()))

    def last_seq(self, node_id: NodeId) -> int:
        return self._last_seq.get(node_id, 0)

    # ---- feed ----------------------------------------------------------------------------------
    def on_events(self, node_id: NodeId, events: Iterable[StoreEvent]) -> bool:
        """Apply the node's events in order; False at the first gap (the rest is not applied): take a snapshot."""
        for event in events:
            last = self._last_seq.get(node_id, 0)
            if event.seq <= last:
                continue
            if event.seq != last + 1:
                return False
            self._apply(node_id, event)
            self._last_seq[node_id] = event.seq
        return True

    def apply_snapshot(self, node_id: NodeId, events: Iterable[StoreEvent]) -> None:
        """Replace what is known of the node with its snapshot (STORED events, all at its latest seq)."""
        self._forget(node_id)
        last = self._last_seq.get(node_id, 0)
        for event in events:
            self._apply(node_id, event)
            last = max(last, event.seq)
        self._last_seq[node_id] = last

    def remove_node(self, node_id: NodeId) -> None:
        self._forget(node_id)
        self._last_seq.pop(node_id, None)

    def _apply(self, node_id: NodeId, event: StoreEvent) -> None:
        if event.kind == "cleared":
            self._forget(node_id)
            return
        held = self._held.setdefault(node_id, set())
        for block_hash in event.block_hashes:
            if event.kind == "stored":
                self._where.setdefault(block_hash, {})[node_id] = event.tier
                held.add(block_hash)
            else:
                holders = self._where.get(block_hash)
                if holders is not None and holders.pop(node_id, None) is not None and not holders:
                    del self._where[block_hash]
                held.discard(block_hash)

    def _forget(self, node_id: NodeId) -> None:
        for block_hash in self._held.pop(node_id, ()):
            holders = self._where[block_hash]
            del holders[node_id]
            if not holders:
                del self._where[block_hash]

    def check_invariants(self) -> None:
        """The hash map and the per-node sets describe the same copies, each in a known tier."""
        pairs = {(h, n) for h, holders in self._where.items() for n in holders}
        assert pairs == {(h, n) for n, held in self._held.items() for h in held}, "directory maps disagree"
        assert all(holders and set(holders.values()) <= set(TIERS) for holders in self._where.values())
