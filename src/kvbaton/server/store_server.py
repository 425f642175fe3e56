"""A live KV store node's server: `StoreNodeState` behind one zmq ROUTER socket, under CurveZMQ, msgpack framing.

Only holders of the cluster secret connect (`kvbaton.server.rpc_auth`, with the store's own derived key pairs:
channel "store"). A message is `header | payload...`: a msgpack map (never pickle) with `op`, and for a put one
raw frame per block. Ops:

- `hello` -> the DRAM slots' shared-memory path, block bytes and slot count (a same-host worker maps them), the
  node's host id (`store_slots.host_id`: a worker whose own differs is on another host) and the port of its TCP
  data path (`kvbaton.transfer.store_tcp`: a worker on another host reads leased slots over it);
- `put` (namespace, parent hash, block hashes, `replica`; the blocks' bytes as frames): write-through, no answer
  (a worker never waits on a save); `replica`: blocks the worker loaded from another node that granted them a copy
  here (`kv_store`'s replication rule);
- `acquire` (namespace, block hashes) -> a lease and the slots of the leading blocks held, pinned;
- `touch` (namespace, block hashes): a same-host worker copied these from their slots unleased (the slot index,
  `kvbaton.transfer.store_slots`): a use each; no answer;
- `release` (lease): the worker copied them out; no answer (`StoreClient` sends these two on the TCP link
  instead, `store_tcp`'s `acquire` and `release` ops: the same calls under the same lock, on a shorter trip);
- `events` (after a seq) -> the node's events since, or a snapshot, and the node's `epoch` (random at each
  start: its seqs begin again when it changes): what a router's store directory reads;
- `clear` -> drops every block no lease pins, DRAM and disk (vLLM's `/reset_prefix_cache` reaching the store):
  how many;
- `stats` -> counters.

Bad input is answered with `error` and changes nothing. The loop also expires leases a dead worker left.
`python -m kvbaton.server.store_server` runs one node as its own process (what `kvbaton serve --kv-store-gb`
starts on each host), printing its address once it listens; `start_process` and `stop_process` start and stop one
that way (the launcher on its host, and with Ray each node's `StoreHost` actor, `kvbaton.server.ray_workers`).
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import msgpack
import zmq

from kvbaton.cache.kv_store import capacity_blocks
from kvbaton.core.cluster_secret import SECRET_ENV, ClusterSecret, worker_environment
from kvbaton.core.errors import KvbatonError
from kvbaton.server.rpc_auth import secure_router
from kvbaton.server.store_node import StoreNodeState
from kvbaton.transfer.store_disk import DiskBlockFiles
from kvbaton.transfer.store_slots import SHM_DIRECTORY, SHM_PREFIX, host_id
from kvbaton.transfer.store_tcp import StoreTcpServer

log = logging.getLogger("kvbaton.store")

STORE_CHANNEL = "store"


class StoreServer:
    def __init__(self, state: StoreNodeState, secret: ClusterSecret, host: str = "127.0.0.1", port: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.state = state
        self._clock = clock
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._auth = secure_router(self._socket, self._context, secret, STORE_CHANNEL)
        if port:
            self._socket.bind(f"tcp://{host}:{port}")
        else:
            port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._stop = threading.Event()
        self._lock = threading.Lock()  # tests read the state between messages; the TCP reads take it too
        self.num_errors = 0
        self.host_id = host_id()
        self.epoch = secrets.token_hex(8)  # this start's: a reader that sees it change knows the node restarted
        self.tcp = StoreTcpServer(lambda: self.state.slots, state.begin_read, state.end_read, self.locked, secret,
                                  host, acquire=self._tcp_acquire, release=state.release, pin=self._tcp_pin,
                                  settle=state.settle, held=self._tcp_held).start()

    def serve(self, poll_ms: int = 100, parent_pid: int = 0) -> None:
        """Answer until `stop`, or (`parent_pid`) until the process that started this one is gone (a launcher killed
        before it could stop its node: the node leaves with it, never an orphan holding its shared memory)."""
        socket = self._socket
        try:
            while not self._stop.is_set() and not (parent_pid and os.getppid() != parent_pid):
                if socket.poll(poll_ms):
                    while socket.get(zmq.EVENTS) & zmq.POLLIN:
                        frames = socket.recv_multipart(copy=False)
                        with self._lock:
                            self._handle(frames)
                with self._lock:
                    self.state.expire(self._clock())
        finally:
            self.tcp.stop()
            socket.close()
            self._auth.stop()
            self._context.term()
            self.state.close()

    def start_thread(self) -> threading.Thread:
        thread = threading.Thread(target=self.serve, name="kv-store-node", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()

    def locked(self) -> threading.Lock:
        return self._lock

    def _tcp_acquire(self, request: dict) -> tuple[int, list[int]]:
        """A TCP `load`'s acquire (under the lock): the lease of the leading blocks held (0 for none) and, for a
        reader on another store node (`remote`), the positions in the chain of the blocks granted a copy there."""
        granted: list[int] | None = [] if request.get("remote") is True else None
        hashes = _hashes(request)
        try:
            lease = self.state.acquire(_namespace(request), hashes, self._clock(), granted=granted)[0]
        except KvbatonError as exc:
            raise ValueError(str(exc)) from exc
        due = set(granted or ())
        return lease, [i for i, block_hash in enumerate(hashes) if block_hash in due]

    def _tcp_pin(self, request: dict) -> dict:
        """A same-host worker's acquire on its TCP link (under the lock): what the control path's answers, its uses
        left for `settle`."""
        try:
            lease, slots = self.state.acquire(_namespace(request), _hashes(request), self._clock(), defer_uses=True)
        except KvbatonError as exc:
            raise ValueError(str(exc)) from exc
        return {"lease": lease, "slots": slots, "shm_path": self.state.slots.path}

    def _tcp_held(self, request: dict) -> int:
        """How many leading blocks of a chain this node holds, under the request's namespace (under the lock)."""
        try:
            return self.state.store.match(_hashes(request), _namespace(request))
        except KvbatonError as exc:
            raise ValueError(str(exc)) from exc

    def _handle(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        try:
            header = msgpack.unpackb(frames[1].bytes, raw=False, strict_map_key=True)
            if not isinstance(header, dict) or not isinstance(header.get("op"), str):
                raise KvbatonError("a store message header must be a map with an op")
            reply = self._answer(header, frames[2:])
        except (KvbatonError, ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
            self.num_errors += 1
            header = _safe_header(frames)
            header = header if isinstance(header, dict) else {}
            # put, release and touch are never answered (a worker does not wait on them): their errors are counted
            reply = None if header.get("op") in ("put", "release", "touch") else {"id": header.get("id"), "error": str(exc)[:500]}
        if reply is not None:
            self._socket.send_multipart([identity, msgpack.packb(reply)])
        self.state.settle()  # an acquire's uses, after its answer went out (still under the lock)

    def _answer(self, header: dict, payloads: list[zmq.Frame]) -> dict | None:
        state = self.state
        op = header["op"]
        if op == "put":
            state.put(_namespace(header), int(header["parent"]), _hashes(header), [f.buffer for f in payloads],
                      header.get("replica") is True)
            return None
        if op == "release":
            state.release(int(header["lease"]))
            return None
        if op == "touch":
            state.touch(_namespace(header), _hashes(header))
            return None
        reply: dict = {"id": header.get("id")}
        if op == "acquire":  # the slots are of this file: a worker that mapped another (a node since restarted) remaps
            reply["lease"], reply["slots"] = state.acquire(_namespace(header), _hashes(header), self._clock(),
                                                           defer_uses=True)
            reply["shm_path"] = state.slots.path
        elif op == "hello":
            reply.update(shm_path=state.slots.path, block_bytes=state.block_bytes, num_slots=state.slots.num_slots,
                         num_rows=state.slots.num_rows, host_id=self.host_id, tcp_port=self.tcp.port)
        elif op == "events":
            events, snapshot = state.events_since(int(header.get("since", 0)))
            reply["snapshot"] = snapshot
            reply["epoch"] = self.epoch
            reply["events"] = [[e.seq, e.kind, list(e.block_hashes), e.tier] for e in events]
            if state.disk is not None:  # what its disk reads moved and took, cumulative: the router's disk speed
                reply["disk_read_bytes"], reply["disk_read_s"] = state.disk.num_read_bytes, state.disk.read_s
        elif op == "clear":
            reply["num_cleared"] = state.clear()
        elif op == "stats":
            store = state.store
            reply.update(num_blocks=store.num_blocks, num_put_blocks=state.num_put_blocks,
                         num_loaded_blocks=state.num_loaded_blocks, num_leases=state.num_leases,
                         num_expired_leases=state.num_expired_leases, num_evicted_blocks=store.num_evicted_blocks,
                         num_corrupt_blocks=state.disk.num_corrupt_blocks if state.disk is not None else 0,
                         num_disk_read_blocks=state.disk.num_read_blocks if state.disk is not None else 0,
                         num_disk_blocks=state.num_disk_blocks, num_dram_blocks=state.num_dram_blocks,
                         num_errors=self.num_errors, num_tcp_reads=self.tcp.num_reads,
                         num_tcp_sent_bytes=self.tcp.num_sent_bytes, num_tcp_refused=self.tcp.num_refused)
        else:
            raise KvbatonError(f"unknown store op {op!r}")
        return reply


def _safe_header(frames: list[zmq.Frame]) -> object:
    try:
        return msgpack.unpackb(frames[1].bytes, raw=False) if len(frames) > 1 else None
    except Exception:  # noqa: BLE001 - the header was already found bad; this only looks for its id
        return None


def _namespace(header: dict) -> tuple[str, ...]:
    namespace = header["namespace"]
    if not isinstance(namespace, list) or len(namespace) != 3 or not all(isinstance(p, str) for p in namespace):
        raise KvbatonError("a store namespace is [model revision, KV layout, tenant salt]")
    return tuple(namespace)


def _hashes(header: dict) -> list[int]:
    hashes = header["hashes"]
    if not isinstance(hashes, list) or not all(isinstance(h, int) and -2**63 <= h < 2**63 for h in hashes):
        raise KvbatonError("block hashes must be a list of signed 64-bit integers")
    return hashes


def parse_disk(text: str) -> tuple[str, float]:
    """`DIR:GB` -> (DIR, GB)."""
    directory, sep, gb = text.rpartition(":")
    try:
        value = float(gb)
    except ValueError:
        value = -1.0
    if not sep or not directory or value < 0:
        raise KvbatonError(f"--kv-store-disk-gb takes DIR:GB (a directory and its gigabytes), got {text!r}")
    return directory, value


def disk_tier(text: str, block_bytes: int) -> DiskBlockFiles:
    """The block files of `--kv-store-disk-gb DIR:GB` (a file per block: its bytes and a header)."""
    directory, disk_gb = parse_disk(text)
    return DiskBlockFiles(directory, capacity_blocks(disk_gb, block_bytes + 64))


def shm_capped_gb(wanted_bytes: int, block_bytes: int, shm_directory: str = SHM_DIRECTORY) -> float:
    """`wanted_bytes` of store DRAM in GB, at most half of what `shm_directory` has free (a node's DRAM is a file
    there, filled as blocks come); 0 when that holds no block, or without the directory."""
    try:
        free = shutil.disk_usage(shm_directory).free
    except OSError:
        return 0.0
    gb = round(min(wanted_bytes, free // 2) / 1e9, 3)
    return gb if capacity_blocks(gb, block_bytes) >= 1 else 0.0


def dram_gb(text: str, auto_bytes: int, block_bytes: int, shm_directory: str = SHM_DIRECTORY) -> float:
    """`--kv-store-gb`: a number of GB, or `auto` (`--kv-store-auto-bytes` within half of this host's free
    /dev/shm, what `kvbaton serve --ray` gives each other node by the workers it placed there)."""
    if text != "auto":
        try:
            return float(text)
        except ValueError:
            raise KvbatonError(f"--kv-store-gb takes GB or auto, got {text!r}") from None
    if auto_bytes <= 0:
        raise KvbatonError("--kv-store-gb auto needs --kv-store-auto-bytes (the DRAM its workers want)")
    gb = shm_capped_gb(auto_bytes, block_bytes, shm_directory)
    if not gb:
        raise KvbatonError(f"--kv-store-gb auto: {shm_directory} has no room for a block here")
    return gb


READY = "store node ready "  # the node's first line on stdout, its address after it


def start_process(args: Sequence[str], secret: ClusterSecret, host: str, timeout_s: float = 60.0
                  ) -> tuple[subprocess.Popen[str], str]:
    """Start a store node as its own process (`python -m kvbaton.server.store_server ARGS --host HOST`, the secret in
    its environment, never on its command line) and wait until it listens; (the process, its address). A node that
    does not say so within `timeout_s` is stopped and refused (KvbatonError)."""
    process = subprocess.Popen([sys.executable, "-m", "kvbaton.server.store_server", *args, "--host", host,
                                "--parent-pid", str(os.getpid())],
                               stdout=subprocess.PIPE, text=True, start_new_session=True,
                               env=worker_environment(secret, dict(os.environ)))
    ready, _, _ = select.select([process.stdout], [], [], timeout_s)
    line = process.stdout.readline() if ready else ""  # type: ignore[union-attr]
    if not line.startswith(READY):
        stop_process(process)
        raise KvbatonError(f"the KV store node did not start: {line.strip() or f'no answer in {timeout_s:g} s'}")
    return process, line.split()[-1]


def stop_process(process: subprocess.Popen[str]) -> None:
    """Stop a node `start_process` started (SIGTERM, then SIGKILL after 10 s) and remove its DRAM slots' file, which
    a node killed before it could unlink it leaves (named by the node's pid)."""
    if process.poll() is None:
        process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=5)
    if process.stdout is not None:
        process.stdout.close()
    for path in Path(SHM_DIRECTORY).glob(f"{SHM_PREFIX}-{process.pid}-*"):
        path.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbaton.server.store_server", description=__doc__.split("\n")[0])
    parser.add_argument("--block-bytes", type=int, required=True)
    parser.add_argument("--block-tokens", type=int, required=True)
    parser.add_argument("--block-rows", type=int, default=1, help="rows of a block (layers x 2): the slots' layout")
    parser.add_argument("--kv-store-gb", required=True, help="GB of DRAM, or auto (with --kv-store-auto-bytes)")
    parser.add_argument("--kv-store-auto-bytes", type=int, default=0,
                        help="with --kv-store-gb auto: the DRAM wanted, capped at half of /dev/shm's free space")
    parser.add_argument("--kv-store-disk-gb", default="", help="DIR:GB")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--lease-s", type=float, default=30.0)
    parser.add_argument("--parent-pid", type=int, default=0, help="stop when this process (the starter) is gone")
    args = parser.parse_args(argv)
    secret_hex = os.environ.get(SECRET_ENV)
    if not secret_hex:
        print(f"the store node needs the cluster secret in {SECRET_ENV}", file=sys.stderr)
        return 2
    try:
        gb = dram_gb(args.kv_store_gb, args.kv_store_auto_bytes, args.block_bytes)
    except KvbatonError as exc:
        print(f"kvbaton store node: {exc}", file=sys.stderr)
        return 2
    disk = disk_tier(args.kv_store_disk_gb, args.block_bytes) if args.kv_store_disk_gb else None
    state = StoreNodeState(args.block_bytes, args.block_tokens, capacity_blocks(gb, args.block_bytes),
                           disk, args.lease_s, block_rows=args.block_rows)
    server = StoreServer(state, ClusterSecret.from_hex(secret_hex), args.host, args.port)
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    print(f"{READY}{server.address}", flush=True)
    server.serve(parent_pid=args.parent_pid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
