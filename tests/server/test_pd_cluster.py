"""1 prefill + 1 decode worker behind the router (tiny-random, real shm/tcp transports): outputs, reuse, routing.

Must-show 1 on the fast model: greedy outputs through 1P+1D equal a colocated engine's, including a
prompt that hits the prefill worker's prefix cache; the KV moves once (prefill writes the decode
worker's shared memory); the metrics count it.
"""

from __future__ import annotations

import asyncio

import pytest

from kvbaton.model.registry import LoadedModel, load_model
from kvbaton.server.base import GenerateCall
from kvbaton.server.cluster import ClusterManager
from tests.server.pd_helpers import BLOCK_SIZE, colocated, collect, greedy, run_pd, tokens_of, wait_clean
from tests.server.test_worker_cluster import WorkerThread

PD = {"p0": "prefill", "d0": "decode"}


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random")


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_1p1d_outputs_equal_colocated_including_a_prefill_cache_hit(tiny: LoadedModel, transport: str) -> None:
    system = tiny.tokenizer.encode("A long shared system prompt that both requests start with. " * 3)
    prompts = [system + tiny.tokenizer.encode("First question?"), system + tiny.tokenizer.encode("Second one!"),
               tiny.tokenizer.encode("An unrelated prompt of some length, about something else entirely.")]
    expected = [colocated(tiny, p, greedy(10)) for p in prompts]

    async def body(cluster: ClusterManager, workers: dict[str, WorkerThread]) -> None:
        for i, prompt in enumerate(prompts):
            deltas = await collect(cluster, GenerateCall(f"r{i}-0", tuple(prompt), greedy(10), arrival_at=0.0))
            assert tokens_of(deltas) == expected[i], i
            assert deltas[-1].finish_reason == "length" and deltas[-1].worker_id == "d0"
            # usage.cached_tokens is the prefill worker's hit, carried to d0 with the first token
            hit_tokens = (len(system) // BLOCK_SIZE) * BLOCK_SIZE if i == 1 else 0
            assert deltas[-1].num_cached_tokens == hit_tokens, i
            await asyncio.sleep(0.1)
        await wait_clean(cluster, ["p0", "d0"])
        p_stats, d_stats = cluster.workers["p0"].stats, cluster.workers["d0"].stats
        assert p_stats.prefix_cache_hits_tokens >= (len(system) // BLOCK_SIZE) * BLOCK_SIZE > 0  # r1 hit p0's cache
        assert p_stats.num_transfers_completed == 3 and d_stats.num_transfers_completed == 3
        assert d_stats.prefix_cache_queries_tokens == 0  # d0 never prefilled a prompt: it adopted every one
        assert d_stats.num_transfer_recomputes == 0
        info = cluster.cluster_info()
        assert info["router_decisions"] == {"pair": 3}
        transfers = info["transfers"]
        layout_bytes_per_token = 2 * tiny.config.num_layers * tiny.config.num_kv_heads * tiny.config.head_dim * 2
        assert transfers["bytes"] == sum(len(p) for p in prompts) * layout_bytes_per_token
        assert transfers["num_completed"] == 6 and transfers["num_fallbacks"] == 0
        assert "kvbaton:kv_transfer_bytes" in render_metrics(cluster)

    run_pd(tiny, PD, body, overrides={"d0": {"kv_transport": transport}})


def render_metrics(cluster: ClusterManager) -> str:
    from kvbaton.server.metrics import ApiMetrics

    metrics = ApiMetrics()
    metrics.attach_cluster(cluster.cluster_info)
    return metrics.render().decode()


def test_short_prompts_prefill_on_the_decode_worker_and_skip_the_handoff(tiny: LoadedModel) -> None:
    short, long = list(range(3, 20)), list(range(3, 90))

    async def body(cluster: ClusterManager, workers: dict[str, WorkerThread]) -> None:
        a = await collect(cluster, GenerateCall("short-0", tuple(short), greedy(5), 0.0))
        b = await collect(cluster, GenerateCall("long-0", tuple(long), greedy(5), 0.0))
        assert tokens_of(a) == colocated(tiny, short, greedy(5)) and tokens_of(b) == colocated(tiny, long, greedy(5))
        assert cluster.router_decisions == {"local_prefill": 1, "pair": 1}
        await wait_clean(cluster, ["p0", "d0"])
        assert cluster.workers["p0"].stats.num_transfers_completed == 1

    run_pd(tiny, PD, body, local_prefill_threshold_tokens=32)


def test_mixed_and_disaggregated_pools_together(tiny: LoadedModel) -> None:
    async def body(cluster: ClusterManager, workers: dict[str, WorkerThread]) -> None:
        short = await collect(cluster, GenerateCall("s-0", tuple(range(3, 10)), greedy(3), 0.0))
        long = await collect(cluster, GenerateCall("l-0", tuple(range(3, 80)), greedy(3), 0.0))
        assert short[-1].worker_id == "w0" and long[-1].worker_id == "d0"
        await wait_clean(cluster, ["w0", "p0", "d0"])

    run_pd(tiny, {"w0": "mixed", **PD}, body, local_prefill_threshold_tokens=32)


def test_n_samples_hand_off_separately(tiny: LoadedModel) -> None:
    prompt = list(range(5, 60))

    async def body(cluster: ClusterManager, workers: dict[str, WorkerThread]) -> None:
        calls = [GenerateCall(f"n-{i}", tuple(prompt), greedy(6), 0.0) for i in range(3)]
        results = await asyncio.gather(*(collect(cluster, c) for c in calls))
        assert all(tokens_of(r) == colocated(tiny, prompt, greedy(6)) for r in results)
        await wait_clean(cluster, ["p0", "d0"])
        assert cluster.workers["d0"].stats.num_transfers_completed == 3

    run_pd(tiny, PD, body)


def test_late_reservation_through_real_workers_keeps_outputs_and_frees_everything(tiny: LoadedModel) -> None:
    # The prefill worker reserves each handoff's decode KV only once at most 16 prompt tokens are left ahead of
    # it: six concurrent calls queue on p0 and reserve one after another; outputs equal a colocated engine's.
    prompts = [tiny.tokenizer.encode(f"Question number {i}: what is the colour of a clear sky at noon?")
               for i in range(6)]
    expected = [colocated(tiny, p, greedy(6)) for p in prompts]

    async def body(cluster: ClusterManager, workers: dict[str, WorkerThread]) -> None:
        calls = [collect(cluster, GenerateCall(f"r{i}-0", tuple(p), greedy(6), arrival_at=0.0))
                 for i, p in enumerate(prompts)]
        for i, deltas in enumerate(await asyncio.gather(*calls)):
            assert tokens_of(deltas) == expected[i], i
            assert deltas[-1].worker_id == "d0"
        await wait_clean(cluster, ["p0", "d0"])
        assert cluster.cluster_info()["transfers"]["num_fallbacks"] == 0

    run_pd(tiny, PD, body, overrides={"p0": {"reserve_ahead_tokens": 16}})
