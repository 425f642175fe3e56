"""Real workers (tiny-random engine) behind a ClusterManager: serving, prefix hits, abort, refusal.

Workers run in threads of this process (one model load, fast start); the process-level failure path
(kill -9 of a worker process) is in test_worker_process.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterator

import pytest

from kvbaton.core.cluster_secret import ClusterSecret
from kvbaton.core.config import CacheConfig, EngineConfig
from kvbaton.core.errors import KvbatonError
from kvbaton.core.sampling import SamplingParams
from kvbaton.engine.engine import Engine
from kvbaton.model.registry import LoadedModel, load_model
from kvbaton.server.base import GenerateCall, TokenDelta
from kvbaton.server.cluster import ClusterConfig, ClusterManager
from kvbaton.server.identity import tokenizer_probe_hash
from kvbaton.server.worker import Worker, WorkerConfig

NUM_BLOCKS = 128
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random")


class WorkerThread:
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.error: BaseException | None = None
        self.result = ""
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.result = self.worker.run()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            self.error = exc


SECRET = ClusterSecret.generate()  # the test routers' and workers'


def start_worker(loaded: LoadedModel, address: str, worker_id: str, **overrides: object) -> WorkerThread:
    fields: dict[str, object] = {"block_size": BLOCK_SIZE, "num_blocks": NUM_BLOCKS, "router_timeout_s": 5.0,
                                 "cluster_secret": SECRET}
    fields.update(overrides)
    config = WorkerConfig(router_address=address, worker_id=worker_id, model="tiny-random", **fields)  # type: ignore[arg-type]
    return WorkerThread(Worker(config, loaded))


def run_cluster(loaded: LoadedModel, num_workers: int,
                body: Callable[[ClusterManager, list[WorkerThread]], Awaitable[None]], **config: object) -> None:
    async def main() -> None:
        cluster = ClusterManager(ClusterConfig(model_name="tiny-random", block_size=BLOCK_SIZE,
                                               tokenizer_probe_hash=tokenizer_probe_hash(loaded.tokenizer),
                                               cluster_secret=SECRET, **config))  # type: ignore[arg-type]
        address = await cluster.start()
        workers = [start_worker(loaded, address, f"w{i}") for i in range(num_workers)]
        try:
            await cluster.wait_for_workers(num_workers, timeout_s=20.0)
            await asyncio.wait_for(body(cluster, workers), 30.0)
        finally:
            await cluster.shutdown(timeout_s=5.0)
            for w in workers:
                await asyncio.to_thread(w.thread.join, 10.0)
                assert not w.thread.is_alive()
        for w in workers:
            assert w.error is None, w.error
            assert w.result == "shutdown: router shutting down"

    asyncio.run(main())


def greedy(max_tokens: int, **kwargs: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)  # type: ignore[arg-type]


async def collect(cluster: ClusterManager, call: GenerateCall) -> list[TokenDelta]:
    return [delta async for delta in cluster.generate(call)]


async def wait_idle(cluster: ClusterManager, worker_id: str) -> None:
    """Until a heartbeat sampled after this call says idle, with used == cached blocks and invariants checked."""
    called_at = time.monotonic()
    for _ in range(200):
        stats = cluster.workers[worker_id].stats
        if (stats is not None and stats.monotonic_s >= called_at and stats.num_running == 0 and stats.num_waiting == 0
                and stats.num_used_blocks == stats.num_cached_blocks):
            assert stats.invariant_error == ""
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"worker {worker_id} did not go idle: {cluster.workers[worker_id].stats}")


def test_greedy_output_through_the_cluster_equals_the_engine_and_a_shared_prefix_hits(tiny: LoadedModel) -> None:
    prompt = tiny.tokenizer.encode("The same long system prompt, shared by both requests. " * 3)
    engine = Engine(EngineConfig(model="tiny-random", cache=CacheConfig(BLOCK_SIZE, NUM_BLOCKS)), loaded=tiny)
    engine.add_request(prompt, greedy(12), request_id="ref")
    expected: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            expected.extend(out.new_token_ids)

    async def body(cluster: ClusterManager, workers: list[WorkerThread]) -> None:
        first = await collect(cluster, GenerateCall("a-0", tuple(prompt), greedy(12), arrival_at=0.0))
        assert [t for d in first for t in d.new_token_ids] == expected
        assert first[-1].finished and first[-1].finish_reason == "length"
        assert first[-1].num_prompt_tokens == len(prompt) and first[-1].num_cached_tokens == 0
        await asyncio.sleep(0.2)  # the worker's KV events reach the router's index
        second = await collect(cluster, GenerateCall("b-0", tuple(prompt + tiny.tokenizer.encode("More.")),
                                                     greedy(4), arrival_at=0.0))
        assert second[-1].worker_id == first[-1].worker_id  # longest_prefix follows the cached prefix
        assert second[-1].num_cached_tokens == (len(prompt) // BLOCK_SIZE) * BLOCK_SIZE > 0
        assert cluster.state.index.num_worker_blocks(first[-1].worker_id) >= len(prompt) // BLOCK_SIZE
        await wait_idle(cluster, first[-1].worker_id)
        assert cluster.router_decisions == {"longest_prefix": 2}

    run_cluster(tiny, 2, body, policy="longest_prefix")


def test_abort_mid_stream_frees_the_workers_blocks(tiny: LoadedModel) -> None:
    async def body(cluster: ClusterManager, workers: list[WorkerThread]) -> None:
        call = GenerateCall("long-0", tuple(range(3, 60)), greedy(400, ignore_eos=True), arrival_at=0.0)
        stream = cluster.generate(call)
        first = await stream.__anext__()
        assert first.new_token_ids and not first.finished
        await stream.aclose()  # client disconnect
        assert cluster.num_in_flight == 0
        await wait_idle(cluster, "w0")
        stats = cluster.workers["w0"].stats
        assert stats is not None and stats.num_steps < 400  # it really stopped early
        engine = workers[0].worker.engine
        assert engine is not None and engine.config.scheduler.queue_policy == "preble"  # told at register_ack

    run_cluster(tiny, 1, body, policy="preble")


def test_explicit_abort_ends_the_stream_with_an_abort_delta(tiny: LoadedModel) -> None:
    async def body(cluster: ClusterManager, workers: list[WorkerThread]) -> None:
        stream = cluster.generate(GenerateCall("x-0", tuple(range(3, 40)), greedy(400, ignore_eos=True), 0.0))
        await stream.__anext__()
        await cluster.abort("x-0")
        rest = [d async for d in stream]
        assert rest[-1].finished and rest[-1].finish_reason == "abort"
        await wait_idle(cluster, "w0")

    run_cluster(tiny, 1, body)


def test_bad_request_fails_with_the_engines_message(tiny: LoadedModel) -> None:
    async def body(cluster: ClusterManager, workers: list[WorkerThread]) -> None:
        deltas = await collect(cluster, GenerateCall("bad-0", (1, 2, 100_000), greedy(4), arrival_at=0.0))
        assert len(deltas) == 1 and deltas[0].finish_reason == "error"
        assert "token ids must be integers in [0, 384)" in deltas[0].error
        ok = await collect(cluster, GenerateCall("ok-0", (5, 6, 7), greedy(2), arrival_at=0.0))
        assert ok[-1].finish_reason == "length"

    run_cluster(tiny, 1, body)


def test_concurrent_calls_spread_over_workers_and_all_finish(tiny: LoadedModel) -> None:
    async def body(cluster: ClusterManager, workers: list[WorkerThread]) -> None:
        calls = [GenerateCall(f"c{i}-0", tuple(range(3 + i, 40 + i)), greedy(6), 0.0) for i in range(6)]
        results = await asyncio.gather(*(collect(cluster, c) for c in calls))
        assert all(r[-1].finish_reason == "length" and sum(len(d.new_token_ids) for d in r) == 6 for r in results)
        assert {r[-1].worker_id for r in results} == {"w0", "w1"}
        assert cluster.router_decisions == {"round_robin": 6}
        for worker_id in ("w0", "w1"):
            await wait_idle(cluster, worker_id)

    run_cluster(tiny, 2, body, policy="round_robin")


def test_worker_with_an_incompatible_layout_is_refused(tiny: LoadedModel) -> None:
    async def main() -> None:
        cluster = ClusterManager(ClusterConfig(model_name="tiny-random", block_size=BLOCK_SIZE, cluster_secret=SECRET))
        address = await cluster.start()
        try:
            good = start_worker(tiny, address, "w0")
            await cluster.wait_for_workers(1, timeout_s=20.0)
            bad = start_worker(tiny, address, "w1", block_size=32)
            await asyncio.to_thread(bad.thread.join, 10.0)
            assert isinstance(bad.error, KvbatonError)
            assert "router refused worker w1: KV layout" in str(bad.error)
            assert sorted(cluster.workers) == ["w0"]
        finally:
            await cluster.shutdown(timeout_s=5.0)
            await asyncio.to_thread(good.thread.join, 10.0)

    asyncio.run(main())


def test_worker_exits_when_the_router_is_gone(tiny: LoadedModel) -> None:
    async def main() -> WorkerThread:
        cluster = ClusterManager(ClusterConfig(model_name="tiny-random", block_size=BLOCK_SIZE, cluster_secret=SECRET))
        address = await cluster.start()
        worker = start_worker(tiny, address, "w0", router_timeout_s=0.5)
        await cluster.wait_for_workers(1, timeout_s=20.0)
        for task in cluster._tasks:  # the router stops answering without saying goodbye
            task.cancel()
        cluster._tasks = []
        await asyncio.to_thread(worker.thread.join, 10.0)
        await cluster.shutdown(timeout_s=0.1)
        return worker

    worker = asyncio.run(main())
    assert not worker.thread.is_alive()
    assert isinstance(worker.error, KvbatonError) and "router silent" in str(worker.error)


class SlowStepWorker(Worker):
    """Its first step takes `step_s` (a long prefill of a real model on a loaded host), its heartbeat loop with it."""

    step_s = 0.0

    def _step(self) -> None:
        step_s, SlowStepWorker.step_s = SlowStepWorker.step_s, 0.0
        time.sleep(step_s)
        super()._step()


def test_a_step_longer_than_the_worker_timeout_does_not_remove_the_worker(tiny: LoadedModel) -> None:
    async def main() -> None:
        cluster = ClusterManager(ClusterConfig(model_name="tiny-random", block_size=BLOCK_SIZE, cluster_secret=SECRET,
                                               worker_timeout_s=1.0))
        address = await cluster.start()
        SlowStepWorker.step_s = 3.0
        worker = WorkerThread(SlowStepWorker(WorkerConfig(
            router_address=address, worker_id="w0", model="tiny-random", block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
            router_timeout_s=5.0, cluster_secret=SECRET), tiny))
        try:
            await cluster.wait_for_workers(1, timeout_s=20.0)
            deltas = await asyncio.wait_for(collect(cluster, GenerateCall("slow-0", (3, 4, 5), greedy(3), arrival_at=0.0)), 30.0)
            assert deltas[-1].finished and deltas[-1].finish_reason == "length" and deltas[-1].error == ""
            assert "w0" in cluster.workers and cluster.lost_workers == {}
        finally:
            await cluster.shutdown(timeout_s=5.0)
            await asyncio.to_thread(worker.thread.join, 10.0)
        assert worker.error is None and not worker.thread.is_alive()

    asyncio.run(main())


@pytest.fixture(autouse=True)
def _no_leaked_threads() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    leaked = [t for t in threading.enumerate() if t not in before and t.is_alive() and not t.daemon]
    assert leaked == []
