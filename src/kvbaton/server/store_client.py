"""A worker's (or router's) connection to its host's KV store node (`kvbaton.server.store_server`): the engine's `StoreLink`.

One zmq DEALER under CurveZMQ (the store channel's key pairs, from the cluster secret), used by one thread
only (the worker's store IO thread, `kvbaton.engine.store_io`). Saves and releases are sent without waiting
and dropped, never queued without bound, when the socket's send queue is full (`put` says so); `acquire`
waits at most `timeout_s` for its answer and raises `StoreUnavailable` otherwise. After a failure the node is
taken as down for `retry_after_s`: every call in that window fails at once, so a dead store node costs each
request at most one timeout and then nothing (they recompute).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence

import msgpack
import zmq

from kvbaton.cache.kv_store import StoreEvent
from kvbaton.core.cluster_secret import ClusterSecret
from kvbaton.engine.store_io import StoreUnavailable
from kvbaton.server.rpc_auth import secure_dealer
from kvbaton.server.store_server import STORE_CHANNEL


class StoreClient:
    def __init__(self, address: str, secret: ClusterSecret, timeout_s: float = 10.0, retry_after_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, max_queued_messages: int = 256) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self._clock = clock
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, max_queued_messages)
        secure_dealer(self._socket, secret, STORE_CHANNEL)
        self._socket.connect(address)
        self._ids = itertools.count(1)
        self._down_until = 0.0

    def hello(self) -> tuple[str, int, int, int]:
        reply = self._call({"op": "hello"})
        return reply["shm_path"], int(reply["block_bytes"]), int(reply["num_slots"]), int(reply["num_rows"])

    def put(self, namespace: Sequence[str], parent_hash: int, block_hashes: Sequence[int],
            payloads: Sequence[memoryview]) -> bool:
        header = {"op": "put", "namespace": list(namespace), "parent": parent_hash, "hashes": list(block_hashes)}
        return self._send([msgpack.packb(header), *payloads])

    def acquire(self, namespace: Sequence[str], block_hashes: Sequence[int]) -> tuple[int, list[int], str]:
        reply = self._call({"op": "acquire", "namespace": list(namespace), "hashes": list(block_hashes)})
        return int(reply["lease"]), [int(slot) for slot in reply["slots"]], str(reply["shm_path"])

    def release(self, lease: int) -> bool:
        return self._send([msgpack.packb({"op": "release", "lease": lease})])

    def stats(self) -> dict:
        return self._call({"op": "stats"})

    def events_since(self, seq: int) -> dict:
        return self._call({"op": "events", "since": seq})

    def close(self) -> None:
        self._socket.close()
        self._context.term()

    def _send(self, frames: list) -> bool:
        if self._clock() < self._down_until:
            return False
        try:
            self._socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    def _call(self, header: dict) -> dict:
        now = self._clock()
        if now < self._down_until:
            raise StoreUnavailable(f"store node {self.address} is down (retrying in {self._down_until - now:.1f} s)")
        call_id = header["id"] = next(self._ids)
        deadline = now + self.timeout_s
        if not self._send([msgpack.packb(header)]):
            self._down_until = self._clock() + self.retry_after_s
            raise StoreUnavailable(f"store node {self.address} takes no messages")
        while True:
            left_ms = int((deadline - self._clock()) * 1000)
            if left_ms <= 0 or not self._socket.poll(left_ms):
                self._down_until = self._clock() + self.retry_after_s
                raise StoreUnavailable(f"store node {self.address} did not answer within {self.timeout_s} s")
            reply = msgpack.unpackb(self._socket.recv(), raw=False)
            if isinstance(reply, dict) and reply.get("id") != call_id:  # a late answer to a call given up
                if reply.get("lease"):
                    self.release(int(reply["lease"]))  # nobody copies what it pinned: let it go now
                continue
            if isinstance(reply, dict):
                if "error" in reply:
                    raise StoreUnavailable(f"store node {self.address}: {reply['error']}")
                self._down_until = 0.0
                return reply


class StoreEventFeed:
    """A router's reader of one store node's events, on a thread of its own (its calls may wait on a dead node):
    every `interval_s` it asks for what came after the last seq it had, and hands the events (or a snapshot, when
    the node's log no longer reaches back) to `deliver(events, is_snapshot)`, which the caller runs on its own
    thread (the router's event loop: `loop.call_soon_threadsafe`). Any number of routers may each run one."""

    def __init__(self, address: str, secret: ClusterSecret,
                 deliver: Callable[[list[StoreEvent], bool], None], interval_s: float = 0.05) -> None:
        self._address, self._secret, self._deliver, self._interval_s = address, secret, deliver, interval_s
        self._stop = threading.Event()
        self._seq = 0
        self.num_polls = 0
        self._thread = threading.Thread(target=self._run, name="kv-store-events", daemon=True)

    def start(self) -> StoreEventFeed:
        self._thread.start()
        return self

    def resync(self) -> None:
        """The reader found a gap: ask from the start (the node answers with its log or a snapshot)."""
        self._seq = 0

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        client = StoreClient(self._address, self._secret, timeout_s=1.0, retry_after_s=1.0)
        try:
            while not self._stop.wait(self._interval_s):
                try:
                    reply = client.events_since(self._seq)
                except StoreUnavailable:
                    continue
                self.num_polls += 1
                events = [StoreEvent(int(seq), kind, tuple(hashes), tier) for seq, kind, hashes, tier in reply["events"]]
                if events:
                    self._seq = max(event.seq for event in events)
                    self._deliver(events, bool(reply["snapshot"]))
        finally:
            client.close()
