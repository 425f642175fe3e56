"""The router's worker pool: who is in it, the messages its workers send, registration, failure detection, removal.

`WorkerPool` is an object `ClusterManager` (kvbaton.server.cluster) owns: `handle` runs once per message from a
worker (token deltas, heartbeats, KV events, snapshots, handoff endings, goodbyes). It keeps the pool honest: a
worker joins only with the cluster's identity, its KV events keep the router's index current (a seq gap asks for a
snapshot), and a worker that exits, goes silent or says goodbye leaves the pool at most once. What concerns calls
(their deltas, a handoff that ended without the KV, the calls of a worker that left) it hands to the manager's
call side through the three callbacks it is built with.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from kvbaton.cache.events import KVEvent, KVEventKind
from kvbaton.cache.store_prices import MeasuredStorePrices
from kvbaton.router.load import WorkerStats
from kvbaton.router.placement import ClusterPlacement
from kvbaton.server import rpc
from kvbaton.server.base import TokenDelta
from kvbaton.server.cluster_registry import ProcessHandle, WorkerRecord, identity_of, registration_refusal
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


class WorkerPool:
    """The live workers, why the others left and the processes watched; registration, liveness and removal."""

    def __init__(self, config: ClusterConfig, clock: Callable[[], float], placement: ClusterPlacement,
                 queue_policy: str, on_delta: Callable[[TokenDelta], None],
                 on_handoff_ended: Callable[[rpc.HandoffEnded], None],
                 on_removed: Callable[[str, WorkerRecord, str], None]) -> None:
        self.config = config
        self.clock = clock
        self.placement = placement
        self.queue_policy = queue_policy
        self._on_delta = on_delta  # a token delta from a worker: the call side's accounting
        self._on_handoff_ended = on_handoff_ended  # a prefill leg ended without the KV
        self._on_removed = on_removed  # (worker id, its record, why): the call side fails or hands over its calls
        self.identity: ClusterIdentity | None = None  # fixed by the first accepted worker
        self.workers: dict[str, WorkerRecord] = {}  # live workers
        self.lost_workers: dict[str, str] = {}  # worker id -> why it left
        self._processes: dict[str, ProcessHandle] = {}
        self._exits_pending: set[str] = set()  # dropped while their process still ran: its exit code comes later
        self.num_snapshots_requested = 0
        self.retired_spec_decode_tokens = [0, 0]  # (draft, accepted) of workers that left: keeps totals monotone
        self.socket: RouterSocket | None = None  # set by the manager's start, cleared by its shutdown
        # The other routers of this cluster that this one knows (those that joined through it, the one it joined, and
        # those the others told it of): every worker that registers here is told to register with them too.
        self.peer_routers: list[str] = list(config.peer_routers)
        self._asked_again: dict[str, float] = {}  # unknown senders told to register again, and when
        # Per peer router: when it was last reached (a probe or gossip got through, or it told this router of itself;
        # from when it became a peer until then), and when it was last probed (`check_peers`).
        self._peer_heard_at: dict[str, float] = {}
        self._peer_probed_at: dict[str, float] = {}
        self.own_address = ""  # this router's RPC address (set by the manager's start): never a peer of its own
        # Sends AddRouter(each of the addresses) to the router at the first address, off the event loop (set by the
        # manager's start); None: this router tells no other router of new ones.
        self.tell_router: Callable[[str, tuple[str, ...]], None] | None = None
        self._last_check_at = clock()
        # With a KV store: the link speeds measured from the workers' load counters, which price the placement's
        # store loads (`RouterState.store_prices`) from the first measurement on (set by the manager).
        self.store_speeds: MeasuredStorePrices | None = None
        # A store node a registering worker names (its host's): the manager reads its events from then on.
        self.on_store_node: Callable[[str], None] = lambda address: None
        self.store_nodes: dict[str, None] = {}  # every store node read, in the order first named (`add_store_node`)

    @property
    def num_serving(self) -> int:
        """Registered workers whose engine loop runs (they have sent a heartbeat)."""
        return sum(1 for record in self.workers.values() if record.stats is not None)

    def live_stats(self) -> dict[str, rpc.Stats]:
        """The latest heartbeat of every serving worker, by worker id."""
        return {w: r.stats for w, r in sorted(self.workers.items()) if r.stats is not None}

    # -- messages -------------------------------------------------------------------------------

    def send(self, worker_id: str, message: rpc.Message) -> None:
        """Send to a pool member; an unreachable one is removed (with the exit code when its process just died)."""
        error = self.socket.send(worker_id, message) if self.socket is not None else None
        if error is not None:  # EHOSTUNREACH: the worker's connection is gone
            if worker_id in self.workers:
                # A dying process closes its sockets a moment before it can be reaped: give a watched one that
                # moment, so the reason (and its calls' errors) name the exit, not just the lost connection.
                reason = self._exit_reason(worker_id, grace_s=EXIT_GRACE_S)
                self.remove(worker_id, reason or f"unreachable ({error.strerror})")

    def handle(self, sender: str, message: rpc.Message) -> None:
        """One message from a worker (the socket's reader callback)."""
        if isinstance(message, rpc.Register):
            self._on_register(sender, message)
            return
        if isinstance(message, rpc.AddRouter):  # a router joining the cluster (`kvbaton router --join`)
            self._on_router_joined(message.address)
            return
        if isinstance(message, rpc.Alive):  # from the worker's liveness thread, on its second socket
            record = self.workers.get(message.worker_id)
            if record is not None and sender == rpc.alive_identity(message.worker_id):
                record.last_heard_at = self.clock()
            return
        record = self.workers.get(sender)
        if record is None:
            # A worker this router does not know (it restarted at its address, or dropped the worker) that still
            # reports to it: ask it to register again, at most once a second (a refused one never gets this far:
            # its link is closed).
            now = self.clock()
            if (isinstance(message, (rpc.Heartbeat, rpc.Stats, rpc.KVEvents, rpc.TokenDeltas))
                    and now - self._asked_again.get(sender, float("-inf")) >= 1.0):
                self._asked_again[sender] = now
                self._send_raw(sender, rpc.RegisterAgain(sender))
            return
        record.last_heard_at = self.clock()
        if isinstance(message, rpc.TokenDeltas):
            for delta in message.deltas:
                self._on_delta(delta)
        elif isinstance(message, rpc.Heartbeat):
            self._on_kv_events(sender, record, message.events)
            self._on_stats(sender, record, message.stats)
        elif isinstance(message, rpc.Stats):
            self._on_stats(sender, record, message)
        elif isinstance(message, rpc.KVEvents):
            self._on_kv_events(sender, record, message)
        elif isinstance(message, rpc.SnapshotResponse):
            record.snapshot_pending = False
            # A leading CLEARED at the snapshot's seq makes the index resume from there even when the cache is empty.
            events = [KVEvent(message.seq, KVEventKind.CLEARED, ()), *(KVEvent.from_wire(e) for e in message.events)]
            self.placement.apply_snapshot(sender, events)
        elif isinstance(message, rpc.HandoffEnded):
            self._on_handoff_ended(message)
        elif isinstance(message, rpc.Goodbye):
            self.remove(sender, f"left: {message.reason}")

    def _on_stats(self, sender: str, record: WorkerRecord, message: rpc.Stats) -> None:
        if record.stats is None:  # its first heartbeat: it serves from now on
            register = record.register
            self.placement.add_worker(sender, register.role, register.kv_address.partition("://")[0])
        record.stats = message
        speeds = self.store_speeds
        if speeds is not None and message.store_transport and speeds.observe(
                message.store_transport, sender, message.store_load_bytes, message.store_load_s, record.last_heard_at,
                message.store_load_count, message.store_load_round_trip_s):
            self.placement.state.store_prices = speeds.prices()
        self.placement.on_stats(WorkerStats(
            sender, message.num_queued_prefill_tokens, message.num_used_blocks, message.num_free_blocks,
            message.num_running, message.num_waiting, message.num_cached_blocks, self.config.block_size),
            record.last_heard_at)
        dirty_at = record.index_dirty_at
        if dirty_at is not None and (not record.in_flight or record.last_heard_at - dirty_at > INDEX_RESYNC_S):
            record.index_dirty_at = None
            if not record.snapshot_pending:
                self._request_snapshot(record, "a call ended before its first token")

    def _on_kv_events(self, sender: str, record: WorkerRecord, message: rpc.KVEvents) -> None:
        if record.snapshot_pending:
            return  # the snapshot on its way covers these
        if not self.placement.on_kv_events(sender, (KVEvent.from_wire(e) for e in message.events)):
            self._request_snapshot(record, "kv event seq gap")

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
            self.remove(sender, "re-registered (restarted)")
        process = self._processes.get(sender)
        if process is not None and process.poll() is not None:
            del self._processes[sender]  # it exited: the worker registering now is another process with its id
        self.lost_workers.pop(sender, None)
        if self.identity is None:
            self.identity = offered
        self.workers[sender] = WorkerRecord(message, self.clock())
        if message.store_node and self.placement.state.store is not None:
            self.placement.state.store_node_of[sender] = message.store_node
            self.add_store_node(message.store_node, but=sender)
        self.send(sender, rpc.RegisterAck(sender, self.queue_policy, self.config.heartbeat_interval_s))
        if self.store_nodes:
            self.send(sender, rpc.StoreNodesKnown(",".join(self.store_nodes)))
        for address in self.peer_routers:
            self.send(sender, rpc.AddRouter(address))
        log.info("worker %s registered (pid %d, %s)", sender, message.pid, message.kv_layout)

    def add_store_node(self, address: str, but: str = "") -> None:
        """A store node the router reads from now on (its own host's, or one a registering worker names): read its
        events (`on_store_node`) and tell every worker (but `but`, told after its acknowledgement) the nodes there
        are, so that their loads reach it too."""
        if address in self.store_nodes:
            return
        self.store_nodes[address] = None
        self.on_store_node(address)
        message = rpc.StoreNodesKnown(",".join(self.store_nodes))
        for worker_id in self.workers:
            if worker_id != but:
                self.send(worker_id, message)

    def _on_router_joined(self, address: str) -> None:
        """Another router serves this cluster from now on: every worker registers with it too (a worker that knows
        it already ignores the news). Only a holder of the cluster secret gets this far.

        The routers gossip: the news goes on to every other router this one knows, and the new router is told of
        them and of this one. Each router passes an address on only the first time it hears of it, so the news
        stops once every router knows every other, and a worker registered with any of them hears of every one
        (not only of those that joined through its own router)."""
        if not address or address == self.own_address:
            return
        if address in self.peer_routers:  # a peer's probe (or news already heard): it is alive
            self._peer_heard_at[address] = self.clock()
            return
        others = tuple(self.peer_routers)
        self.peer_routers.append(address)
        self._peer_heard_at[address] = self.clock()
        log.info("router %s joined the cluster; telling %d worker(s) and %d router(s)", address, len(self.workers),
                 len(others))
        for worker_id in sorted(self.workers):
            self.send(worker_id, rpc.AddRouter(address))
        if self.tell_router is not None:
            for peer in others:
                self.tell_router(peer, (address,))
            self.tell_router(address, tuple(a for a in (self.own_address, *others) if a))

    def check_peers(self) -> None:
        """Probe each peer router every `peer_probe_interval_s` (AddRouter of this router's own address: a peer
        that knows it ignores it, one restarted at its address learns of this router again), and drop a peer no
        probe has reached for `peer_router_timeout_s`: gossip stops going to it. It is a peer again as soon as it
        tells this router of itself (its own probe, `kvbaton router --join`) or another router gossips it."""
        if self.tell_router is None or not self.own_address:
            return
        now = self.clock()
        for peer in list(self.peer_routers):
            heard_at = self._peer_heard_at.setdefault(peer, now)
            if now - heard_at > self.config.peer_router_timeout_s:
                self.peer_routers.remove(peer)
                self._peer_heard_at.pop(peer, None)
                self._peer_probed_at.pop(peer, None)
                log.warning("router %s dropped from the peers: not reached for %.1f s", peer, now - heard_at)
            elif now - self._peer_probed_at.get(peer, float("-inf")) >= self.config.peer_probe_interval_s:
                self._peer_probed_at[peer] = now
                self.tell_router(peer, (self.own_address,))

    def on_peer_told(self, peer: str, reached: bool) -> None:
        """How a send to a peer router ended (`tell_router`'s outcome, on the loop)."""
        if reached and peer in self.peer_routers:
            self._peer_heard_at[peer] = self.clock()

    def _send_raw(self, identity: str, message: rpc.Message) -> None:
        """Send to a peer that is not (or no longer) a pool member; errors are ignored."""
        if self.socket is not None:
            self.socket.send(identity, message)

    def _request_snapshot(self, record: WorkerRecord, reason: str) -> None:
        record.snapshot_pending = True
        self.num_snapshots_requested += 1
        self.send(record.register.worker_id, rpc.SnapshotRequest(reason))

    # -- failure detection ----------------------------------------------------------------------

    def watch_process(self, worker_id: str, process: ProcessHandle) -> None:
        """Let the monitor notice at once when this worker's process exits."""
        self._processes[worker_id] = process

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
                self.remove(worker_id, exit_reason)
            elif now - record.last_heard_at > self.config.worker_timeout_s:
                self.remove(worker_id, f"no heartbeat for {now - record.last_heard_at:.1f} s")
            elif now - record.last_pinged_at >= self.config.ping_interval_s:
                record.last_pinged_at = now
                self.send(worker_id, rpc.Ping(now))

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

    def remove(self, worker_id: str, reason: str) -> None:
        """Take a worker out of the pool (at most once): remember why, take it out of the placement, then let the
        call side end or move its calls (a migration places them again, never on this worker)."""
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
        self.placement.remove_worker(worker_id)
        self.placement.state.store_node_of.pop(worker_id, None)
        if self.store_speeds is not None:
            self.store_speeds.forget(worker_id)  # one that registers again counts its loads from 0
        self._on_removed(worker_id, record, reason)
