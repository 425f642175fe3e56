"""Regressions: every simulated request must end with exactly one record (none may vanish from `ClusterSim.run`)."""

from __future__ import annotations

import numpy as np

from kvbaton.bench.tokens import as_token_array
from kvbaton.bench.workloads.base import WorkloadRequest
from kvbaton.core.config import CacheConfig
from kvbaton.sim.cluster import ClusterSim
from kvbaton.sim.config import SimConfig
from kvbaton.sim.costs import ConstantCostModel
from kvbaton.sim.spec import parse_cluster_spec


def _request(rng: np.random.Generator, index: int, arrival_s: float, prompt: int, out: int) -> WorkloadRequest:
    return WorkloadRequest(index, arrival_s, (as_token_array(rng.integers(20, 1000, size=prompt)),), out)


def _run(requests: list[WorkloadRequest], **config: object) -> tuple[ClusterSim, list]:
    sim = ClusterSim(parse_cluster_spec("1P1D"), ConstantCostModel(0.01),
                     SimConfig(cache=CacheConfig(16, 16), **config))  # type: ignore[arg-type]
    return sim, sim.run(requests)


def test_late_reservation_queue_moves_on_when_its_head_handoff_fails() -> None:
    # Bug: with reserve_ahead_tokens, ClusterSim._reserve_in_turn runs only on an arrival, a grant or the prefill
    # worker's step end. When the FIFO's head is refused max_handoff_attempts times and fails (_on_handoff_events
    # -> _fail), nothing asks again: the handoffs queued behind it on an idle prefill worker never reserve, and
    # their requests get no record at all (kvbaton sim prints e.g. "96/97 done" for 150 requests).
    rng = np.random.default_rng(0)
    # req-0 holds 14 of d0's 16 blocks while it decodes for 0.6 s; req-1 needs 7 and is refused until it gives up
    # (10 attempts x 0.02 s); req-2 waits behind req-1 in p0's FIFO.
    requests = [_request(rng, 0, 0.0, 160, 60), _request(rng, 1, 0.05, 100, 20), _request(rng, 2, 0.06, 16, 4)]
    sim, records = _run(requests, reserve_ahead_tokens=0, max_handoff_attempts=10)
    assert [r.request_id for r in records] == ["req-0", "req-1", "req-2"]
    assert records[1].status == "failed" and records[2].status == "completed"
    for worker in sim.workers.values():
        assert not worker.has_work()
        assert worker.pool.num_used_blocks == (worker.cache.num_cached_blocks if worker.cache else 0)


def test_a_request_with_no_output_tokens_is_refused_or_recorded_never_dropped() -> None:
    # Bug: a WorkloadRequest with output_tokens=0 (e.g. sharegpt-like --param max_output_tokens=0, which
    # lognormal_lengths clips to 0) goes to the prefill worker with max_tokens=1 and, on finishing there,
    # _on_request_finished takes it for a handed-off request (output_tokens != 1): no record, "0/0 done".
    rng = np.random.default_rng(1)
    requests = [_request(rng, 0, 0.0, 64, 0), _request(rng, 1, 0.01, 64, 4)]
    try:
        _, records = _run(requests)
    except Exception as exc:  # a clear refusal is fine
        from kvbaton.core.errors import KvbatonError

        assert isinstance(exc, KvbatonError), repr(exc)
        return
    assert [r.request_id for r in records] == ["req-0", "req-1"]
