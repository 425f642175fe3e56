"""Handoffs between workers of different tensor parallel degrees (DistServe's prefill TP != decode TP): TP2 prefill
-> TP1 decode and TP1 -> TP2 give the colocated output over shm and tcp; the handoff faults (a dropped layer
chunk, a cancellation mid-transfer) end as over an equal pair; a decode worker whose rank is killed ends its
requests with an error, is dropped by the router, and nothing hangs or leaks."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from kvbaton.model.registry import LoadedModel, load_model
from kvbaton.server.base import GenerateCall
from kvbaton.server.cluster import ClusterManager
from kvbaton.transfer.faults import FaultAction, FaultRule
from kvbaton.transfer.layout import KVLayout
from kvbaton.transfer.messages import LayerChunk, SourceDone
from kvbaton.transfer.states import SourceState
from tests.server.pd_helpers import colocated, collect, greedy, run_pd, tokens_of, wait_clean
from tests.server.test_pd_faults import PD, PROMPT, _source_state, tokens, until
from tests.server.test_worker_cluster import WorkerThread

pytestmark = pytest.mark.timeout(180)
TP2 = {"tensor_parallel_size": 2, "num_threads": 1}


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random")


def test_parallel_degrees_are_convertible_and_other_differences_refused() -> None:
    tp1 = KVLayout("rev", "float32", 16, 2, 2, 16)
    tp2 = KVLayout("rev", "float32", 16, 2, 2, 16, tensor_parallel_size=2)
    assert tp1.layout_id != tp2.layout_id and tp1.mismatch(tp2) == "" and tp2.mismatch(tp1) == ""
    assert list(tp2.kv_heads_of_rank(1)) == [1]
    assert "head_dim" in tp2.mismatch(KVLayout("rev", "float32", 16, 2, 2, 8, tensor_parallel_size=2))
    with pytest.raises(ValueError, match="must divide num_kv_heads"):
        KVLayout("rev", "float32", 16, 2, 2, 16, tensor_parallel_size=4)


@pytest.mark.parametrize(("prefill", "decode", "transport"), [
    ({"tensor_parallel_size": 2}, {}, "shm"),
    ({}, {"tensor_parallel_size": 2}, "tcp"),
    ({"pipeline_parallel_size": 2}, {"tensor_parallel_size": 2}, "shm"),
], ids=["tp2-to-tp1-shm", "tp1-to-tp2-tcp", "pp2-to-tp2-shm"])
def test_handoff_between_degrees_gives_the_colocated_output(tiny: LoadedModel, prefill: dict[str, int],
                                                            decode: dict[str, int], transport: str) -> None:
    prompts = [PROMPT, tokens(150, offset=5)]

    async def body(cluster: ClusterManager, workers: dict[str, WorkerThread]) -> None:
        calls = [collect(cluster, GenerateCall(f"h-{i}", tuple(p), greedy(10), 0.0)) for i, p in enumerate(prompts)]
        results = await asyncio.gather(*calls)
        for prompt, deltas in zip(prompts, results):
            assert tokens_of(deltas) == colocated(tiny, prompt, greedy(10))
        await wait_clean(cluster, ["p0", "d0"])
        assert cluster.workers["p0"].stats.num_transfers_completed == 2
        assert cluster.workers["d0"].stats.num_transfer_recomputes == 0
        for worker_id, wanted in (("p0", prefill), ("d0", decode)):
            ranks = workers[worker_id].worker.engine.ranks
            assert (len(ranks.pids) if ranks is not None else 1) == max(wanted.values(), default=1)

    overrides = {"p0": {**prefill, "num_threads": 1}, "d0": {**decode, "num_threads": 1, "kv_transport": transport}}
    run_pd(tiny, PD, body, overrides, timeout_s=120.0)


def test_dropped_layer_chunk_over_a_heterogeneous_pair_recomputes(tiny: LoadedModel) -> None:
    lease_s = 1.0

    async def body(cluster: ClusterManager, workers: dict[str, WorkerThread]) -> None:
        started = time.monotonic()
        deltas = await collect(cluster, GenerateCall("r-0", tuple(PROMPT), greedy(8), 0.0))
        assert time.monotonic() - started < lease_s + 5.0
        assert tokens_of(deltas) == colocated(tiny, PROMPT, greedy(8))
        await wait_clean(cluster, ["p0", "d0"])
        assert cluster.workers["d0"].stats.num_transfer_recomputes == 1
        assert cluster.workers["p0"].stats.num_transfers_failed == 1

    faults = (FaultRule(FaultAction.DROP, LayerChunk, layer_index=1),)
    run_pd(tiny, PD, body, {"p0": {**TP2, "transfer_faults": faults, "kv_lease_s": lease_s},
                            "d0": {"kv_lease_s": lease_s, "num_threads": 1}}, timeout_s=120.0)


def test_cancellation_mid_transfer_over_a_heterogeneous_pair_frees_both(tiny: LoadedModel) -> None:
    async def body(cluster: ClusterManager, workers: dict[str, WorkerThread]) -> None:
        stream = cluster.generate(GenerateCall("c-0", tuple(tokens(400)), greedy(500), 0.0))
        consumer = asyncio.ensure_future(stream.__anext__())
        await until(lambda: _source_state(workers, "c-0") is SourceState.AWAITING_ACK, 60.0)
        await cluster.abort("c-0")
        rest = [await consumer]
        if not rest[-1].finished:
            rest += [d async for d in stream]
        assert rest[-1].finished and rest[-1].finish_reason == "abort"
        await wait_clean(cluster, ["p0", "d0"])

    faults = (FaultRule(FaultAction.DELAY, SourceDone, delay_s=100.0),)
    run_pd(tiny, PD, body, {"p0": {"transfer_faults": faults, "max_num_batched_tokens": 32, "num_threads": 1},
                            "d0": TP2}, timeout_s=120.0)


def test_killed_rank_ends_the_workers_requests_and_the_router_drops_it(tiny: LoadedModel) -> None:
    async def body(cluster: ClusterManager, workers: dict[str, WorkerThread]) -> None:
        stream = cluster.generate(GenerateCall("k-0", tuple(PROMPT), greedy(1500), 0.0))
        first = await stream.__anext__()
        assert first.new_token_ids
        engine = workers["d0"].worker.engine
        os.kill(engine.ranks.pids[0], signal.SIGKILL)
        started = time.monotonic()
        rest = [d async for d in stream]
        assert time.monotonic() - started < 10.0
        assert rest[-1].finish_reason == "error" and "rank 0" in rest[-1].error
        await until(lambda: "d0" not in cluster.workers, 10.0)
        await asyncio.to_thread(workers["d0"].thread.join, 10.0)
        assert not workers["d0"].thread.is_alive()
        engine.check_invariants()  # every block back: only the prefix cache holds any
        assert all(p.poll() is not None for p in engine.ranks.processes)

    run_pd(tiny, PD, body, {"p0": {"num_threads": 1}, "d0": TP2}, timeout_s=120.0)
