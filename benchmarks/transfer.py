"""KV handoff bandwidth: 64 MB of KV blocks over `shm` and `tcp`, against memcpy and a raw socket, in one run.

The prefill side (this process) runs the full protocol per repeat — reserve, one chunk per layer
plus SourceDone in one `send_many` write, wait for the ack — to a decode process started here
(stopped by pid at the end; it removes its /dev/shm region on SIGTERM).
`shm_gb_s`/`tcp_gb_s` time the data path, from the grant to the ack (like the raw socket's
send-then-one-byte-ack); the reservation round trip before it is reported apart
(`*_reserve_rtt_ms`). The baselines run in the same invocation: a single-thread `np.copyto` of the same bytes, and a raw
TCP socket that `sendall`s them to a peer process that `recv_into`s a preallocated buffer and
answers one byte. Figures are medians over --repeats; ratios are the numbers to quote. Each link
opens once with its authenticated handshake (`kvbaton.transfer.link_auth`, timed as `*_link_setup_ms`);
the data path after it is the same bytes whatever the handshake was.

    .venv/bin/python benchmarks/transfer.py [--size-mb 64] [--repeats 7] [--fragmented]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

from kvbaton.cache.block_pool import BlockPool
from kvbaton.core.cluster_secret import SECRET_ENV, ClusterSecret
from kvbaton.transfer import FirstToken, HandoffDestination, HandoffSource, KVLayout, Outcome, TransferId
from kvbaton.transfer.base import storage_dtype
from kvbaton.transfer.driver import pump_destination, pump_source, send_all
from kvbaton.transfer.transport_shm import ShmKVReceiver, ShmKVRegion, ShmKVSender
from kvbaton.transfer.transport_socket import SocketKVSender
from kvbaton.transfer.transport_tcp import TcpKVReceiver, TcpKVSender

# SmolLM2-135M's KV layout in the engine's default dtype: 30 layers, 3 KV heads, head dim 64.
LAYOUT = KVLayout("smollm2-135m", "bfloat16", block_size=16, num_layers=30, num_kv_heads=3, head_dim=64)
FIRST = FirstToken(1, 0.0)


def _secret() -> ClusterSecret:
    """The link secret `main` put in the environment: this process's and its decode child's."""
    return ClusterSecret.from_hex(os.environ[SECRET_ENV])


def _num_blocks(size_mb: float) -> int:
    return max(1, round(size_mb * 2**20 / LAYOUT.block_bytes))


def _pool(num_blocks: int, fragmented: bool) -> BlockPool:
    """A fresh pool hands out consecutive ids; a fragmented one hands them out in a shuffled order."""
    pool = BlockPool(num_blocks)
    if fragmented:
        held = pool.allocate(num_blocks)
        pool.release([int(b) for b in np.random.default_rng(0).permutation(held)])
    return pool


# -- decode side (child process) -----------------------------------------------------------------


def serve(kind: str, num_blocks: int, fragmented: bool) -> None:
    """Decode worker: receive handoffs, adopt and free them at once; runs until SIGTERM."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # As many blocks as one handoff needs: each lands in the same 64 MB, like the memcpy baseline
    # (a larger pool would rotate through more memory than the baseline touches — a cache effect).
    capacity = num_blocks
    if kind == "raw":
        serve_raw(num_blocks * LAYOUT.block_bytes)
        return
    region = ShmKVRegion.create(LAYOUT, capacity) if kind == "shm" else None
    kv = region.kv if region else np.zeros(LAYOUT.storage_shape(capacity), storage_dtype(LAYOUT))
    receiver = (ShmKVReceiver("d0", region, secret=_secret()) if region
                else TcpKVReceiver("d0", LAYOUT, kv, secret=_secret()))
    pool = _pool(capacity, fragmented)
    destination = HandoffDestination(LAYOUT, pool, lease_s=60.0)
    print(f"ready {receiver.address[1]}", flush=True)
    try:
        while True:
            pump_destination(receiver, destination, time.monotonic(), timeout_s=0.05)
            for transfer_id in destination.complete_transfer_ids():
                pool.release(destination.adopt(transfer_id, time.monotonic()).block_ids)
    finally:
        receiver.close()
        if region is not None:
            del kv
            region.close()


def serve_raw(num_bytes: int) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    print(f"ready {listener.getsockname()[1]}", flush=True)
    conn, _ = listener.accept()
    buffer = np.empty(num_bytes, np.uint8)
    view = memoryview(buffer)
    while True:
        offset = 0
        while offset < num_bytes:
            num = conn.recv_into(view[offset:])
            if num == 0:
                return
            offset += num
        conn.sendall(b"k")


# -- prefill side (this process) -----------------------------------------------------------------


def _start_child(kind: str, num_blocks: int, fragmented: bool) -> tuple[subprocess.Popen[str], int]:
    args = [sys.executable, __file__, "--serve", kind, "--num-blocks", str(num_blocks)]
    child = subprocess.Popen(args + (["--fragmented"] if fragmented else []), stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    line = child.stdout.readline().split()
    if line[:1] != ["ready"]:
        _stop(child)
        raise RuntimeError(f"{kind} server did not start")
    return child, int(line[1])


def _stop(child: subprocess.Popen[str]) -> None:
    if child.poll() is None:
        os.kill(child.pid, signal.SIGTERM)
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=10)
    if child.stdout is not None:
        child.stdout.close()


class MemcpyRun:
    """Single-thread `np.copyto` of the same bytes between two preallocated, touched arrays."""

    def __init__(self, num_bytes: int) -> None:
        self.src = np.random.default_rng(0).integers(0, 255, num_bytes, dtype=np.uint8)
        self.dst = np.zeros_like(self.src)

    def once(self) -> float:
        start = time.perf_counter()
        np.copyto(self.dst, self.src)
        return time.perf_counter() - start

    def close(self) -> None:
        pass


class RawSocketRun:
    """`sendall` of the bytes to a process that `recv_into`s a preallocated buffer and answers one byte."""

    def __init__(self, num_blocks: int) -> None:
        self.child, port = _start_child("raw", num_blocks, False)
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.payload = np.random.default_rng(0).integers(0, 255, num_blocks * LAYOUT.block_bytes, dtype=np.uint8)

    def once(self) -> float:
        start = time.perf_counter()
        self.sock.sendall(self.payload)
        assert self.sock.recv(1) == b"k"
        return time.perf_counter() - start

    def close(self) -> None:
        self.sock.close()
        _stop(self.child)


class HandoffRun:
    """One full protocol handoff per call to a decode process; `once` times the grant -> ack data path."""

    def __init__(self, kind: str, num_blocks: int, fragmented: bool) -> None:
        self.child, port = _start_child(kind, num_blocks, fragmented)
        self.sender: SocketKVSender = (ShmKVSender if kind == "shm" else TcpKVSender)("p0", LAYOUT, secret=_secret())
        started_s = time.perf_counter()
        self.peer = self.sender.connect(("127.0.0.1", port))  # the authenticated handshake, once per link
        self.link_setup_s = time.perf_counter() - started_s
        self.num_blocks = num_blocks
        self.src_kv = np.random.default_rng(1).integers(0, 2**16, LAYOUT.storage_shape(num_blocks), dtype=np.uint16)
        self.pool = _pool(num_blocks, fragmented)
        self.source = HandoffSource(LAYOUT, self.pool, lease_s=60.0)
        self.reserve_times_s: list[float] = []
        self.num_handoffs = 0

    def once(self) -> float:
        sender, source = self.sender, self.source
        num_tokens = self.num_blocks * LAYOUT.block_size
        src_blocks = tuple(self.pool.allocate(self.num_blocks))
        tid = TransferId(f"bench-{self.num_handoffs}")
        self.num_handoffs += 1
        start = time.perf_counter()
        send_all(sender, source.start(tid, self.peer, num_tokens, time.monotonic()))
        while source.outcome(tid) is None and source.dst_block_ids(tid) == ():
            pump_source(sender, source, time.monotonic(), timeout_s=1.0)
        granted = time.perf_counter()
        # One prefill step produced every layer's KV: the per-layer chunks and SourceDone go as one write.
        messages = [source.stream(tid, layer, 0, num_tokens, src_blocks, time.monotonic()).message
                    for layer in range(LAYOUT.num_layers)]
        messages.append(source.finish(tid, FIRST, time.monotonic()).message)
        sender.send_many(self.peer, messages, self.src_kv)
        while source.outcome(tid) is None:
            pump_source(sender, source, time.monotonic(), timeout_s=1.0)
        end = time.perf_counter()
        assert source.outcome(tid) is Outcome.COMPLETED, source.reason(tid)
        self.pool.release(src_blocks)
        self.reserve_times_s.append(granted - start)
        return end - granted

    def close(self) -> None:
        self.sender.close()
        _stop(self.child)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=64.0)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--fragmented", action="store_true", help="shuffled block tables on both sides")
    parser.add_argument("--serve", choices=["shm", "tcp", "raw"], help=argparse.SUPPRESS)
    parser.add_argument("--num-blocks", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.num_blocks, args.fragmented)
        return
    os.environ.setdefault(SECRET_ENV, ClusterSecret.generate().to_hex())  # both ends of the links (children too)
    num_blocks = _num_blocks(args.size_mb)
    num_bytes = num_blocks * LAYOUT.block_bytes
    runs: dict[str, MemcpyRun | RawSocketRun | HandoffRun] = {}
    try:
        runs["memcpy"] = MemcpyRun(num_bytes)
        runs["raw_socket"] = RawSocketRun(num_blocks)
        runs["shm"] = HandoffRun("shm", num_blocks, args.fragmented)
        runs["tcp"] = HandoffRun("tcp", num_blocks, args.fragmented)
        # Interleave the four measurements repeat by repeat: the machine is shared, and load that
        # comes and goes then hits every figure alike. The first round warms up and is dropped.
        times_s: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.repeats + 1):
            for name, run in runs.items():
                times_s[name].append(run.once())
        gb_s = {name: num_bytes / statistics.median(times[1:]) / 1e9 for name, times in times_s.items()}
        reserve_ms = {name: statistics.median(runs[name].reserve_times_s[1:]) * 1e3 for name in ("shm", "tcp")}
        link_setup_ms = {name: runs[name].link_setup_s * 1e3 for name in ("shm", "tcp")}  # type: ignore[union-attr]
    finally:
        for run in runs.values():
            run.close()
    print(json.dumps({
        "bytes": num_bytes, "num_blocks": num_blocks, "layout": LAYOUT.layout_id, "repeats": args.repeats,
        "fragmented": args.fragmented, **{f"{name}_gb_s": round(value, 3) for name, value in gb_s.items()},
        "shm_over_memcpy": round(gb_s["shm"] / gb_s["memcpy"], 3),
        "tcp_over_raw_socket": round(gb_s["tcp"] / gb_s["raw_socket"], 3),
        "raw_socket_over_memcpy": round(gb_s["raw_socket"] / gb_s["memcpy"], 3),
        "shm_reserve_rtt_ms": round(reserve_ms["shm"], 3), "tcp_reserve_rtt_ms": round(reserve_ms["tcp"], 3),
        "shm_link_setup_ms": round(link_setup_ms["shm"], 3), "tcp_link_setup_ms": round(link_setup_ms["tcp"], 3),
    }))


if __name__ == "__main__":
    main()
