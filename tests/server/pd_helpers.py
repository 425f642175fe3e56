"""A 1P+1D (or larger) cluster of real workers in threads of this process, for the disaggregation tests.

Workers share one tiny-random model load; the decode worker's KV lives in a real /dev/shm region
that the prefill worker maps and writes in place, over the real transports. Every helper ends with
the workers stopped and asserts no shared-memory file of theirs is left behind.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable

from kvbaton.core.config import CacheConfig, EngineConfig, SchedulerConfig
from kvbaton.core.sampling import SamplingParams
from kvbaton.engine.engine import Engine
from kvbaton.model.registry import LoadedModel
from kvbaton.router.admission import AdmissionPolicy
from kvbaton.router.pools import PoolBalancer
from kvbaton.server.base import GenerateCall, TokenDelta
from kvbaton.server.cluster import ClusterConfig, ClusterManager
from kvbaton.server.identity import tokenizer_probe_hash
from kvbaton.server.worker import Worker, WorkerConfig
from kvbaton.transfer.transport_shm import SHM_DIRECTORY, SHM_PREFIX
from tests.server.test_worker_cluster import SECRET, WorkerThread

NUM_BLOCKS = 128
BLOCK_SIZE = 16


def shm_files() -> set[str]:
    return {name for name in os.listdir(SHM_DIRECTORY) if name.startswith(f"{SHM_PREFIX}-{os.getpid()}-")}


def start(loaded: LoadedModel, address: str, worker_id: str, role: str, **overrides: object) -> WorkerThread:
    fields: dict[str, object] = {"block_size": BLOCK_SIZE, "num_blocks": NUM_BLOCKS, "router_timeout_s": 5.0,
                                 "max_num_batched_tokens": 64, "role": role, "cluster_secret": SECRET}
    fields.update(overrides)
    config = WorkerConfig(router_address=address, worker_id=worker_id, model="tiny-random", **fields)  # type: ignore[arg-type]
    return WorkerThread(Worker(config, loaded))


Body = Callable[[ClusterManager, dict[str, WorkerThread]], Awaitable[None]]


def run_pd(loaded: LoadedModel, roles: dict[str, str], body: Body,
           overrides: dict[str, dict[str, object]] | None = None, timeout_s: float = 40.0,
           admission: AdmissionPolicy | None = None, pools: PoolBalancer | None = None, **config: object) -> None:
    """Start a router and the workers `roles` names (id -> role), run `body`, shut down, check cleanup."""
    before = shm_files()

    async def main() -> None:
        fields: dict[str, object] = {"local_prefill_threshold_tokens": 0, "policy": "round_robin",
                                     "cluster_secret": SECRET}
        fields.update(config)
        cluster = ClusterManager(ClusterConfig(model_name="tiny-random", block_size=BLOCK_SIZE,
                                               tokenizer_probe_hash=tokenizer_probe_hash(loaded.tokenizer),
                                               **fields), admission=admission, pools=pools)  # type: ignore[arg-type]
        address = await cluster.start()
        workers = {w: start(loaded, address, w, role, **(overrides or {}).get(w, {})) for w, role in roles.items()}
        try:
            await cluster.wait_for_workers(len(roles), timeout_s=20.0)
            await asyncio.wait_for(body(cluster, workers), timeout_s)
        finally:
            await cluster.shutdown(timeout_s=5.0)
            for w in workers.values():
                await asyncio.to_thread(w.thread.join, 10.0)
                assert not w.thread.is_alive()
        for worker_id, w in workers.items():
            assert w.error is None, f"{worker_id}: {w.error!r}"

    asyncio.run(main())
    assert shm_files() == before, "a decode worker left its shared-memory region behind"


def greedy(max_tokens: int, **kwargs: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)  # type: ignore[arg-type]


def colocated(loaded: LoadedModel, prompt: list[int], params: SamplingParams) -> list[int]:
    engine = Engine(EngineConfig(model="tiny-random", cache=CacheConfig(BLOCK_SIZE, NUM_BLOCKS),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=64)), loaded=loaded)
    engine.add_request(prompt, params, request_id="ref")
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    return tokens


async def collect(cluster: ClusterManager, call: GenerateCall) -> list[TokenDelta]:
    return [delta async for delta in cluster.generate(call)]


def tokens_of(deltas: list[TokenDelta]) -> list[int]:
    return [t for d in deltas for t in d.new_token_ids]


async def wait_clean(cluster: ClusterManager, worker_ids: list[str], timeout_s: float = 10.0) -> None:
    """Until every worker's heartbeat shows no request, no transfer leg and no block beyond its prefix cache.

    Only heartbeats sampled after the call count: one sent before an abort reached the worker would show a
    clean worker that still holds the request (workers share this machine's monotonic clock)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    called_at = time.monotonic()
    while True:
        pending = []
        for worker_id in worker_ids:
            stats = cluster.workers[worker_id].stats
            if (stats is None or stats.monotonic_s < called_at or stats.num_running or stats.num_waiting or stats.num_live_transfers
                    or stats.num_transfer_held_blocks or stats.num_used_blocks != stats.num_cached_blocks):
                pending.append((worker_id, stats))
            else:
                assert stats.invariant_error == "", stats.invariant_error
        if not pending:
            return
        if loop.time() > deadline:
            raise AssertionError(f"workers still hold work or blocks: {pending}")
        await asyncio.sleep(0.02)
