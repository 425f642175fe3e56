"""Issue 21's live must-show: the KV store node serving real engines on this host (SmolLM2 by default).

A store node runs as its own process (`python -m kvbaton.server.store_server`, CurveZMQ, shared-memory DRAM
slots, a disk tier in a temporary directory); worker engines A and B (and a plain one without the store) run in
this process, one after the other, so each timing has the CPU to itself. Figures, all from this one run:

- **cross-worker hit**: a `--prefix-tokens` prompt computed on A is served on B from the store: B's TTFT over the
  TTFT of recomputing it (`ttft_store_over_recompute`, target <= 0.3) and the greedy outputs equal;
- **back from DRAM**: the prefix evicted from every device pool (B's cache cleared) comes back from the store's DRAM;
- **back from disk**: after other prefixes pushed it out of DRAM, it comes back from the disk tier (blocks read
  from disk, checksums checked);
- **load throughput**: the worker's own load path, from handing it the load to the engine holding the result, as
  `kvbaton serve` runs it on one host (the blocks looked up in the node's slot index and copied from its
  shared-memory slots into the KV pool without a lease, their generations checked after, the node told of the
  uses after the result), over a single-thread memcpy of the same bytes between two plain buffers, side by side
  (`load_over_memcpy`, target >= 0.8: a lone load, read on the engine thread as an idle engine does, its copy
  split over the worker's `copy_threads`, 2 here; `one_thread_*`: the same with the copy on the engine thread alone;
  `load_over_two_thread_memcpy`: over a memcpy split in two halves the same way; `io_thread_*`: the same read on
  the store IO thread, one copy thread, as a busy engine's is); `leased_*`: the same load by a
  worker that acquires a lease first (an RPC to the node, then the copy, then a release not waited for: the path
  off x86, and for disk blocks). For the prefix as one prefill stored it (its slots in order, copied in runs),
  and `scattered_*` for a prefix stored while DRAM was full, moved to disk and back (its slots churned:
  `scattered_load_runs` runs of consecutive slots, one copy per row each); `*_copy_only_*` counts the copy alone;
  `burst_*`: three such loads handed over at once to the IO thread against three memcpys;
- **cross-host load throughput**: the same load by a worker whose link is forced to the node's TCP data path
  (`KVBATON_STORE_TRANSPORT=tcp` in effect: 127.0.0.1, one host) over a raw loopback socket sending the same bytes
  from one buffer into another in the same run (`tcp_load_over_raw_socket`, target >= 0.8), interleaved, medians;
- **ITL under loads**: a `--stream-tokens` decode stream's p99 inter-token latency while `--loaders` other
  requests (one every stream-tokens / (loaders + 1) tokens) load their 2,000-token prefixes from the store and
  join its batch, over the same arrivals finding their prefixes on the device already
  (`itl_p99_with_loads_over_device_hits`, target <= 1.2: what the loads cost the stream, their admission into the
  batch being the same in both), `--itl-repeats` times interleaved: the median ratio and its spread (min, max);
  and over the stream alone; and with the arrivals recomputing their prefixes. A stream of 256 tokens with 8
  loaders puts the p99 at its third-largest gap of 254, where a 64-token stream with 2 had it at its largest, one
  step's. This part runs on an engine and store node of its own (DRAM for every loader's prefix, no disk), so the
  loads come from DRAM as the throughput figures' do.

Copies: a load copies a run of blocks as one memcpy per layer and K/V (768 KB each for SmolLM2's 2,000 tokens),
which glibc does with ordinary stores below its non-temporal threshold (sized from the 105 MB L3 here), at about
0.6x the speed of one large memcpy; the benchmark, like `kvbaton serve` for its workers with a store, runs with
the threshold at 256 KiB (`store_slots.STREAMING_COPIES`), so both the load and the memcpy it is compared with
stream; `--no-streaming-copies` runs with glibc's default. Prints one JSON line.
Usage: python benchmarks/kv_store_live.py [--model smollm2-135m] [--prefix-tokens 2000] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from kvbaton.core.cluster_secret import SECRET_ENV, ClusterSecret
from kvbaton.core.config import CacheConfig, EngineConfig, SchedulerConfig
from kvbaton.core.sampling import SamplingParams
from kvbaton.engine.engine import Engine
from kvbaton.engine.store_io import LoadJob, block_runs, namespace_of
from kvbaton.cache.hashing import hash_block_tokens
from kvbaton.model.registry import load_model
from kvbaton.server.store_client import StoreClient
from kvbaton.transfer.store_slots import STREAMING_COPIES, with_streaming_copies
from kvbaton.transfer.store_tcp import SOCKET_BUFFER_BYTES

BLOCK = 16
# Before each timed copy or load: the node's work on the one before (a release, the uses of an unleased read) is
# done by then, so it runs beside neither arm (on this 2-core VM the other core's work slows a memcpy ~15 %). Spent
# spinning, not asleep: a core woken from idle copies slower for a while, and this one runs the memcpys.
QUIET_S = 0.005


def _quiet() -> None:
    deadline = time.perf_counter() + QUIET_S
    while time.perf_counter() < deadline:
        pass


def _prompt(seed: int, num_tokens: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, vocab - 10) for _ in range(num_tokens)]


def _start_store(secret: ClusterSecret, block_bytes: int, rows: int, dram_gb: float,
                 disk: str) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "kvbaton.server.store_server", "--block-bytes", str(block_bytes),
               "--block-tokens", str(BLOCK), "--block-rows", str(rows), "--kv-store-gb", str(dram_gb),
               "--kv-store-disk-gb", disk, "--parent-pid", str(os.getpid())]  # it stops if this is killed
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env={**os.environ, SECRET_ENV: secret.to_hex()})
    line = process.stdout.readline()  # type: ignore[union-attr]
    if not line.startswith("store node ready"):
        process.kill()
        raise SystemExit(f"store node did not start: {line!r}")
    return process, line.split()[-1]


def _generate(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[list[int], float, int]:
    """(tokens, TTFT s, cached tokens) of one greedy request run alone on `engine`."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    rid = engine.add_request(prompt, params)
    tokens: list[int] = []
    ttft = 0.0
    cached = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.new_token_ids:
                if not tokens:
                    ttft = time.perf_counter() - started
                tokens += out.new_token_ids
            cached = out.num_cached_tokens
    return tokens, ttft, cached


def _settle(engine: Engine, client: StoreClient, timeout_s: float = 60.0) -> dict:
    """The store's stats once `engine`'s write-through has drained and the node has taken every put."""
    deadline = time.monotonic() + timeout_s
    while engine.store_io.num_pending_saves and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = client.stats()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        again = client.stats()
        if again["num_put_blocks"] == stats["num_put_blocks"]:
            return again
        stats = again
    return stats


def _load_throughput(engine: Engine, leased: Engine, prompt: list[int], repeats: int) -> dict[str, float]:
    """The worker's load path against a single-thread memcpy of the same bytes, interleaved: medians of each, and the
    ratios as the median (and min, max) of each adjacent pair's ratio, so a burst of the host's other load falls on
    both sides of a pair. Three arms: `engine` as an idle engine loads (same host, an unleased read from the node's
    slot index on the engine thread, `copy_now`, as `kvbaton serve` runs a lone load); `io_thread_`: the same read on
    the store IO thread (a busy engine's load); `leased_`: a worker whose link acquires a lease first (the path off
    x86, and for disk blocks); `one_thread_`: the idle engine's read with its copy on the engine thread alone (the
    default splits a copy this large over `copy_threads` threads, 2 here). A two-thread memcpy of the same bytes (two
    halves, one on a helper thread) is timed in each round too: what the idle engine's split copy is bounded by."""
    hashes = hash_block_tokens(engine.cache_key, prompt, BLOCK)
    num_blocks = len(hashes)
    block_bytes = engine.storage.bytes_per_block
    threads = engine.store_io.copy_threads
    arms = {"": (engine, True, threads), "one_thread_": (engine, True, 1), "io_thread_": (engine, False, threads),
            "leased_": (leased, False, threads)}
    device_ids = {}
    engine.reset_prefix_cache()
    leased.reset_prefix_cache()
    for name, (worker, _, _) in arms.items():
        device_ids[name] = worker.pool.allocate(num_blocks)  # timing only: no request runs meanwhile
    src = np.ones(num_blocks * block_bytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    np.copyto(dst, src)  # its pages touched before any timing
    half = len(src) // 2
    helper = ThreadPoolExecutor(1)
    helper.submit(np.copyto, dst[half:], src[half:]).result()  # the helper thread started before any timing
    memcpy_s: list[float] = []
    two_thread_memcpy_s: list[float] = []
    load_s: dict[str, list[float]] = {name: [] for name in arms}
    copy_s: dict[str, list[float]] = {name: [] for name in arms}
    slots: list[int] = []
    unleased_before, loads_now_before = engine.store_io.num_unleased_blocks, engine.store_io.num_loads_now
    for _ in range(repeats):
        _quiet()
        started = time.perf_counter()
        np.copyto(dst, src)
        memcpy_s.append(time.perf_counter() - started)
        _quiet()
        started = time.perf_counter()
        other_half = helper.submit(np.copyto, dst[half:], src[half:])
        np.copyto(dst[:half], src[:half])
        other_half.result()
        two_thread_memcpy_s.append(time.perf_counter() - started)
        for name, (worker, now, copy_threads) in arms.items():
            io = worker.store_io
            io.copy_threads = copy_threads
            job = LoadJob("bench", namespace_of(worker.cache_key), list(hashes), device_block_ids=device_ids[name])
            copied_before = io.copy_in_s
            _quiet()
            started = time.perf_counter()
            if not (now and io.copy_now(job)):
                io.acquire_and_copy(job)  # the path a load takes when the pool has room: one trip
            kind = _result(io)
            load_s[name].append(time.perf_counter() - started)
            assert kind == "copied" and job.num_copied == num_blocks, (kind, job.num_copied, num_blocks)
            copy_s[name].append(io.copy_in_s - copied_before)
            slots = job.slots or slots  # the leased arm's: where the node keeps the prefix
    helper.shutdown()
    engine.store_io.copy_threads = leased.store_io.copy_threads = threads
    num_bytes = num_blocks * block_bytes
    memcpy = statistics.median(memcpy_s)
    two_thread_ratios = sorted(m / x for m, x in zip(two_thread_memcpy_s, load_s[""]))
    result: dict[str, float] = {"load_blocks": num_blocks, "load_bytes": num_bytes, "memcpy_gbps": num_bytes / memcpy / 1e9,
                                "copy_threads": threads,
                                "two_thread_memcpy_gbps": num_bytes / statistics.median(two_thread_memcpy_s) / 1e9,
                                "load_over_two_thread_memcpy": statistics.median(two_thread_ratios),
                                "load_runs": len(block_runs(slots, device_ids["leased_"])), "repeats": repeats,
                                "load_unleased_blocks": engine.store_io.num_unleased_blocks - unleased_before,
                                "loads_on_the_engine_thread": engine.store_io.num_loads_now - loads_now_before}
    for name, (worker, _, _) in arms.items():
        worker.pool.release(device_ids[name])
        ratios = sorted(m / x for m, x in zip(memcpy_s, load_s[name]))
        copy_ratios = sorted(m / x for m, x in zip(memcpy_s, copy_s[name]))
        result.update({f"{name}load_gbps": num_bytes / statistics.median(load_s[name]) / 1e9,
                       f"{name}load_over_memcpy": statistics.median(ratios),
                       f"{name}load_over_memcpy_min": ratios[0], f"{name}load_over_memcpy_max": ratios[-1],
                       f"{name}load_copy_only_gbps": num_bytes / statistics.median(copy_s[name]) / 1e9,
                       f"{name}load_copy_only_over_memcpy": statistics.median(copy_ratios)})
    return result


def _burst_throughput(engine: Engine, prompt: list[int], repeats: int, loads: int = 3) -> dict[str, float]:
    """`loads` loads of the prefix handed to the IO thread at once (into as many sets of device blocks: what a burst
    of requests sharing a stored prefix asks), until the last is copied, against as many single-thread memcpys of
    the same bytes from one buffer into as many others, interleaved, medians. A lone load waits on two thread
    wake-ups of its own (the IO thread's, the engine's for the result); in a burst only the first and last do."""
    io = engine.store_io
    hashes = hash_block_tokens(engine.cache_key, prompt, BLOCK)
    engine.reset_prefix_cache()
    device_ids = [engine.pool.allocate(len(hashes)) for _ in range(loads)]  # timing only: no request runs
    num_bytes = len(hashes) * engine.storage.bytes_per_block
    src = np.ones(num_bytes, dtype=np.uint8)
    dsts = [np.zeros_like(src) for _ in range(loads)]
    for dst in dsts:
        np.copyto(dst, src)  # pages touched before any timing
    burst_s, memcpy_s = [], []
    for _ in range(repeats):
        _quiet()
        started = time.perf_counter()
        for dst in dsts:
            np.copyto(dst, src)
        memcpy_s.append(time.perf_counter() - started)
        jobs = [LoadJob("bench", namespace_of(engine.cache_key), list(hashes), device_block_ids=ids)
                for ids in device_ids]
        _quiet()
        started = time.perf_counter()
        for job in jobs:
            io.acquire_and_copy(job)
        kinds = _results(io, loads)
        burst_s.append(time.perf_counter() - started)
        assert kinds == ["copied"] * loads and all(job.num_copied == len(hashes) for job in jobs), kinds
    for ids in device_ids:
        engine.pool.release(ids)
    ratios = sorted(m / b for m, b in zip(memcpy_s, burst_s))
    return {"burst_loads": loads, "burst_load_gbps": loads * num_bytes / statistics.median(burst_s) / 1e9,
            "burst_memcpy_gbps": loads * num_bytes / statistics.median(memcpy_s) / 1e9,
            "burst_load_over_memcpy": statistics.median(ratios), "burst_load_over_memcpy_min": ratios[0],
            "burst_load_over_memcpy_max": ratios[-1]}


_RAW_SENDER = """
import socket, sys
num_bytes, buffer_bytes = int(sys.argv[1]), int(sys.argv[2])
payload = memoryview(bytearray(b"\\x01" * num_bytes))
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
peer, _ = listener.accept()
peer.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while peer.recv(1):
    peer.sendall(payload)
"""


class _RawSocket:
    """A raw loopback TCP stream of `num_bytes` from another process (as the store node is), into one buffer here:
    what the TCP load path is compared with. Same socket buffer sizes as the store's link."""

    def __init__(self, num_bytes: int) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", _RAW_SENDER, str(num_bytes), str(SOCKET_BUFFER_BYTES)],
                                        stdout=subprocess.PIPE, text=True)
        port = int(self.process.stdout.readline())  # type: ignore[union-attr]
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.dst = np.zeros(num_bytes, dtype=np.uint8)

    def receive_s(self) -> float:
        view = memoryview(self.dst)
        started = time.perf_counter()
        self.sock.send(b"x")
        while view:
            view = view[self.sock.recv_into(view):]
        return time.perf_counter() - started

    def close(self) -> None:
        self.sock.close()
        self.process.wait(10)


def _tcp_throughput(engine: Engine, prompt: list[int], repeats: int) -> dict[str, float]:
    """The TCP load path (`engine`'s link forced to tcp) against a raw loopback socket, interleaved, medians."""
    io = engine.store_io
    hashes = hash_block_tokens(engine.cache_key, prompt, BLOCK)
    num_bytes = len(hashes) * engine.storage.bytes_per_block
    engine.reset_prefix_cache()
    device_ids = engine.pool.allocate(len(hashes))  # timing only: no request runs meanwhile
    tcp_s, raw_s = [], []
    raw = _RawSocket(num_bytes)
    try:
        for _ in range(repeats):
            raw_s.append(raw.receive_s())
            job = LoadJob("bench", namespace_of(engine.cache_key), list(hashes), device_block_ids=device_ids)
            started = time.perf_counter()
            io.acquire_and_copy(job)  # one trip on the node's TCP port
            kind = _result(io)
            tcp_s.append(time.perf_counter() - started)
            assert kind == "copied" and job.num_copied == len(hashes), (kind, job.num_copied, len(hashes))
    finally:
        raw.close()
        engine.pool.release(device_ids)
    tcp, raw = statistics.median(tcp_s), statistics.median(raw_s)
    ratios = sorted(r / t for r, t in zip(raw_s, tcp_s))
    return {"tcp_load_gbps": num_bytes / tcp / 1e9, "raw_socket_gbps": num_bytes / raw / 1e9,
            "tcp_load_over_raw_socket": statistics.median(ratios), "tcp_load_over_raw_socket_min": ratios[0],
            "tcp_load_over_raw_socket_max": ratios[-1], "tcp_transport": engine.store_io.transport}


def _result(io: Any) -> str:
    return _results(io, 1)[0]


def _results(io: Any, count: int) -> list[str]:
    """The kinds of the next `count` load results, waited for as an engine with nothing but loads waits for them
    (`take_results` with a wait: the GIL let go, woken by the result)."""
    kinds: list[str] = []
    deadline = time.monotonic() + 30
    while len(kinds) < count:
        if time.monotonic() >= deadline:
            raise SystemExit(f"{len(kinds)} of {count} load results in 30 s")
        kinds += [kind for kind, _ in io.take_results(wait_s=0.01)]
    return kinds


def _itl_p99(engine: Engine, stream_prompt: list[int], loaders: list[list[int]], num_tokens: int) -> float:
    """p99 gap between a decode stream's tokens; `loaders` join one every few tokens (each loads its prefix from the
    store and samples one token)."""
    stream = engine.add_request(stream_prompt, SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True))
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times: list[float] = []
    pending = list(loaders)
    every = max(1, num_tokens // (len(loaders) + 1))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == stream and out.new_token_ids:
                times.append(time.perf_counter())
                if pending and len(times) % every == 0:
                    engine.add_request(pending.pop(0), one)
    gaps = sorted(b - a for a, b in zip(times[1:], times[2:]))  # from the second token on: decode steps only
    return gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--stream-tokens", type=int, default=256)
    parser.add_argument("--loaders", type=int, default=8, help="requests loading a prefix while the stream decodes")
    parser.add_argument("--itl-repeats", type=int, default=3)
    parser.add_argument("--no-streaming-copies", action="store_true", help="glibc's default memcpy threshold")
    args = parser.parse_args()
    if not args.no_streaming_copies and STREAMING_COPIES not in os.environ.get("GLIBC_TUNABLES", ""):
        # glibc reads its tunables when the process starts: run again with them
        os.execve(sys.executable, [sys.executable, *sys.argv], with_streaming_copies(dict(os.environ)))
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, "auto", "cpu")
    vocab = loaded.config.vocab_size
    block_bytes = loaded.config.kv_bytes_per_token(loaded.dtype.itemsize) * BLOCK
    prefix_blocks = args.prefix_tokens // BLOCK
    # DRAM for a bit more than two prefixes: a third and fourth push the first ones out to disk.
    dram_gb = 2.5 * prefix_blocks * block_bytes / 1e9
    secret = ClusterSecret.generate()
    with tempfile.TemporaryDirectory(prefix="kvbaton-store-bench-") as tmp:
        store, address = _start_store(secret, block_bytes, 2 * loaded.config.num_layers, dram_gb,
                                      f"{tmp}/disk:{20 * dram_gb}")
        # the ITL part's node: DRAM for every loader's prefix and two more, no disk
        itl_store, itl_address = _start_store(secret, block_bytes, 2 * loaded.config.num_layers,
                                              (args.loaders + 2) * prefix_blocks * block_bytes / 1e9, "")
        try:
            result = _run(args, loaded, vocab, secret, address, prefix_blocks, block_bytes, dram_gb)
            result.update(_itl(args, loaded, vocab, secret, itl_address, prefix_blocks))
        finally:
            for process in (store, itl_store):
                process.terminate()
                process.wait(10)
    print(json.dumps(result))


def _run(args: argparse.Namespace, loaded: Any, vocab: int, secret: ClusterSecret, address: str,
         prefix_blocks: int, block_bytes: int, dram_gb: float) -> dict[str, Any]:
    config = EngineConfig(model=args.model, cache=CacheConfig(block_size=BLOCK, num_blocks=4 * prefix_blocks + 64),
                          scheduler=SchedulerConfig(max_num_batched_tokens=512))

    def link() -> StoreClient:
        return StoreClient(address, secret)

    a = Engine(config, loaded, create_store_link=link)
    b = Engine(config, loaded, create_store_link=link)
    b_leased = Engine(config, loaded, create_store_link=lambda: StoreClient(address, secret, unleased_reads=False))
    c = Engine(config, loaded, create_store_link=lambda: StoreClient(address, secret, transport="tcp"))
    plain = Engine(config, loaded)
    client = StoreClient(address, secret)
    try:
        prompt = _prompt(1, args.prefix_tokens, vocab) + _prompt(2, 8, vocab)
        _generate(a, _prompt(0, 64, vocab), 2)  # warm-up: first-call costs out of the timings
        _generate(b, _prompt(0, 64, vocab), 2)
        _generate(b_leased, _prompt(0, 64, vocab), 2)
        _generate(plain, _prompt(0, 64, vocab), 2)
        ref_tokens, ttft_recompute, _ = _generate(plain, prompt, 8)
        a_tokens, ttft_a, _ = _generate(a, prompt, 8)
        # A again, its prefix a device hit: bf16 numerics of a prefill over a cached prefix (one short chunk after
        # 2,000 cached tokens) may differ from the full prefill's chunks, with or without a store: the loads must
        # match this exactly (same bytes in the pool as the hit's), and match recomputing where numerics allow.
        hit_tokens, _, cached_hit = _generate(a, prompt, 8)
        _settle(a, client)
        b_tokens, ttft_store, cached_b = _generate(b, prompt, 8)
        # The prefix as one prefill stored it (its slots in order): the common case of a load.
        throughput = _load_throughput(b, b_leased, prompt[: args.prefix_tokens], args.repeats)
        burst = _burst_throughput(b, prompt[: args.prefix_tokens], args.repeats)
        # The same prefix by C, whose link reads the node's slots over its TCP port (cross-host path, on loopback).
        c_tokens, ttft_tcp, cached_c = _generate(c, prompt, 8)
        tcp = _tcp_throughput(c, prompt[: args.prefix_tokens], args.repeats)
        b.reset_prefix_cache()  # evicted from every device pool: back from the store's DRAM
        a.reset_prefix_cache()
        dram_tokens, ttft_dram, cached_dram = _generate(b, prompt, 8)
        # Another prefix, used once, then three more through A: GDSF moves the one used least and longest ago (it)
        # out of DRAM to disk. B has never seen it: its load comes from the disk files.
        disk_prompt = _prompt(11, args.prefix_tokens, vocab) + _prompt(2, 8, vocab)
        disk_ref, _, _ = _generate(a, disk_prompt, 8)
        a.reset_prefix_cache()
        for seed in (3, 4, 5):
            _generate(a, _prompt(seed, args.prefix_tokens, vocab) + _prompt(2, 8, vocab), 1)
            a.reset_prefix_cache()
        before = _settle(a, client)
        b.reset_prefix_cache()
        disk_tokens, ttft_disk, cached_disk = _generate(b, disk_prompt, 8)
        after = client.stats()
        # A prefix whose slots churn scattered (stored while DRAM was full, moved to disk and back): block by block.
        scattered = _load_throughput(b, b_leased, _prompt(5, args.prefix_tokens, vocab), args.repeats)
        b.reset_prefix_cache()
        for engine in (a, b, c, plain):
            engine.check_invariants()
        return {
            "model": args.model, "threads": args.threads, "prefix_tokens": args.prefix_tokens,
            "block_bytes": block_bytes, "store_dram_gb": round(dram_gb, 4),
            "ttft_recompute_s": ttft_recompute, "ttft_worker_a_s": ttft_a, "ttft_store_s": ttft_store,
            "ttft_store_over_recompute": ttft_store / ttft_recompute, "cached_tokens_b": cached_b,
            "same_output": ref_tokens == a_tokens == b_tokens == dram_tokens == c_tokens and disk_tokens == disk_ref,
            "same_output_each": {"a": a_tokens == ref_tokens, "b_store": b_tokens == ref_tokens,
                                 "b_dram_reload": dram_tokens == ref_tokens, "c_tcp": c_tokens == ref_tokens,
                                 "b_disk_reload": disk_tokens == disk_ref, "a_device_hit": hit_tokens == ref_tokens},
            "same_output_as_device_hit": b_tokens == dram_tokens == c_tokens == hit_tokens and cached_hit > 0,
            "ttft_tcp_s": ttft_tcp, "cached_tokens_tcp": cached_c, **tcp,
            "streaming_copies": STREAMING_COPIES in os.environ.get("GLIBC_TUNABLES", ""),
            "ttft_dram_reload_s": ttft_dram, "cached_tokens_dram_reload": cached_dram,
            "ttft_disk_reload_s": ttft_disk, "cached_tokens_disk_reload": cached_disk,
            "disk_blocks_read_on_reload": after["num_disk_read_blocks"] - before["num_disk_read_blocks"],
            **throughput, **burst, **{f"scattered_{k}": v for k, v in scattered.items()},
            "num_loaded_blocks_b": b.store_io.num_loaded_blocks, "num_dropped_saves_a": a.store_io.num_dropped_saves,
            "store_stats": client.stats(),
        }
    finally:
        client.close()
        for engine in (a, b, b_leased, c):
            engine.close()


def _itl(args: argparse.Namespace, loaded: Any, vocab: int, secret: ClusterSecret, address: str,
         prefix_blocks: int) -> dict[str, Any]:
    """The ITL figures on an engine (and a plain one) with room for the stream and every loader's prefix, its store
    node `address` holding them all in DRAM."""
    num_blocks = (args.loaders + 2) * (prefix_blocks + 1) + 64
    config = EngineConfig(model=args.model, cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
                          scheduler=SchedulerConfig(max_num_batched_tokens=512))
    d = Engine(config, loaded, create_store_link=lambda: StoreClient(address, secret))
    plain = Engine(config, loaded)
    client = StoreClient(address, secret)
    try:
        stream_prompt = _prompt(9, 128, vocab)
        loaders = [_prompt(100 + i, args.prefix_tokens, vocab) + _prompt(7, 8, vocab) for i in range(args.loaders)]
        _generate(d, _prompt(0, 64, vocab), 2)  # warm-up
        for loader in loaders:  # computed once here: written through to the node
            _generate(d, loader, 1)
        stats = _settle(d, client)
        assert stats["num_dram_blocks"] >= args.loaders * prefix_blocks, stats
        itl_alone = _itl_p99(d, stream_prompt, [], args.stream_tokens)
        # The same arrivals with their prefixes on D's device already (they join the batch with the same short
        # prefill, and load nothing), then from the store: the difference is what the loads cost the stream.
        itl_device_runs, itl_loads_runs = [], []
        loaded_before = d.store_io.num_loaded_blocks
        for _ in range(args.itl_repeats):  # interleaved: the host's noise falls on both alike
            itl_device_runs.append(_itl_p99(d, stream_prompt, loaders, args.stream_tokens))
            d.reset_prefix_cache()
            itl_loads_runs.append(_itl_p99(d, stream_prompt, loaders, args.stream_tokens))  # each loads its prefix
        num_loaded = d.store_io.num_loaded_blocks - loaded_before
        itl_ratios = sorted(x / y for x, y in zip(itl_loads_runs, itl_device_runs))
        itl_device, itl_loads = statistics.median(itl_device_runs), statistics.median(itl_loads_runs)
        _generate(plain, stream_prompt, 1)  # the stream's own prompt cached, as it is on D after the first run
        itl_recompute = _itl_p99(plain, stream_prompt, loaders, args.stream_tokens)
        for engine in (d, plain):
            engine.check_invariants()
        return {"itl_stream_tokens": args.stream_tokens, "itl_loaders": args.loaders,
                "itl_loaded_blocks_per_run": num_loaded / max(1, args.itl_repeats),
                "itl_p99_alone_s": itl_alone, "itl_p99_with_loads_s": itl_loads,
                "itl_p99_with_loads_over_alone": itl_loads / itl_alone, "itl_p99_with_device_hits_s": itl_device,
                "itl_p99_with_loads_over_device_hits": statistics.median(itl_ratios),
                "itl_p99_with_loads_over_device_hits_min": itl_ratios[0],
                "itl_p99_with_loads_over_device_hits_max": itl_ratios[-1],
                "itl_p99_with_loads_over_device_hits_runs": itl_ratios, "itl_p99_with_recompute_s": itl_recompute}
    finally:
        client.close()
        d.close()


if __name__ == "__main__":
    main()
