"""The cluster manager's side of worker membership: messages from workers, registration, failure detection, removal.

`WorkerMembership` is a base class of `ClusterManager` (kvbaton.server.cluster), not a separate object:
`_handle` runs once per message from a worker (token deltas, heartbeats, KV events, snapshots,
handoff endings, goodbyes), so it reads the manager's state directly with no extra hop. It keeps the
pool honest: a worker joins only with the cluster's identity, its KV events keep the router's index
current (a seq gap asks for a snapshot), and a worker that exits, goes silent or says goodbye leaves
the pool (and the policy's index and load state) at most once, failing or handing over its calls.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from kvbaton.cache.events import KVEvent, KVEventKind
from kvbaton.router.load import WorkerStats
from kvbaton.router.placement import ClusterPlacement
from kvbaton.server import rpc
from kvbaton.server.base import TokenDelta
from kvbaton.server.cluster_registry import CallRecord, ProcessHandle, WorkerRecord, identity_of, registration_refusal
from kvbaton.server.identity import ClusterIdentity
from kvbaton.server.router_socket import RouterSocket

if TYPE_CHECKING:  # for annotations only: cluster.py imports this module
    from kvbaton.server.cluster import ClusterConfig

log = logging.getLogger("kvbaton.cluster")

EXIT_GRACE_S = 0.05  # how long a lost connection waits for its watched process's exit code (blocking the loop)
# A worker busy since a call routed to it ended before its first token has its prefix-index entries resynced from a
# snapshot this long after, at the latest (an idle one at its next heartbeat); see WorkerRecord.index_dirty_at.
INDEX_RESYNC_S = 5.0
_STALL_GRACE_S = 1.0  # a gap between worker checks longer than this (plus the check interval) is a router stall


class WorkerMembership:
    """Worker messages and liveness for `ClusterManager`, which sets every attribute below in its `__init__`."""

    config: ClusterConfig
    clock: Callable[[], float]
    placement: ClusterPlacement
    queue_policy: str
    identity: ClusterIdentity | None
    workers: dict[str, WorkerRecord]
    lost_workers: dict[str, str]
    _calls: dict[str, CallRecord]
    _processes: dict[str, ProcessHandle]
    _exits_pending: set[str]
    num_failed_by_worker_loss: int
    num_snapshots_requested: int
    num_handoff_fallbacks: int
    handoff_endings: dict[str, int]
    retired_spec_decode_tokens: list[int]
    _socket: RouterSocket | None
    _last_check_at: float
    # The call side, defined by ClusterManager: a token delta's accounting, and a call's end.
    _on_delta: Callable[[TokenDelta], None]
    _end_call: Callable[[CallRecord], None]

    # -- messages -------------------------------------------------------------------------------

    def _send(self, worker_id: str, message: rpc.Message) -> None:
        error = self._socket.send(worker_id, message) if self._socket is not None else None
        if error is not None:  # EHOSTUNREACH: the worker's connection is gone
            if worker_id in self.workers:
                # A dying process closes its sockets a moment before it can be reaped: give a watched one that
                # moment, so the reason (and its calls' errors) name the exit, not just the lost connection.
                reason = self._exit_reason(worker_id, grace_s=EXIT_GRACE_S)
                self._remove_worker(worker_id, reason or f"unreachable ({error.strerror})")

    def _handle(self, sender: str, message: rpc.Message) -> None:
        if isinstance(message, rpc.Register):
            self._on_register(sender, message)
            return
        if isinstance(message, rpc.Alive):  # from the worker's liveness thread, on its second socket
            record = self.workers.get(message.worker_id)
            if record is not None and sender == rpc.alive_identity(message.worker_id):
                record.last_heard_at = self.clock()
            return
        record = self.workers.get(sender)
        if record is None:
            return  # a worker we already dropped (or never accepted): ignore until it registers again
        record.last_heard_at = self.clock()
        if isinstance(message, rpc.TokenDeltas):
            for delta in message.deltas:
                self._on_delta(delta)
        elif isinstance(message, rpc.Stats):
            if record.stats is None:  # its first heartbeat: it serves from now on
                register = record.register
                self.placement.add_worker(sender, register.role, register.kv_address.partition("://")[0])
            record.stats = message
            # The pool's used blocks include the prefix cache's; what the cache alone holds is evictable, so
            # used - cached approximates the running requests' KV (low when they lock cached blocks).
            self.placement.on_stats(WorkerStats(
                sender, message.num_queued_prefill_tokens, max(message.num_used_blocks - message.num_cached_blocks, 0),
                message.num_free_blocks, message.num_running, message.num_waiting, message.num_cached_blocks,
                self.config.block_size), record.last_heard_at)
            dirty_at = record.index_dirty_at
            if dirty_at is not None and (not record.in_flight or record.last_heard_at - dirty_at > INDEX_RESYNC_S):
                record.index_dirty_at = None
                if not record.snapshot_pending:
                    self._request_snapshot(record, "a call ended before its first token")
        elif isinstance(message, rpc.KVEvents):
            if record.snapshot_pending:
                return  # the snapshot on its way covers these
            if not self.placement.on_kv_events(sender, (KVEvent.from_wire(e) for e in message.events)):
                self._request_snapshot(record, "kv event seq gap")
        elif isinstance(message, rpc.SnapshotResponse):
            record.snapshot_pending = False
            # A leading CLEARED at the snapshot's seq makes the index resume from there even when the cache is empty.
            events = [KVEvent(message.seq, KVEventKind.CLEARED, ()), *(KVEvent.from_wire(e) for e in message.events)]
            self.placement.apply_snapshot(sender, events)
        elif isinstance(message, rpc.HandoffEnded):
            self._on_handoff_ended(message)
        elif isinstance(message, rpc.Goodbye):
            self._remove_worker(sender, f"left: {message.reason}")

    def _on_handoff_ended(self, message: rpc.HandoffEnded) -> None:
        """A prefill leg ended without the KV: the decode worker falls back (it may already know, harmlessly)."""
        self.handoff_endings[message.outcome] = self.handoff_endings.get(message.outcome, 0) + 1
        entry = self._calls.get(message.request_id)
        if entry is None or entry.finished or entry.prefill_worker != message.worker_id or entry.num_tokens_seen:
            return  # a first token came: the decode worker adopted the KV (its ack was late) or recomputed
        self.num_handoff_fallbacks += 1
        self._send(entry.worker_id, rpc.HandoffFailed(message.request_id, message.reason,
                                                      refused=message.outcome == "refused"))

    def _on_register(self, sender: str, message: rpc.Register) -> None:
        if sender != message.worker_id:
            log.warning("register from socket %r claims id %r; refused", sender, message.worker_id)
            self._send_raw(sender, rpc.RegisterRefuse(message.worker_id, "worker id differs from socket identity"))
            return
        offered = identity_of(message)
        reason = registration_refusal(message, self.config.model_name, self.identity or replace(
            offered, block_size=self.config.block_size,
            tokenizer_probe_hash=self.config.tokenizer_probe_hash or offered.tokenizer_probe_hash))
        if reason:
            log.warning("refused worker %s: %s", sender, reason)
            self._send_raw(sender, rpc.RegisterRefuse(sender, reason))
            return
        if sender in self.workers:
            self._remove_worker(sender, "re-registered (restarted)")
        process = self._processes.get(sender)
        if process is not None and process.poll() is not None:
            del self._processes[sender]  # it exited: the worker registering now is another process with its id
        self.lost_workers.pop(sender, None)
        if self.identity is None:
            self.identity = offered
        self.workers[sender] = WorkerRecord(message, self.clock())
        self._send(sender, rpc.RegisterAck(sender, self.queue_policy, self.config.heartbeat_interval_s))
        log.info("worker %s registered (pid %d, %s)", sender, message.pid, message.kv_layout)

    def _send_raw(self, identity: str, message: rpc.Message) -> None:
        """Send to a peer that is not (or no longer) a pool member; errors are ignored."""
        if self._socket is not None:
            self._socket.send(identity, message)

    def _request_snapshot(self, record: WorkerRecord, reason: str) -> None:
        record.snapshot_pending = True
        self.num_snapshots_requested += 1
        self._send(record.register.worker_id, rpc.SnapshotRequest(reason))

    # -- failure detection ----------------------------------------------------------------------

    def watch_process(self, worker_id: str, process: ProcessHandle) -> None:
        """Let the monitor notice at once when this worker's process exits."""
        self._processes[worker_id] = process

    async def _monitor_loop(self) -> None:
        while True:
            await asyncio.sleep(min(self.config.ping_interval_s, 0.1))
            try:
                self.check_workers()
            except Exception:  # keep detecting dead workers whatever went wrong once
                log.exception("worker check failed")

    def check_workers(self) -> None:
        """Drop workers whose process exited or that went silent; ping the rest."""
        now = self.clock()
        stalled_s = now - self._last_check_at - _STALL_GRACE_S
        self._last_check_at = now
        if stalled_s > 0:
            # This loop itself was starved (a blocked event loop, a suspended process): whatever the workers
            # sent meanwhile is still unread in the socket, so the stall must not count as their silence.
            for record in self.workers.values():
                record.last_heard_at += stalled_s
        self._note_late_exits()
        for worker_id in sorted(self.workers):
            record = self.workers.get(worker_id)
            if record is None:
                continue  # removed with another worker this sweep (its call's other leg was unreachable too)
            exit_reason = self._exit_reason(worker_id)
            if exit_reason:
                self._remove_worker(worker_id, exit_reason)
            elif now - record.last_heard_at > self.config.worker_timeout_s:
                self._remove_worker(worker_id, f"no heartbeat for {now - record.last_heard_at:.1f} s")
            elif now - record.last_pinged_at >= self.config.ping_interval_s:
                record.last_pinged_at = now
                self._send(worker_id, rpc.Ping(now))

    def _exit_reason(self, worker_id: str, grace_s: float = 0.0) -> str:
        """Why a watched worker process is gone ("" while it runs, for up to `grace_s`, or when it is not
        watched)."""
        process = self._processes.get(worker_id)
        code = process.poll() if process is not None else None
        deadline = time.monotonic() + grace_s
        while process is not None and code is None and time.monotonic() < deadline:
            time.sleep(0.002)
            code = process.poll()
        if code is None:
            return ""
        record = self.workers.get(worker_id)
        if record is None:
            return f"process ? exited with code {code}"
        host = f" on {record.register.host}" if record.register.host else ""
        return f"process {record.register.pid}{host} exited with code {code}"

    def _note_late_exits(self) -> None:
        """Add the exit code to why a worker was lost once its process reports it: a worker is often dropped
        as unreachable first (its connection went with it), and a Ray actor reports its worker's exit a moment
        after that."""
        for worker_id in sorted(self._exits_pending):
            process = self._processes.get(worker_id)
            code = process.poll() if process is not None else None
            if worker_id in self.workers or process is None:  # registered again, or no longer watched
                self._exits_pending.discard(worker_id)
            elif code is not None:
                self._exits_pending.discard(worker_id)
                self.lost_workers[worker_id] += f"; its process exited with code {code}"

    def _remove_worker(self, worker_id: str, reason: str) -> None:
        record = self.workers.pop(worker_id, None)
        if record is None:
            return
        process = self._processes.get(worker_id)
        if process is not None and process.poll() is None:
            self._exits_pending.add(worker_id)
        log.log(logging.INFO if reason.startswith("left:") else logging.WARNING, "worker %s removed: %s", worker_id,
                reason)
        self.lost_workers[worker_id] = reason
        if record.stats is not None:
            self.retired_spec_decode_tokens[0] += record.stats.num_draft_tokens
            self.retired_spec_decode_tokens[1] += record.stats.num_accepted_tokens
        for request_id in sorted(record.in_flight):
            entry = self._calls.get(request_id)
            if entry is None or entry.finished:
                continue
            if entry.prefill_worker == worker_id:  # the decode worker answers: it recomputes or fails cleanly
                if entry.num_tokens_seen:
                    continue  # a first token came: the decode worker adopted the KV or recomputed, it needs nothing
                self.num_handoff_fallbacks += 1
                self._send(entry.worker_id, rpc.HandoffFailed(request_id, f"prefill worker lost ({reason})", False))
                continue
            if entry.prefill_worker:
                self._send(entry.prefill_worker, rpc.Abort((request_id,)))
            self.num_failed_by_worker_loss += 1
            self._end_call(entry)
            entry.sink(TokenDelta(
                request_id, (), "", True, "error", len(entry.call.prompt_token_ids),
                error=f"worker {worker_id} was lost while running this request ({reason})", worker_id=worker_id))
        self.placement.remove_worker(worker_id)
