"""Request migration: a worker process killed (by pid) mid-decode moves its call to another worker, and the stream
goes on with no token lost or repeated; greedy and seeded output equal an uninterrupted run; the limit ends it.

The workers a test kills are real `kvbaton worker` processes (tiny-random, a few seconds to start); the router
is a ClusterManager in this process (tests/server/pd_helpers.py's `run_pd`), so the test reads its state.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvbaton.core.cluster_secret import SECRET_ENV
from kvbaton.core.sampling import SamplingParams
from kvbaton.engine.structured import grammar_for
from kvbaton.model.registry import LoadedModel, load_model
from kvbaton.server import rpc
from kvbaton.server.base import GenerateCall, TokenDelta
from kvbaton.server.cluster import ClusterManager
from kvbaton.server.metrics import ClusterCollector
from kvbaton.transfer.transport_shm import SHM_DIRECTORY, SHM_PREFIX
from tests.server.pd_helpers import BLOCK_SIZE, colocated, collect, greedy, run_pd, tokens_of, wait_clean
from tests.server.test_cluster_lifecycle import cluster_of
from tests.server.test_cluster_manager import call
from tests.server.test_worker_cluster import SECRET, WorkerThread

PROMPT = [(7 * i + 3) % 50 + 3 for i in range(40)]
MAX_TOKENS = 300


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random")


def spawn(cluster: ClusterManager, worker_id: str, role: str, log_dir: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "kvbaton.cli", "worker", "--router", cluster.address, "--model", "tiny-random",
               "--worker-id", worker_id, "--role", role, "--block-size", str(BLOCK_SIZE), "--num-blocks", "128",
               "--threads", "1", "--router-timeout", "30"]
    with open(log_dir / f"{worker_id}.log", "wb") as log:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True,
                                   env={**os.environ, SECRET_ENV: SECRET.to_hex()})
    cluster.watch_process(worker_id, process)
    return process


async def until(predicate: Callable[[], bool], timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.005)


Body = Callable[[ClusterManager, dict[str, subprocess.Popen[bytes]]], Awaitable[None]]


def with_processes(tiny: LoadedModel, roles: dict[str, str], log_dir: Path, body: Body,
                   threads: dict[str, str] | None = None, **config: object) -> None:
    """`run_pd` with worker processes `roles` (id -> role) besides its thread workers `threads`; every process
    is killed on the way out and the shared-memory regions of killed decode processes are removed."""
    processes: dict[str, subprocess.Popen[bytes]] = {}

    async def outer(cluster: ClusterManager, workers: dict[str, WorkerThread]) -> None:
        for worker_id, role in roles.items():
            processes[worker_id] = spawn(cluster, worker_id, role, log_dir)
        await cluster.wait_for_workers(len(roles) + len(workers), timeout_s=90.0)
        await body(cluster, processes)

    try:
        run_pd(tiny, threads or {}, outer, timeout_s=150.0, **config)
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
            process.wait(10)
            for name in os.listdir(SHM_DIRECTORY):
                if name.startswith(f"{SHM_PREFIX}-{process.pid}-"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(SHM_DIRECTORY, name))


async def kill_mid_decode(cluster: ClusterManager, processes: dict[str, subprocess.Popen[bytes]],
                          call: GenerateCall, after_tokens: int = 8,
                          sig: int = signal.SIGKILL) -> tuple[list[TokenDelta], str]:
    """Stream `call`, signal (`sig`) the process of the worker answering it once `after_tokens` tokens came; returns the
    whole stream and the worker killed."""
    consumer = asyncio.ensure_future(collect(cluster, call))
    await until(lambda: call.request_id in cluster._calls, 10.0)
    entry = cluster._calls[call.request_id]
    await until(lambda: len(entry.output_token_ids) >= after_tokens or entry.finished, 30.0)
    victim = entry.worker_id
    assert not entry.finished and len(entry.output_token_ids) < call.sampling.max_tokens // 2, "not mid-decode"
    os.kill(processes[victim].pid, sig)
    deltas = await consumer
    assert victim in cluster.lost_workers
    return deltas, victim


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])  # SIGTERM: the worker is drained, says goodbye
def test_killed_mixed_worker_mid_decode_the_stream_completes_as_if_uninterrupted(tiny: LoadedModel, tmp_path: Path,
                                                                                  sig: int) -> None:
    params = greedy(MAX_TOKENS)
    expected = colocated(tiny, PROMPT, params)  # before the cluster starts: it would block the router's loop

    async def body(cluster: ClusterManager, processes: dict[str, subprocess.Popen[bytes]]) -> None:
        deltas, victim = await kill_mid_decode(cluster, processes, GenerateCall("m-0", tuple(PROMPT), params, 0.0),
                                               sig=sig)
        reason = cluster.lost_workers[victim]
        # A drained worker says goodbye, then exits; its exit code joins the reason once the monitor sees it go
        # (`_note_late_exits`), which may come before this line or after.
        assert (reason.startswith("left: stopped by a signal") if sig == signal.SIGTERM
                else "exited with code -9" in reason), reason
        assert deltas[-1].finish_reason == "length" and not any(d.error for d in deltas)
        assert tokens_of(deltas) == expected  # none lost, none repeated
        assert cluster.num_migrations == 1 and cluster.num_failed_by_worker_loss == 0
        survivor = ({"w0", "w1"} - {victim}).pop()
        assert deltas[-1].worker_id == survivor
        await wait_clean(cluster, [survivor])  # no block leaked on the worker that took it over
        assert cluster.num_in_flight == 0 and cluster.num_waiting == 0
        cluster.placement.check_invariants()
        assert 'kvbaton:num_migrations_total 1.0' in metrics_text(cluster)

    with_processes(tiny, {"w0": "mixed", "w1": "mixed"}, tmp_path, body)


def metrics_text(cluster: ClusterManager) -> str:
    registry = CollectorRegistry()
    registry.register(ClusterCollector(cluster.cluster_info))
    return generate_latest(registry).decode()


def test_seeded_sampled_call_migrates_with_the_same_random_stream(tiny: LoadedModel, tmp_path: Path) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True,
                            repetition_penalty=1.1)
    expected = colocated(tiny, PROMPT, params)
    assert expected != colocated(tiny, PROMPT, greedy(MAX_TOKENS))  # it does sample

    async def body(cluster: ClusterManager, processes: dict[str, subprocess.Popen[bytes]]) -> None:
        deltas, _ = await kill_mid_decode(cluster, processes, GenerateCall("s-0", tuple(PROMPT), params, 0.0))
        assert deltas[-1].finish_reason == "length" and cluster.num_migrations == 1
        assert tokens_of(deltas) == expected

    with_processes(tiny, {"w0": "mixed", "w1": "mixed"}, tmp_path, body)


def test_killed_decode_worker_of_a_1p2d_pair_moves_to_the_other_decode_worker(tiny: LoadedModel,
                                                                               tmp_path: Path) -> None:
    params = greedy(MAX_TOKENS)
    expected = colocated(tiny, PROMPT, params)

    async def body(cluster: ClusterManager, processes: dict[str, subprocess.Popen[bytes]]) -> None:
        call = GenerateCall("pd-0", tuple(PROMPT), params, 0.0)
        consumer_started = asyncio.ensure_future(kill_mid_decode(cluster, processes, call))
        await until(lambda: call.request_id in cluster._calls, 10.0)
        assert cluster._calls[call.request_id].prefill_worker == "p0"  # a handed-off call
        deltas, victim = await consumer_started
        assert deltas[-1].finish_reason == "length" and not any(d.error for d in deltas)
        assert tokens_of(deltas) == expected
        survivor = ({"d0", "d1"} - {victim}).pop()
        assert deltas[-1].worker_id == survivor and cluster.num_migrations == 1
        await wait_clean(cluster, ["p0", survivor])
        cluster.placement.check_invariants()

    with_processes(tiny, {"d0": "decode", "d1": "decode"}, tmp_path, body, threads={"p0": "prefill"})


@pytest.mark.parametrize("limit", [0, 1])
def test_migration_limit_reached_ends_the_call_with_an_error_naming_it(tiny: LoadedModel, tmp_path: Path,
                                                                       limit: int) -> None:
    params = greedy(MAX_TOKENS)
    reference = colocated(tiny, PROMPT, params)

    async def body(cluster: ClusterManager, processes: dict[str, subprocess.Popen[bytes]]) -> None:
        call = GenerateCall("l-0", tuple(PROMPT), params, 0.0)
        consumer = asyncio.ensure_future(collect(cluster, call))
        await until(lambda: call.request_id in cluster._calls, 10.0)
        entry = cluster._calls[call.request_id]
        for num_killed in range(limit + 1):
            seen = len(entry.output_token_ids)
            await until(lambda: len(entry.output_token_ids) >= seen + 5, 30.0)
            os.kill(processes[entry.worker_id].pid, signal.SIGKILL)
            if num_killed < limit:
                await until(lambda: entry.num_migrations == num_killed + 1, 10.0)
        deltas = await consumer
        last = deltas[-1]
        assert last.finished and last.finish_reason == "error"
        assert "was lost while running this request" in last.error
        expected = ("migration is off (--migration-limit 0)" if limit == 0 else
                    "not migrated: it already moved 1 times (--migration-limit 1)")
        assert expected in last.error, last.error
        assert tokens_of(deltas) == reference[:len(tokens_of(deltas))]  # what came before the error is right
        assert cluster.num_migrations == limit and cluster.num_failed_by_worker_loss == 1
        survivors = sorted(set(processes) - set(cluster.lost_workers))
        await wait_clean(cluster, survivors)
        assert cluster.num_in_flight == 0

    roles = {f"w{i}": "mixed" for i in range(limit + 2)}
    with_processes(tiny, roles, tmp_path, body, migration_limit=limit)


def test_router_bookkeeping_of_a_migration_over_scripted_workers() -> None:
    """No process: the router's side alone. A call that lost w0 after 3 tokens is sent to w1 with them; the
    placement forgets w0 first, tallies the call once, counts it waiting again until w1's first token; w1 being
    unreachable too moves it on to w2; a consumer that aborts never moves."""
    cluster, socket = cluster_of({f"w{i}": "mixed" for i in range(4)}, policy="round_robin")
    deltas: list[TokenDelta] = []
    cluster.submit(call("r0", tuple(range(1, 30))), deltas.append)
    assert cluster._calls["r0"].worker_id == "w0"
    cluster.pool.handle("w0", rpc.TokenDeltas("w0", (TokenDelta("r0", (5, 6), "ab", False, None, 29, worker_id="w0"),
                                                     TokenDelta("r0", (7,), "c", False, None, 29, worker_id="w0"))))
    assert cluster.num_waiting == 0
    socket.sent.clear()
    socket.gone.add("w2")
    cluster.pool.handle("w0", rpc.Goodbye("w0", "draining"))  # w0 leaves; round robin offers w2, unreachable
    adds = [(w, m) for w, m in socket.sent if isinstance(m, rpc.AddRequest)]
    assert [(w, m.output_token_ids, m.prompt_token_ids) for w, m in adds] == [("w1", (5, 6, 7), tuple(range(1, 30)))]
    assert sorted(cluster.lost_workers) == ["w0", "w2"] and cluster.num_migrations == 2
    assert cluster.num_waiting == 1 and cluster.workers["w1"].in_flight == {"r0"}
    cluster.placement.check_invariants()
    cluster.pool.handle("w1", rpc.TokenDeltas("w1", (TokenDelta("r0", (8,), "d", True, "length", 29, worker_id="w1"),)))
    assert [t for d in deltas for t in d.new_token_ids] == [5, 6, 7, 8] and deltas[-1].finish_reason == "length"
    assert cluster.num_in_flight == 0 and cluster.num_waiting == 0 and cluster.num_failed_by_worker_loss == 0
    cluster.placement.check_invariants()
    # A call being aborted when its worker goes fails instead of moving (here to w3).
    cluster.submit(call("r1", tuple(range(1, 30))), deltas.append)
    assert cluster._calls["r1"].worker_id == "w3"
    socket.gone.add("w3")
    asyncio.run(cluster.abort("r1"))
    assert deltas[-1].finish_reason == "error" and cluster.num_migrations == 2 and cluster.num_in_flight == 0
    assert "w1" in cluster.workers and cluster.num_failed_by_worker_loss == 1


def test_the_resumed_output_travels_in_the_add_request_as_msgpack() -> None:
    add = rpc.AddRequest("r0", (1, 2, 3), greedy(9), "t", "default", output_token_ids=(7, 8, 2 ** 32 - 1))
    assert rpc.decode(rpc.encode(add)) == add
    assert rpc.decode(rpc.encode(rpc.AddRequest("r1", (1,), greedy(2)))).output_token_ids == ()


def test_a_structured_output_call_migrates_with_its_grammar_in_the_right_state(tiny: LoadedModel,
                                                                             tmp_path: Path) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, grammar=grammar_for("regex", "(ab|ba){40,}c"))
    expected = colocated(tiny, PROMPT, params)
    assert 40 <= len(expected) < MAX_TOKENS  # the grammar ends it ("stop" at its "c")

    async def body(cluster: ClusterManager, processes: dict[str, subprocess.Popen[bytes]]) -> None:
        deltas, _ = await kill_mid_decode(cluster, processes, GenerateCall("g-0", tuple(PROMPT), params, 0.0))
        assert deltas[-1].finish_reason == "stop" and cluster.num_migrations == 1, deltas[-1]
        assert tokens_of(deltas) == expected
        text = "".join(d.new_text for d in deltas)
        assert text.endswith("c") and len(text) >= 81

    with_processes(tiny, {"w0": "mixed", "w1": "mixed"}, tmp_path, body)
