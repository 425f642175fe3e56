"""The replicas' sync in one process: the CPU a router spends per cluster request reading its workers' heartbeats
(`rpc.Heartbeat`: the stats and the KV events since the last one), decoding them and applying them to its prefix
index and load tracker. No sockets, no HTTP: the frames are encoded up front and fed to `RouterSocket._decode` and
`WorkerPool.handle`, the path every frame from a worker takes in a router, so the figure is the sync's own cost,
repeatable on a busy machine (router_replicas.py measures the same inside the whole system).

Workload (router_replicas.py's, in tokens): `--num-groups` prompt groups, each request `--shared-tokens` of its
group's prefix and `--unique-tokens` of its own; a group's requests go to one worker (as a prefix-aware router
places them), and a worker's new blocks go out as one STORED event per request, `--requests-per-heartbeat` requests
per heartbeat. Two cases, each its own router:
- other: another router placed every request; this one only hears the events (a replica's share of the sync);
- own: this router placed each request (`on_routed`) before its events come back (what a lone router pays too).

    .venv/bin/python benchmarks/replica_sync.py [--num-requests 4000 --repeats 5]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from kvbaton.cache.events import KVEvent, KVEventKind
from kvbaton.cache.hashing import CacheKey, hash_block_tokens
from kvbaton.server import rpc
from kvbaton.server.cluster import ClusterConfig, ClusterManager
from kvbaton.server.router_socket import RouterSocket

BLOCK_SIZE = 16
KEY = CacheKey("fake-revision", "fake-layout")
MODEL = "sync-bench"


def build_frames(args: argparse.Namespace) -> tuple[list[tuple[str, bytes]], list[tuple[str, list[int]]]]:
    """The heartbeat frames (sender, payload) the workers send over the run, and each request's (worker, hashes)."""
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(50_000) for _ in range(args.shared_tokens)] for _ in range(args.num_groups)]
    workers = [f"w{i:02d}" for i in range(args.num_workers)]
    cached: dict[str, set[int]] = {w: set() for w in workers}
    seq = dict.fromkeys(workers, 0)
    pending: dict[str, list[list[object]]] = {w: [] for w in workers}
    served = dict.fromkeys(workers, 0)
    frames: list[tuple[str, bytes]] = []
    requests: list[tuple[str, list[int]]] = []
    root = KEY.with_tenant("").root_hash
    for i in range(args.num_requests):
        group = i % args.num_groups
        worker = workers[group % len(workers)]
        prompt = prefixes[group] + [rng.randrange(50_000) for _ in range(args.unique_tokens)]
        hashes = hash_block_tokens(KEY.with_tenant(""), prompt, BLOCK_SIZE)
        requests.append((worker, hashes))
        hit = 0
        while hit < len(hashes) and hashes[hit] in cached[worker]:
            hit += 1
        if hit < len(hashes):
            cached[worker].update(hashes[hit:])
            seq[worker] += 1
            parent = hashes[hit - 1] if hit else root
            pending[worker].append(KVEvent(seq[worker], KVEventKind.STORED, tuple(hashes[hit:]), parent,
                                           BLOCK_SIZE).to_wire())
        served[worker] += 1
        if served[worker] % args.requests_per_heartbeat == 0:
            stats = rpc.Stats(worker, 0, 0, 0, 0, 100_000, len(cached[worker]), 0, 0, 0, served[worker], 0.0)
            events = pending[worker]
            frames.append((worker, rpc.encode(rpc.Heartbeat(rpc.KVEvents(worker, tuple(events)), stats)
                                              if events else stats)))
            pending[worker] = []
    return frames, requests


def fresh_router(num_workers: int) -> ClusterManager:
    manager = ClusterManager(ClusterConfig(model_name=MODEL, policy="preble", block_size=BLOCK_SIZE))
    for i in range(num_workers):
        worker = f"w{i:02d}"
        manager.pool.handle(worker, rpc.Register(worker, "mixed", MODEL, KEY.model_revision, KEY.kv_layout,
                                                 BLOCK_SIZE, 100_000, "", 1))
        manager.pool.handle(worker, rpc.Stats(worker, 0, 0, 0, 0, 100_000, 0, 0, 0, 0, 0, 0.0))
    return manager


def run_once(frames: list[tuple[str, bytes]], requests: list[tuple[str, list[int]]], num_workers: int,
             own: bool) -> float:
    """CPU seconds of the frames' decode and handling (and, `own`, of the routing feedback before them)."""
    manager = fresh_router(num_workers)
    handle, decode, index = manager.pool.handle, RouterSocket._decode, manager.state.index
    per_frame = max(1, len(requests) // max(len(frames), 1))
    started = time.process_time()
    routed = 0
    for sender, payload in frames:
        if own:  # the requests whose events this frame brings were routed here first
            for worker, hashes in requests[routed:routed + per_frame]:
                index.on_routed(worker, tuple(hashes))
            routed += per_frame
        decoded = decode([sender.encode(), payload])
        if decoded is not None:
            handle(*decoded)
    elapsed = time.process_time() - started
    assert manager.pool.num_snapshots_requested == 0, "a seq gap: the frames are out of order"
    index.check_invariants()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=4000)
    parser.add_argument("--num-workers", type=int, default=8)
    parser.add_argument("--num-groups", type=int, default=8)
    parser.add_argument("--shared-tokens", type=int, default=400)
    parser.add_argument("--unique-tokens", type=int, default=100)
    parser.add_argument("--requests-per-heartbeat", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    frames, requests = build_frames(args)
    runs: dict[str, list[float]] = {"other": [], "own": []}
    for _ in range(args.repeats):  # interleaved
        for case in runs:
            runs[case].append(1e6 * run_once(frames, requests, args.num_workers, case == "own") / len(requests))
    print(json.dumps({"setup": vars(args), "num_frames": len(frames),
                      "cpu_us_per_cluster_request": {c: round(statistics.median(v), 2) for c, v in runs.items()},
                      "spread": {c: [round(min(v), 2), round(max(v), 2)] for c, v in runs.items()}}))


if __name__ == "__main__":
    main()
