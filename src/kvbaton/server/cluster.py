"""The router process's view of its workers: a `ClusterClient` over zmq that places, streams and fails calls.

It owns one RouterSocket (workers connect DEALERs), whose reader callback hands it every message
(registration, token deltas, heartbeats, KV events, snapshots), and one asyncio task, the monitor
(pings, dead-worker detection). A call's deltas go to the sink it was submitted with (`submit`), called
on the event loop as they arrive; `generate` is the queue-backed stream over that. Invariants:
- every call handed to `generate` ends with exactly one finished delta, also when its worker dies
  (an "error" delta naming the worker) or the client goes away (the worker is told to abort);
- a call is in `_calls` and in its worker's `in_flight` from routing until its finished delta;
- the placement (`kvbaton.router.placement.ClusterPlacement`, the object the simulator places with too)
  places each call once, hears its tokens, and hears `on_finished` once when it ends;
- a worker joins the placement at its first heartbeat and leaves it (and the index and load state) at most once.

Disaggregated pools (workers registered as `prefill` / `decode`): the placement picks (p, d) and the
call goes to both — d answers for it (it streams every delta), p only reports a handoff leg that
ended without the KV, which is relayed to d to recompute or fail. A call is in the in-flight set of
both workers; losing p hands the call to d's fallback.

Migration: a call whose worker (its decode worker, for a pair) is lost moves to another one, placed whole, with
the tokens it already streamed (`rpc.AddRequest.output_token_ids`): that worker recomputes prompt + output and
goes on, so the stream loses and repeats no token. A call moves at most `migration_limit` times; past that (or
with the limit 0) it fails with an error naming the worker and the limit.

This module holds the call side (sending each call where it is placed, its deltas and end, the calls of a
worker that left) and the reads for /ready, /cluster and /metrics. The workers themselves (their messages,
registration, failure detection) are a `WorkerPool` (cluster_workers.py) the manager owns and hears from
through three callbacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

import zmq

from kvbaton.cache.hashing import CacheKey
from kvbaton.cache.kv_store import StoreEvent
from kvbaton.cache.store_prices import MeasuredStorePrices, StorePrices
from kvbaton.core.cluster_secret import ClusterSecret
from kvbaton.router.admission import AdmissionPolicy
from kvbaton.router.base import RouteRequest
from kvbaton.router.call_tally import CallTally
from kvbaton.router.pairs import DEFAULT_LOCAL_PREFILL_THRESHOLD_TOKENS
from kvbaton.router.placement import ClusterPlacement, Placement, PlacementConfig, Refusal
from kvbaton.router.policies import local_queue_policy
from kvbaton.router.pools import PoolBalancer
from kvbaton.router.state import RouterState
from kvbaton.server import rpc
from kvbaton.server.base import DeltaSink, GenerateCall, RejectedError, TokenDelta
from kvbaton.server.cluster_registry import CallRecord, ProcessHandle, WorkerRecord, transfer_info, worker_info
from kvbaton.server.cluster_workers import WorkerPool
from kvbaton.server.identity import ClusterIdentity
from kvbaton.server.router_socket import RouterSocket
from kvbaton.server.rpc_auth import secure_dealer
from kvbaton.server.store_client import StoreEventFeed

log = logging.getLogger("kvbaton.cluster")


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    bind_address: str = "tcp://127.0.0.1:*"  # "*" port: zmq picks one; see ClusterManager.address
    model_name: str = "smollm2-135m"  # workers must serve this model name
    policy: str = "least_load"  # round_robin | least_load | longest_prefix | preble
    block_size: int = 16
    tokenizer_probe_hash: str = ""  # the router tokenizer's; "" skips the check
    seed: int = 0  # seeds the policy's tie-breaking
    heartbeat_interval_s: float = 0.05  # asked of workers at register_ack
    ping_interval_s: float = 0.5
    # No message from a worker for this long: it is hung. Exits are caught at once (watched process, unreachable
    # socket), so this only needs to beat a slow engine step on an overloaded host.
    worker_timeout_s: float = 30.0
    max_num_waiting: int = 256  # routed calls without a first token, cluster-wide; above: RejectedError
    retry_after_s: float = 1.0
    # Disaggregation: prompts with fewer uncached tokens than this skip the handoff (prefill where they decode).
    local_prefill_threshold_tokens: int = DEFAULT_LOCAL_PREFILL_THRESHOLD_TOKENS
    kv_load_failure_policy: str = "recompute"  # recompute | fail, when a handoff's KV does not arrive
    kv_bytes_per_token: int = 0  # prices transfers in the pair choice (all layers, K and V)
    reserve_ahead_tokens: int | None = None  # the prefill workers' --reserve-ahead-tokens (None: on arrival)
    # The workers' local waiting-queue policy: "" pairs it with `policy` (preble's fairness queue under preble,
    # else fcfs); "fcfs" or "priority" (vLLM's --scheduling-policy: SamplingParams.priority orders the queue
    # and picks who is preempted) replace it.
    scheduling_policy: str = ""
    # Only holders of this secret connect as workers (server/rpc_auth.py); None: a fresh one (`ClusterManager.secret`).
    cluster_secret: ClusterSecret | None = None
    migration_limit: int = 3  # times one call may move to another worker after losing one; 0: it fails instead
    # Other routers of the cluster (zmq RPC addresses) the workers registering here are told about (`join`).
    peer_routers: tuple[str, ...] = ()
    # Each peer router is probed this often (an AddRouter of this router's own address, ignored by a peer that knows
    # it); one no probe reached for `peer_router_timeout_s` is dropped from the peers until it is heard of again.
    peer_probe_interval_s: float = 2.0
    peer_router_timeout_s: float = 10.0
    # This host's KV store node (kvbaton.server.store_server), read for the placement's store directory, and its
    # block bytes. "" = no store. Every other node a registering worker names as its host's is read too; a node's
    # name in the directory is its address.
    kv_store_address: str = ""
    kv_store_block_bytes: int = 0
    # What the router prices a store load at until it has measured the link (`MeasuredStorePrices`: the workers'
    # loads, the node's disk reads): a worker's copy from the node's shared memory (a CPU memcpy's speed; a GPU's
    # host link would be ~50e9), and the node's disk.
    kv_store_host_bytes_per_s: float = 3e9
    kv_store_disk_bytes_per_s: float = 1e9


PEER_SEND_TIMEOUT_S = 1.0  # how long telling another router waits for its connection (then again for the frames)


def send_add_router(router_address: str, addresses: tuple[str, ...], secret: ClusterSecret,
                    timeout_s: float = PEER_SEND_TIMEOUT_S) -> bool:
    """Tell the router at `router_address` that routers serve at `addresses`. True once the frames went out over a
    connection that completed its CurveZMQ handshake; False when none did within `timeout_s` (nothing listens there,
    or not a router holding this cluster's secret): the frames are dropped. Blocks for at most about twice
    `timeout_s` (the connection, then the frames' flush): run it off the loop."""
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    sent = False
    try:
        secure_dealer(socket, secret)
        socket.setsockopt(zmq.IMMEDIATE, 1)  # queue only to a connection whose handshake completed: POLLOUT waits
        socket.setsockopt(zmq.LINGER, int(timeout_s * 1000))  # close waits (this long at most) for the frames to go
        socket.connect(router_address)
        if socket.poll(int(timeout_s * 1000), zmq.POLLOUT):
            for address in addresses:
                socket.send(rpc.encode(rpc.AddRouter(address)), zmq.NOBLOCK)
            sent = True
    except zmq.Again:  # the connection went between the poll and a send
        sent = False
    finally:
        socket.close(linger=None if sent else 0)
        context.term()
    return sent


class ClusterManager:
    """Routes and streams calls over the worker pool; see the module docstring for its invariants."""

    def __init__(self, config: ClusterConfig, clock: Callable[[], float] = time.monotonic,
                 admission: AdmissionPolicy | None = None, pools: PoolBalancer | None = None) -> None:
        self.config = config
        self.clock = clock
        self.secret = config.cluster_secret or ClusterSecret.generate()  # what its workers must be handed
        # Every placement decision, and the router state it reads (index, load, the tally admission and adaptive
        # pools price over): the same object the simulator places with.
        self.placement = ClusterPlacement(
            PlacementConfig(policy=config.policy, seed=config.seed, block_size=config.block_size,
                            max_num_waiting=config.max_num_waiting,
                            local_prefill_threshold_tokens=config.local_prefill_threshold_tokens,
                            kv_bytes_per_token=config.kv_bytes_per_token,
                            reserve_ahead_tokens=config.reserve_ahead_tokens,
                            store_prices=StorePrices(config.kv_store_block_bytes,
                                                     host_bytes_per_s=config.kv_store_host_bytes_per_s,
                                                     disk_bytes_per_s=config.kv_store_disk_bytes_per_s)
                            if config.kv_store_address else None,
                            store_node=config.kv_store_address),
            admission, pools)
        self._store_feeds: dict[str, StoreEventFeed] = {}  # node address -> the reader of its events
        # Peers with a gossip send under way, each with the addresses to tell it next (`_tell_router`).
        self._gossip_pending: dict[str, dict[str, None]] = {}
        self.queue_policy = config.scheduling_policy or local_queue_policy(config.policy)
        self.pool = WorkerPool(config, clock, self.placement, self.queue_policy, self._on_delta,
                               self._on_handoff_ended, self._on_worker_removed)
        if self.state.store_prices is not None:
            self.pool.store_speeds = MeasuredStorePrices(self.state.store_prices)
            self.pool.on_store_node = self.read_store_node
        self._calls: dict[str, CallRecord] = {}
        # Counters for /metrics (the HTTP layer renders them).
        self.router_decisions: dict[str, int] = {}  # decision reason -> count
        self.num_rejected = 0
        self.num_failed_by_worker_loss = 0
        self.num_migrations = 0  # calls moved to another worker after losing theirs
        # Set when the router is being stopped: new calls are refused (503, Retry-After) while those in flight end.
        self.draining = False
        self._shutting_down = False  # set by shutdown: the workers are being stopped
        self.num_handoff_fallbacks = 0  # prefill legs that ended without the KV (relayed to the decode worker)
        self.handoff_endings: dict[str, int] = {}  # outcome of those legs -> count
        self._tasks: list[asyncio.Task[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None  # set by `start`: the store feeds deliver onto it
        self.address = ""

    # -- the pool's, as the HTTP layer, the launcher and tests read them ---------------------------

    @property
    def workers(self) -> dict[str, WorkerRecord]:
        """Live workers by id."""
        return self.pool.workers

    @property
    def lost_workers(self) -> dict[str, str]:
        """Why each worker that left did."""
        return self.pool.lost_workers

    @property
    def identity(self) -> ClusterIdentity | None:
        return self.pool.identity

    @property
    def num_snapshots_requested(self) -> int:
        return self.pool.num_snapshots_requested

    def watch_process(self, worker_id: str, process: ProcessHandle) -> None:
        """Let the monitor notice at once when this worker's process exits."""
        self.pool.watch_process(worker_id, process)

    def check_workers(self) -> None:
        """Drop workers whose process exited or that went silent; ping the rest."""
        self.pool.check_workers()

    @property
    def state(self) -> RouterState:
        return self.placement.state

    @property
    def pools(self) -> PoolBalancer | None:
        return self.placement.pools

    @property
    def admission(self) -> AdmissionPolicy | None:
        return self.placement.admission

    @property
    def tally(self) -> CallTally | None:
        return self.placement.tally

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> str:
        """Bind the socket, start reading it and start the monitor loop; returns the bound address."""
        socket = self.pool.socket = RouterSocket(self.config.bind_address, self.secret)
        self.address = self.pool.own_address = socket.address
        self.pool.tell_router = self._tell_router
        socket.start(self.pool.handle)
        self._tasks = [asyncio.create_task(self._monitor_loop())]
        self._loop = asyncio.get_running_loop()
        if self.config.kv_store_address:
            self.pool.add_store_node(self.config.kv_store_address)
        return self.address

    def read_store_node(self, address: str) -> None:
        """Read the events of the store node at `address` into the store directory from now on (once per node: a
        worker registering names its host's). A node silent for the feed's `lost_after_s` (3 s) is taken out of the
        directory, and so is one that answers under a new epoch (restarted, however quickly), whose blocks come back
        as it reports them; until then the loads planned from a dead node's blocks find it down and recompute
        (`StoreNodes`' down-window)."""
        if address in self._store_feeds or self.state.store is None or self._loop is None:
            return
        loop = self._loop
        self._store_feeds[address] = StoreEventFeed(
            address, self.secret,
            lambda events, snapshot: loop.call_soon_threadsafe(self._on_store_events, address, events, snapshot),
            on_disk_reads=lambda num_bytes, seconds: loop.call_soon_threadsafe(
                self._on_store_disk_reads, address, num_bytes, seconds),
            on_lost=lambda: loop.call_soon_threadsafe(self._on_store_node_lost, address)).start()

    def _on_store_node_lost(self, node: str) -> None:
        """The node stopped answering: none of its blocks is planned a load from (a load already sent recomputes)."""
        if self.state.store is not None:
            log.warning("KV store node %s does not answer: its %d blocks leave the store directory", node,
                        self.state.store.num_blocks(node))
            self.state.store.remove_node(node)

    def _tell_router(self, router_address: str, addresses: tuple[str, ...]) -> None:
        """The pool's gossip to another router (and its probes): on an executor thread, as connecting waits (bounded:
        `send_add_router`), and at most one send at a time per peer: news for a peer whose send is under way is
        sent after it, merged, so a dead peer holds one thread for about a second, not one per message. The outcome
        tells the pool whether the peer is reachable (`WorkerPool.on_peer_told`)."""
        pending = self._gossip_pending.get(router_address)
        if pending is not None:  # a send to it is under way: this goes next
            pending.update(dict.fromkeys(addresses))
            return
        self._gossip_pending[router_address] = {}
        self._send_to_peer(router_address, addresses)

    def _send_to_peer(self, peer: str, addresses: tuple[str, ...]) -> None:
        future = asyncio.get_running_loop().run_in_executor(None, send_add_router, peer, addresses, self.secret)
        future.add_done_callback(lambda done: self._told_peer(peer, done))

    def _told_peer(self, peer: str, done: asyncio.Future[bool]) -> None:
        reached = not done.cancelled() and done.exception() is None and bool(done.result())
        self.pool.on_peer_told(peer, reached)
        pending = self._gossip_pending.pop(peer, {})
        if pending and not self._shutting_down:
            self._gossip_pending[peer] = {}
            self._send_to_peer(peer, tuple(pending))

    async def join(self, address: str, timeout_s: float) -> None:
        """Join the cluster whose router listens (RPC) at `address`: tell it this router's address, which it passes on
        to its workers; they register here and send their prefix caches' snapshots, so this router's index starts
        whole. Returns once a worker serves here; TimeoutError when none does within `timeout_s`."""
        if address not in self.pool.peer_routers:
            self.pool.peer_routers.append(address)
        await asyncio.to_thread(send_add_router, address, (self.address,), self.secret, 5.0)  # it may be starting
        try:
            await self.wait_for_workers(1, timeout_s)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc} after joining {address}: is it a kvbaton router's RPC address (its /cluster "
                               "router_address), holding the same cluster secret?") from None
    def _on_store_events(self, node: str, events: list[StoreEvent], snapshot: bool) -> None:
        if snapshot:
            self.placement.apply_store_snapshot(node, events)
        elif not self.placement.on_store_events(node, events) and node in self._store_feeds:
            self._store_feeds[node].resync()

    def _on_store_disk_reads(self, node: str, num_bytes: int, seconds: float) -> None:
        """A store node's disk reads so far: they price the disk from the first measurement on."""
        speeds = self.pool.store_speeds
        if speeds is not None and speeds.observe("disk", node, num_bytes, seconds, self.clock()):
            self.placement.state.store_prices = speeds.prices()

    def _store_info(self) -> dict[str, object]:
        store = self.state.store
        assert store is not None
        nodes = list(self.pool.store_nodes)  # this host's first, then in the order workers named them
        readers: dict[str, list[str]] = {}
        for worker, node in sorted(self.state.store_node_of.items()):
            readers.setdefault(node, []).append(worker)
        return {"address": self.config.kv_store_address, "node": self.config.kv_store_address,
                "num_blocks": sum(store.num_blocks(node) for node in nodes),
                "nodes": [{"address": node, "num_blocks": store.num_blocks(node), "workers": readers.get(node, [])}
                          for node in nodes],
                **(self.pool.store_speeds.info() if self.pool.store_speeds is not None else {})}

    async def _monitor_loop(self) -> None:
        while True:
            await asyncio.sleep(min(self.config.ping_interval_s, 0.1))
            try:
                self.pool.check_workers()
                self.pool.check_peers()
            except Exception:  # keep detecting dead workers whatever went wrong once
                log.exception("worker check failed")

    async def wait_for_workers(self, num_workers: int, timeout_s: float) -> None:
        deadline = self.clock() + timeout_s
        while self.num_serving_workers < num_workers:
            if self.clock() >= deadline:
                lost = "; ".join(f"{w}: {why}" for w, why in sorted(self.lost_workers.items()))
                raise TimeoutError(f"{self.num_serving_workers}/{num_workers} workers serving within {timeout_s:g} s"
                                   + (f" (lost: {lost})" if lost else ""))
            await asyncio.sleep(0.05)

    async def drain(self, timeout_s: float, until: Callable[[], bool] = lambda: False) -> int:
        """Wait for in-flight calls to end, for at most `timeout_s` or until `until()` holds; returns how many were
        still running then."""
        deadline = self.clock() + timeout_s
        while self._calls and self.clock() < deadline and not until():
            await asyncio.sleep(0.05)
        return len(self._calls)

    def abort_all(self) -> int:
        """Abort every call in flight: each ends with its workers' abort delta (finish reason "abort"), so its
        stream gets a proper end. Returns how many were aborted."""
        entries = [entry for entry in self._calls.values() if not entry.finished]
        for entry in entries:
            self._send_abort(entry)
        return len(entries)

    def reset_prefix_cache(self) -> list[str]:
        """Ask every registered worker to drop the cached blocks no request holds; their KV events then take those
        blocks out of the router's index. Returns the workers asked."""
        worker_ids = sorted(self.workers)
        for worker_id in worker_ids:
            self.pool.send(worker_id, rpc.ResetPrefixCache("reset requested through the API"))
        return worker_ids

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Tell every worker to stop (they abort what is left), wait for their goodbyes, then close."""
        self.draining = True
        self._shutting_down = True  # a call lost with a worker now does not move to another one being stopped
        for worker_id in sorted(self.workers):
            self.pool.send(worker_id, rpc.Shutdown("router shutting down"))
        deadline = self.clock() + timeout_s
        while self.workers and self.clock() < deadline:
            await asyncio.sleep(0.05)
        for worker_id in sorted(self.workers):
            self.pool.remove(worker_id, "did not acknowledge shutdown")
        for feed in self._store_feeds.values():
            feed.stop()
        self._store_feeds.clear()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self.pool.socket is not None:
            self.pool.socket.close()
        self.pool.socket = None

    # -- ClusterClient --------------------------------------------------------------------------

    def submit(self, call: GenerateCall, sink: DeltaSink) -> None:
        """Route and send the call now (RejectedError if refused); `sink` then gets each of its deltas on the
        event loop, ending with exactly one finished delta (also when its worker is lost). The sink must not
        raise; abort with `abort(request_id)`."""
        self._route(call, sink)

    async def generate(self, call: GenerateCall) -> AsyncIterator[TokenDelta]:
        queue: asyncio.Queue[TokenDelta] = asyncio.Queue()
        entry = self._route(call, queue.put_nowait)
        try:
            while True:
                delta = await queue.get()
                yield delta
                if delta.finished:
                    return
        finally:
            if not entry.finished:  # the consumer went away mid-stream: free the worker's blocks
                self._send_abort(entry)
                self._end_call(entry)

    async def abort(self, request_id: str) -> None:
        entry = self._calls.get(request_id)
        if entry is not None and not entry.finished:
            self._send_abort(entry)

    def _send_abort(self, entry: CallRecord) -> None:
        """Cancellation reaches both legs of a disaggregated call (each tells its transfer peer too)."""
        entry.aborted = True
        request_ids = (entry.call.request_id,)
        if entry.prefill_worker and entry.prefill_worker in self.workers:
            self.pool.send(entry.prefill_worker, rpc.Abort(request_ids))
        self.pool.send(entry.worker_id, rpc.Abort(request_ids))

    # -- routing --------------------------------------------------------------------------------

    def _route(self, call: GenerateCall, sink: DeltaSink) -> CallRecord:
        if call.request_id in self._calls:
            raise RejectedError(f"request id {call.request_id!r} is already in flight", status_code=400)
        if self.draining:
            self.num_rejected += 1
            raise RejectedError("this router is shutting down; retry on another router or later", status_code=503,
                                retry_after_s=self.config.retry_after_s)
        placement = self._place(call, (), whole=call.sampling.prompt_logprobs is not None)
        entry = CallRecord(call, placement.worker_id, sink, prefill_worker=placement.prefill_worker)
        self._calls[call.request_id] = entry
        self._send_add(entry)
        return entry

    def _place(self, call: GenerateCall, output_token_ids: tuple[int, ...], whole: bool) -> Placement:
        """Place the call, resuming after `output_token_ids` (a migration); RejectedError (counted) if refused."""
        if self.identity is None or not self.placement.num_serving:
            self.num_rejected += 1
            raise RejectedError(f"cluster not ready: {self.is_ready()[1]}", status_code=503,
                                retry_after_s=self.config.retry_after_s)
        cache_key = CacheKey(self.identity.model_revision, self.identity.kv_layout)
        max_tokens_left = max(call.sampling.max_tokens - len(output_token_ids), 1)
        request = RouteRequest.from_tokens(call.request_id, call.prompt_token_ids + output_token_ids, cache_key,
                                           self.config.block_size, max_tokens_left, call.tenant)
        placement = self.placement.place(request, self.clock(), whole=whole)
        if isinstance(placement, Refusal):
            self.num_rejected += 1
            reason = placement.reason
            if placement.kind in ("slo_prefill", "slo_decode"):
                counter = f"slo_reject_{placement.kind.removeprefix('slo_')}"
                self.router_decisions[counter] = self.router_decisions.get(counter, 0) + 1
                assert self.admission is not None
                reason = f"request cannot meet its SLO ({self.admission.name} admission): {reason}"
            raise RejectedError(f"{reason}; retry later", status_code=503 if placement.kind == "not_ready" else 429,
                                retry_after_s=self.config.retry_after_s)
        switch = self.placement.last_switch
        if switch is not None:
            log.info("adaptive pools: %s %s (%s)", "lent" if switch.lent else "returned", switch.worker_id,
                     switch.reason)
        self.router_decisions[placement.reason] = self.router_decisions.get(placement.reason, 0) + 1
        return placement

    def _send_add(self, entry: CallRecord) -> None:
        """Send the placed call to its worker(s). A send may find its worker gone: the pool removes it, which ends
        or migrates this call before the send returns."""
        call = entry.call
        worker_id = entry.worker_id
        self.workers[worker_id].in_flight.add(call.request_id)
        add = rpc.AddRequest(call.request_id, call.prompt_token_ids, call.sampling, call.tenant, call.slo_class,
                             output_token_ids=tuple(entry.output_token_ids))
        if not entry.prefill_worker:
            self.pool.send(worker_id, add)
            return
        # The decode leg first, so it usually knows the request before the reservation arrives (either order works).
        self.workers[entry.prefill_worker].in_flight.add(call.request_id)
        self.pool.send(worker_id, replace(add, prefill_worker=entry.prefill_worker,
                                          kv_load_failure_policy=self.config.kv_load_failure_policy))
        if entry.finished or entry.worker_id != worker_id:  # the decode worker was unreachable: it left the pool
            return
        self.pool.send(entry.prefill_worker, replace(add, decode_worker=worker_id,
                                                 decode_address=self.workers[worker_id].register.kv_address))

    def _refused_at_decode(self, entry: CallRecord, delta: TokenDelta) -> bool:
        """Admission's decode-stage gate, as the simulator runs it when a handed-off call's KV reaches its decode
        worker: here when its first token does (the decode worker adopted the KV). A refused call is aborted
        there and ends "rejected", which the API answers with 429; True when so."""
        call = entry.call
        decision = self.placement.check_decode(call.request_id, len(call.prompt_token_ids), call.sampling.max_tokens,
                                               entry.worker_id, self.clock())
        if decision is None or decision.admitted:
            return False
        assert self.admission is not None
        self.num_rejected += 1
        self.router_decisions["slo_reject_at_decode"] = self.router_decisions.get("slo_reject_at_decode", 0) + 1
        self._send_abort(entry)
        self._end_call(entry, stored=True)  # its prefill ran: what routing put in the index is there
        entry.sink(TokenDelta(call.request_id, (), "", True, "rejected", len(call.prompt_token_ids),
                              error=f"request cannot meet its SLO ({self.admission.name} admission, at decode): "
                                    f"{decision.reason}; retry later",
                              worker_id=delta.worker_id, extra={"retry_after_s": self.config.retry_after_s}))
        return True

    def _end_call(self, entry: CallRecord, stored: bool = False) -> None:
        """Idempotent: a send on the way to ending a call (the abort of a consumer that left) may find its worker
        gone, and that worker's removal ends the call first. `stored`: its prompt's KV was computed, whatever
        token the router saw."""
        if entry.finished:
            return
        entry.finished = True
        if entry.num_tokens_seen == 0 and not stored:
            # Ended before its first token: what routing put in the prefix index for it may never be stored.
            for worker_id in (entry.worker_id, entry.prefill_worker):
                record = self.workers.get(worker_id)
                if record is not None and record.index_dirty_at is None:
                    record.index_dirty_at = self.clock()
        request_id = entry.call.request_id
        self._calls.pop(request_id, None)
        for worker_id in (entry.worker_id, entry.prefill_worker):
            record = self.workers.get(worker_id)
            if record is not None:
                record.in_flight.discard(request_id)
        self.placement.on_finished(request_id, self.clock())

    def _on_delta(self, delta: TokenDelta) -> None:
        entry = self._calls.get(delta.request_id)
        if entry is None or entry.finished:
            return  # the consumer already went away; the worker's late abort delta is dropped
        if entry.num_migrations and delta.worker_id and delta.worker_id != entry.worker_id:
            return  # a late delta from the prefill worker of the pair it left (its abort): the call runs whole now
        if delta.new_token_ids and entry.num_tokens_seen == 0 and entry.prefill_worker and self._refused_at_decode(
                entry, delta):
            return
        if delta.new_token_ids:
            self.placement.on_tokens(delta.request_id, len(delta.new_token_ids), self.clock())
            entry.output_token_ids.extend(delta.new_token_ids)
        entry.num_tokens_seen += len(delta.new_token_ids)
        if delta.finished:
            if entry.prefill_worker and delta.worker_id == entry.prefill_worker and entry.worker_id in self.workers:
                # Ended by its prefill leg (an add it could not take): the decode leg waits for KV that never comes.
                self.pool.send(entry.worker_id, rpc.Abort((delta.request_id,)))
            self._end_call(entry)
        entry.sink(delta)

    def _on_handoff_ended(self, message: rpc.HandoffEnded) -> None:
        """A prefill leg ended without the KV: the decode worker falls back (it may already know, harmlessly)."""
        self.handoff_endings[message.outcome] = self.handoff_endings.get(message.outcome, 0) + 1
        entry = self._calls.get(message.request_id)
        if entry is None or entry.finished or entry.prefill_worker != message.worker_id or entry.num_tokens_seen:
            return  # a first token came: the decode worker adopted the KV (its ack was late) or recomputed
        self.num_handoff_fallbacks += 1
        self.pool.send(entry.worker_id, rpc.HandoffFailed(message.request_id, message.reason,
                                                          refused=message.outcome == "refused"))

    def _on_worker_removed(self, worker_id: str, record: WorkerRecord, reason: str) -> None:
        """The calls of a worker that left the pool (and the placement, so none is placed on it again): a lost
        prefill leg hands its call to the decode worker's fallback; any other call migrates (`_migrate`)."""
        for request_id in sorted(record.in_flight):
            entry = self._calls.get(request_id)
            if entry is None or entry.finished:
                continue
            if entry.prefill_worker == worker_id:  # the decode worker answers: it recomputes or fails cleanly
                if entry.num_tokens_seen:
                    continue  # a first token came: the decode worker adopted the KV or recomputed, it needs nothing
                self.num_handoff_fallbacks += 1
                self.pool.send(entry.worker_id,
                               rpc.HandoffFailed(request_id, f"prefill worker lost ({reason})", False))
                continue
            if entry.prefill_worker:
                self.pool.send(entry.prefill_worker, rpc.Abort((request_id,)))
                if entry.finished or entry.worker_id != worker_id:  # that send lost the prefill worker too
                    continue
            self._migrate(entry, f"worker {worker_id} was lost while running this request ({reason})")

    def _migrate(self, entry: CallRecord, why: str) -> None:
        """Move a call whose worker was lost to another worker, placed whole, resuming after the tokens already
        streamed; the call fails with an error delta saying `why` when the migration limit forbids it or no
        worker takes it. Its placement's bookkeeping (tally, waiting count) ends here and starts again with the
        new placement, so each placement hears `on_finished` once."""
        call, limit = entry.call, self.config.migration_limit
        request_id = call.request_id
        for worker_id in (entry.worker_id, entry.prefill_worker):
            record = self.workers.get(worker_id)
            if record is not None:
                record.in_flight.discard(request_id)
        self.placement.on_finished(request_id, self.clock())
        error = ""
        if entry.aborted:
            error = why  # it was being cancelled anyway
        elif self._shutting_down:
            error = f"{why}; not migrated: this router is shutting down"
        elif entry.num_migrations >= limit:
            error = (f"{why}; migration is off (--migration-limit 0)" if limit == 0 else
                     f"{why}; not migrated: it already moved {entry.num_migrations} times (--migration-limit {limit})")
        else:
            try:
                placement = self._place(call, tuple(entry.output_token_ids), whole=True)
            except RejectedError as exc:
                error = f"{why}; no other worker took it over ({exc})"
        if error:
            self.num_failed_by_worker_loss += 1
            self._end_call(entry)
            entry.sink(TokenDelta(request_id, (), "", True, "error", len(call.prompt_token_ids), error=error,
                                  worker_id=entry.worker_id))
            return
        self.num_migrations += 1
        entry.num_migrations += 1
        log.info("call %s migrates from %s to %s after %d tokens (%s)", request_id, entry.worker_id,
                 placement.worker_id, len(entry.output_token_ids), why)
        entry.worker_id, entry.prefill_worker, entry.num_tokens_seen = placement.worker_id, "", 0
        self._send_add(entry)

    # -- readiness, /cluster and /metrics
    @property
    def num_serving_workers(self) -> int:
        """Registered workers whose engine loop runs (they have sent a heartbeat)."""
        return self.pool.num_serving

    def is_ready(self) -> tuple[bool, str]:
        if self.draining:
            return False, "this router is shutting down (finishing its in-flight calls)"
        serving = sorted(w for w, record in self.workers.items() if record.stats is not None)
        if serving:
            return True, f"{len(serving)} worker(s) serving: {', '.join(serving)}"
        if self.workers:
            return False, f"{len(self.workers)} worker(s) registered, none has started its engine loop yet"
        if self.lost_workers:
            lost = "; ".join(f"{w}: {why}" for w, why in sorted(self.lost_workers.items()))
            return False, f"no live worker (lost: {lost})"
        return False, "no worker registered yet"

    def cluster_info(self) -> dict[str, object]:
        now = self.clock()
        return {
            "policy": self.config.policy,
            "worker_queue_policy": self.queue_policy,
            "model": self.config.model_name,
            "identity": None if self.identity is None else {
                "model_revision": self.identity.model_revision, "kv_layout": self.identity.kv_layout,
                "block_size": self.identity.block_size},
            "router_address": self.address,
            "peer_routers": list(self.pool.peer_routers),
            "workers": [worker_info(self.workers[w], self.state, now) for w in sorted(self.workers)],
            "lost_workers": dict(sorted(self.lost_workers.items())),
            "num_in_flight": len(self._calls),
            "num_waiting": self.num_waiting,
            "index_blocks": self.state.index.num_blocks,
            # the store nodes this router reads (its host's first), the blocks its directory holds on each and in
            # all, and the speeds loads are priced at (measured, or nominal before the first measurement)
            "kv_store": self._store_info() if self.config.kv_store_address and self.state.store is not None else None,
            "lent_workers": {} if self.pools is None else dict(sorted(self.pools.lent.items())),
            "pool_switches": 0 if self.pools is None else len(self.pools.switches),
            "router_decisions": dict(sorted(self.router_decisions.items())),
            "num_rejected": self.num_rejected,
            "num_failed_by_worker_loss": self.num_failed_by_worker_loss,
            "num_migrations": self.num_migrations,
            "transfers": self.transfer_totals(),
            "spec_decode": self.spec_decode_totals(),
        }

    def transfer_totals(self) -> dict[str, float]:
        """KV handoff counters summed over live workers (prefill side: bytes, time, queue; decode side:
        adoptions, recomputes), plus the router's fallbacks and reservation refusals."""
        totals: dict[str, float] = {}
        for stats in self.live_worker_stats().values():
            for name, value in transfer_info(stats).items():
                totals[name] = totals.get(name, 0) + value
        totals["num_fallbacks"] = self.num_handoff_fallbacks
        totals["num_refusals_reported"] = self.handoff_endings.get("refused", 0)
        return totals

    @property
    def num_waiting(self) -> int:
        """Routed calls that have not produced a token yet (queued somewhere in the cluster)."""
        return self.placement.num_waiting

    @property
    def num_in_flight(self) -> int:
        return len(self._calls)

    def live_worker_stats(self) -> dict[str, rpc.Stats]:
        return self.pool.live_stats()

    def spec_decode_totals(self) -> dict[str, int]:
        """Speculative decoding's draft tokens proposed and accepted over all workers ever registered; never
        decreases."""
        num_draft_tokens, num_accepted_tokens = self.pool.retired_spec_decode_tokens
        for stats in self.live_worker_stats().values():
            num_draft_tokens += stats.num_draft_tokens
            num_accepted_tokens += stats.num_accepted_tokens
        return {"num_draft_tokens": num_draft_tokens, "num_accepted_tokens": num_accepted_tokens}
