"""What a client sees when its worker dies mid-decode: the stall from the kill to the next token of its stream
(the router notices the exit, migrates the call, the new worker recomputes prompt + streamed output and samples on),
next to the stream's median inter-token gap.

A ClusterManager in this process and `--trials` + 1 `kvbaton worker` processes (tiny-random by default); each
trial streams one greedy call, SIGKILLs the process of the worker answering it after `--kill-after` tokens, and
starts a fresh worker for the next trial. Prints one JSON line (progress on stderr).

    .venv/bin/python benchmarks/migration_stall.py [--trials 3 --prompt-tokens 40 --kill-after 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time

from kvbaton.core.cluster_secret import SECRET_ENV, ClusterSecret
from kvbaton.core.sampling import SamplingParams
from kvbaton.model.registry import load_model
from kvbaton.server.base import GenerateCall
from kvbaton.server.cluster import ClusterConfig, ClusterManager
from kvbaton.server.identity import tokenizer_probe_hash


def spawn(cluster: ClusterManager, secret: ClusterSecret, worker_id: str, model: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "kvbaton.cli", "worker", "--router", cluster.address, "--model", model,
               "--worker-id", worker_id, "--num-blocks", "256", "--threads", "1", "--router-timeout", "30"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                               env={**os.environ, SECRET_ENV: secret.to_hex()})
    cluster.watch_process(worker_id, process)
    return process


async def run(args: argparse.Namespace) -> dict[str, object]:
    secret = ClusterSecret.generate()
    cluster = ClusterManager(ClusterConfig(model_name=args.model, cluster_secret=secret, policy="round_robin",
                                           tokenizer_probe_hash=tokenizer_probe_hash(load_model(args.model).tokenizer)))
    await cluster.start()
    processes = {f"w{i}": spawn(cluster, secret, f"w{i}", args.model) for i in range(2)}
    stalls_s: list[float] = []
    gaps_s: list[float] = []
    try:
        await cluster.wait_for_workers(2, 120.0)
        prompt = tuple((7 * i + 3) % 50 + 3 for i in range(args.prompt_tokens))
        for trial in range(args.trials):
            call = GenerateCall(f"t{trial}", prompt, SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                                                    ignore_eos=True), 0.0)
            stamps: list[float] = []
            killed_at = 0.0
            async for delta in cluster.generate(call):
                if delta.new_token_ids:
                    stamps.append(time.monotonic())
                if len(stamps) == args.kill_after and not killed_at:
                    killed_at = time.monotonic()
                    os.kill(processes[cluster._calls[call.request_id].worker_id].pid, signal.SIGKILL)
            assert delta.finish_reason == "length" and len(stamps) == args.max_tokens, delta
            stalls_s.append(min(s for s in stamps if s > killed_at) - killed_at)
            gaps_s.append(statistics.median(b - a for a, b in zip(stamps, stamps[1:])))
            print(f"trial {trial}: stall {stalls_s[-1] * 1e3:.0f} ms", file=sys.stderr)
            processes[f"n{trial}"] = spawn(cluster, secret, f"n{trial}", args.model)
            await cluster.wait_for_workers(2, 120.0)
    finally:
        await cluster.shutdown(timeout_s=5.0)
        for process in processes.values():
            if process.poll() is None:
                process.kill()
            process.wait(10)
    return {"model": args.model, "prompt_tokens": args.prompt_tokens, "kill_after_tokens": args.kill_after,
            "trials": args.trials, "num_migrations": cluster.num_migrations,
            "stall_ms_median": round(statistics.median(stalls_s) * 1e3, 1),
            "stall_ms": [round(s * 1e3, 1) for s in stalls_s],
            "inter_token_ms_median": round(statistics.median(gaps_s) * 1e3, 2),
            # the stall against the uninterrupted stream's own gap between tokens, in the same trials
            "stall_over_inter_token": round(statistics.median(stalls_s) / statistics.median(gaps_s), 1),
            "cpus": os.cpu_count()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--kill-after", type=int, default=20)
    print(json.dumps(asyncio.run(run(parser.parse_args()))))


if __name__ == "__main__":
    main()
