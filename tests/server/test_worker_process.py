"""`kvbaton worker` as a real process: kill -9 fails its in-flight call; shutdown and refusal exit cleanly.

Each test starts one worker process (python + torch import: a few seconds) and kills it by pid on the way out.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable

from kvbaton.core.cluster_secret import SECRET_ENV, ClusterSecret
from kvbaton.core.sampling import SamplingParams
from kvbaton.model.registry import load_model
from kvbaton.server.base import GenerateCall
from kvbaton.server.cluster import ClusterConfig, ClusterManager
from kvbaton.server.identity import tokenizer_probe_hash

STARTUP_TIMEOUT_S = 90.0


SECRET = ClusterSecret.generate()


def spawn_worker(address: str, worker_id: str, *extra: str) -> subprocess.Popen[bytes]:
    """A `kvbaton worker` process, handed the test router's cluster secret as the launcher hands it (environment)."""
    command = [sys.executable, "-m", "kvbaton.cli", "worker", "--router", address, "--model", "tiny-random",
               "--worker-id", worker_id, "--num-blocks", "128", "--router-timeout", "10", *extra]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            env={**os.environ, SECRET_ENV: SECRET.to_hex()})


def run_with_worker(body: Callable[[ClusterManager, subprocess.Popen[bytes]], Awaitable[None]],
                    *extra: str, block_size: int = 16) -> subprocess.Popen[bytes]:
    probe = tokenizer_probe_hash(load_model("tiny-random").tokenizer)

    async def main() -> subprocess.Popen[bytes]:
        cluster = ClusterManager(ClusterConfig(model_name="tiny-random", block_size=block_size,
                                               tokenizer_probe_hash=probe, cluster_secret=SECRET))
        address = await cluster.start()
        process = spawn_worker(address, "w0", *extra)
        cluster.watch_process("w0", process)
        try:
            await asyncio.wait_for(body(cluster, process), STARTUP_TIMEOUT_S + 30.0)
        finally:
            await cluster.shutdown(timeout_s=5.0)
            try:
                await asyncio.to_thread(process.wait, 10.0)
            finally:
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
        return process

    return asyncio.run(main())


def test_killed_worker_fails_its_in_flight_call_and_cluster_is_not_ready() -> None:
    async def body(cluster: ClusterManager, process: subprocess.Popen[bytes]) -> None:
        await cluster.wait_for_workers(1, STARTUP_TIMEOUT_S)
        assert cluster.is_ready()[0]
        call = GenerateCall("long-0", tuple(range(3, 50)), SamplingParams(max_tokens=2000, temperature=0.0,
                                                                          ignore_eos=True), 0.0)
        stream = cluster.generate(call)
        first = await stream.__anext__()
        assert first.new_token_ids and not first.finished
        process.kill()
        rest = [delta async for delta in stream]
        last = rest[-1]
        assert last.finished and last.finish_reason == "error"
        assert last.error.startswith(f"worker w0 was lost while running this request (process {process.pid} on "
                                     f"{socket.gethostname()} exited with code -9); no other worker took it over")
        ready, reason = cluster.is_ready()
        assert not ready and "w0: process" in reason and "exited with code -9" in reason
        assert cluster.num_in_flight == 0 and cluster.state.index.num_worker_blocks("w0") == 0

    process = run_with_worker(body)
    assert process.returncode == -9


def test_worker_process_exits_zero_on_router_shutdown() -> None:
    async def body(cluster: ClusterManager, process: subprocess.Popen[bytes]) -> None:
        await cluster.wait_for_workers(1, STARTUP_TIMEOUT_S)
        deltas = [d async for d in cluster.generate(GenerateCall("a-0", (5, 6, 7), SamplingParams(
            max_tokens=3, temperature=0.0), 0.0))]
        assert deltas[-1].finish_reason == "length"

    process = run_with_worker(body)
    assert process.returncode == 0
    assert b"stopped (shutdown: router shutting down)" in process.stderr.read()  # type: ignore[union-attr]


def test_refused_worker_process_exits_with_the_reason() -> None:
    async def body(cluster: ClusterManager, process: subprocess.Popen[bytes]) -> None:
        code = await asyncio.to_thread(process.wait, STARTUP_TIMEOUT_S)
        assert code == 2
        assert cluster.workers == {}

    process = run_with_worker(body, "--block-size", "32", block_size=16)
    stderr = process.stderr.read().decode()  # type: ignore[union-attr]
    assert "kvbaton: error: router refused worker w0: block size 32 differs from the cluster's 16" in stderr
    assert "Traceback" not in stderr
