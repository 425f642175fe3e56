"""What the cluster manager reports about itself: readiness, the /cluster description and the totals /metrics renders.

`ClusterReports` is a base class of `ClusterManager` (kvbaton.server.cluster): read-only views over
its live workers, its in-flight calls and its counters, computed when asked (the HTTP layer asks
per scrape or request, never per token).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvbaton.router.placement import ClusterPlacement
from kvbaton.router.pools import PoolBalancer
from kvbaton.router.state import RouterState
from kvbaton.server import rpc
from kvbaton.server.cluster_registry import CallRecord, WorkerRecord, transfer_info, worker_info
from kvbaton.server.identity import ClusterIdentity

if TYPE_CHECKING:  # for annotations only: cluster.py imports this module
    from kvbaton.server.cluster import ClusterConfig


class ClusterReports:
    """Reads for /ready, /cluster and /metrics; `ClusterManager` sets every attribute below in its `__init__`."""

    config: ClusterConfig
    clock: Callable[[], float]
    state: RouterState
    queue_policy: str
    identity: ClusterIdentity | None
    workers: dict[str, WorkerRecord]
    lost_workers: dict[str, str]
    _calls: dict[str, CallRecord]
    placement: ClusterPlacement
    router_decisions: dict[str, int]
    num_rejected: int
    num_failed_by_worker_loss: int
    num_handoff_fallbacks: int
    handoff_endings: dict[str, int]
    pools: PoolBalancer | None
    retired_spec_decode_tokens: list[int]
    address: str

    # -- readiness and /cluster -----------------------------------------------------------------

    @property
    def num_serving_workers(self) -> int:
        """Registered workers whose engine loop runs (they have sent a heartbeat)."""
        return sum(1 for record in self.workers.values() if record.stats is not None)

    def is_ready(self) -> tuple[bool, str]:
        serving = sorted(w for w, record in self.workers.items() if record.stats is not None)
        if serving:
            return True, f"{len(serving)} worker(s) serving: {', '.join(serving)}"
        if self.workers:
            return False, f"{len(self.workers)} worker(s) registered, none has started its engine loop yet"
        if self.lost_workers:
            lost = "; ".join(f"{w}: {why}" for w, why in sorted(self.lost_workers.items()))
            return False, f"no live worker (lost: {lost})"
        return False, "no worker registered yet"

    def cluster_info(self) -> dict[str, object]:
        now = self.clock()
        return {
            "policy": self.config.policy,
            "worker_queue_policy": self.queue_policy,
            "model": self.config.model_name,
            "identity": None if self.identity is None else {
                "model_revision": self.identity.model_revision, "kv_layout": self.identity.kv_layout,
                "block_size": self.identity.block_size},
            "router_address": self.address,
            "workers": [worker_info(self.workers[w], self.state, now) for w in sorted(self.workers)],
            "lost_workers": dict(sorted(self.lost_workers.items())),
            "num_in_flight": len(self._calls),
            "num_waiting": self.num_waiting,
            "index_blocks": self.state.index.num_blocks,
            "lent_workers": {} if self.pools is None else dict(sorted(self.pools.lent.items())),
            "pool_switches": 0 if self.pools is None else len(self.pools.switches),
            "router_decisions": dict(sorted(self.router_decisions.items())),
            "num_rejected": self.num_rejected,
            "num_failed_by_worker_loss": self.num_failed_by_worker_loss,
            "transfers": self.transfer_totals(),
            "spec_decode": self.spec_decode_totals(),
        }

    def transfer_totals(self) -> dict[str, float]:
        """KV handoff counters summed over live workers (prefill side: bytes, time, queue; decode side:
        adoptions, recomputes), plus the router's fallbacks and reservation refusals."""
        totals: dict[str, float] = {}
        for stats in self.live_worker_stats().values():
            for name, value in transfer_info(stats).items():
                totals[name] = totals.get(name, 0) + value
        totals["num_fallbacks"] = self.num_handoff_fallbacks
        totals["num_refusals_reported"] = self.handoff_endings.get("refused", 0)
        return totals

    # -- reads for /metrics ---------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        """Routed calls that have not produced a token yet (queued somewhere in the cluster)."""
        return self.placement.num_waiting

    @property
    def num_in_flight(self) -> int:
        return len(self._calls)

    def live_worker_stats(self) -> dict[str, rpc.Stats]:
        return {w: r.stats for w, r in sorted(self.workers.items()) if r.stats is not None}

    def spec_decode_totals(self) -> dict[str, int]:
        """Speculative decoding's draft tokens proposed and accepted over all workers ever registered; never
        decreases."""
        num_draft_tokens, num_accepted_tokens = self.retired_spec_decode_tokens
        for stats in self.live_worker_stats().values():
            num_draft_tokens += stats.num_draft_tokens
            num_accepted_tokens += stats.num_accepted_tokens
        return {"num_draft_tokens": num_draft_tokens, "num_accepted_tokens": num_accepted_tokens}
