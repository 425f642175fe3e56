"""The router process's view of its workers: a `ClusterClient` over zmq that places, streams and fails calls.

It owns one RouterSocket (workers connect DEALERs), whose reader callback hands it every message
(registration, token deltas, heartbeats, KV events, snapshots), and one asyncio task, the monitor
(pings, dead-worker detection). A call's deltas go to the sink it was submitted with (`submit`), called
on the event loop as they arrive; `generate` is the queue-backed stream over that. Invariants:
- every call handed to `generate` ends with exactly one finished delta, also when its worker dies
  (an "error" delta naming the worker) or the client goes away (the worker is told to abort);
- a call is in `_calls` and in its worker's `in_flight` from routing until its finished delta;
- the placement policy sees `choose` once per routed call and `on_finished` once when it ends;
- a worker leaves the pool (and the policy's index and load state) at most once.

Disaggregated pools (workers registered as `prefill` / `decode`): `PairChooser` picks (p, d) and the
call goes to both — d answers for it (it streams every delta), p only reports a handoff leg that
ended without the KV, which is relayed to d to recompute or fail. A call is in the in-flight set of
both workers; losing p hands the call to d's fallback, losing d fails the call.

This module holds the manager's state and its call side (routing, admission, placement, each call's
deltas and end). Its base classes hold the rest: `WorkerMembership` (cluster_workers.py) the workers'
messages, registration and failure detection; `ClusterReports` (cluster_reports.py) the reads for
/ready, /cluster and /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, replace

from kvbaton.cache.hashing import CacheKey
from kvbaton.core.cluster_secret import ClusterSecret
from kvbaton.core.errors import CapacityError
from kvbaton.router.admission import AdmissionPolicy, AdmissionRequest, CalibratedTimeModel
from kvbaton.router.base import RouteRequest
from kvbaton.router.policies import create_policy, local_queue_policy
from kvbaton.router.pools import PoolBalancer
from kvbaton.router.state import RouterState
from kvbaton.server import rpc
from kvbaton.server.base import DeltaSink, GenerateCall, RejectedError, TokenDelta
from kvbaton.server.cluster_admission import AdmissionGate
from kvbaton.server.cluster_registry import CallRecord, ProcessHandle, WorkerRecord
from kvbaton.server.cluster_reports import ClusterReports
from kvbaton.server.cluster_workers import WorkerMembership
from kvbaton.server.pd_router import DEFAULT_LOCAL_PREFILL_THRESHOLD_TOKENS, PairChoiceConfig, PairChooser
from kvbaton.server.identity import ClusterIdentity
from kvbaton.server.router_socket import RouterSocket

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
    reserves_on_arrival: bool = True  # False: prefill workers reserve decode KV late (--reserve-ahead-tokens)
    # The workers' local waiting-queue policy: "" pairs it with `policy` (preble's fairness queue under preble,
    # else fcfs); "fcfs" or "priority" (vLLM's --scheduling-policy: SamplingParams.priority orders the queue
    # and picks who is preempted) replace it.
    scheduling_policy: str = ""
    # Only holders of this secret connect as workers (server/rpc_auth.py); None: a fresh one (`ClusterManager.secret`).
    cluster_secret: ClusterSecret | None = None


class ClusterManager(WorkerMembership, ClusterReports):
    """Routes and streams calls over the worker pool; see the module docstring for its invariants."""

    def __init__(self, config: ClusterConfig, clock: Callable[[], float] = time.monotonic,
                 admission: AdmissionPolicy | None = None, pools: PoolBalancer | None = None) -> None:
        self.config = config
        self.clock = clock
        self.secret = config.cluster_secret or ClusterSecret.generate()  # what its workers must be handed
        self.state = RouterState(block_size=config.block_size)
        self.policy = create_policy(config.policy, self.state, random.Random(config.seed))
        self.queue_policy = config.scheduling_policy or local_queue_policy(config.policy)
        self.identity: ClusterIdentity | None = None  # fixed by the first accepted worker
        self.workers: dict[str, WorkerRecord] = {}  # live workers
        self.lost_workers: dict[str, str] = {}  # worker id -> why it left
        self._calls: dict[str, CallRecord] = {}
        # Serving workers (registered, heartbeat seen) by role, sorted; read per routed call, so kept until the
        # pool changes (a worker joins, sends its first heartbeat, or leaves). None: recompute.
        self._serving_by_role: dict[str, list[str]] | None = None
        self._num_waiting = 0  # calls in _calls with num_tokens_seen == 0 (kept as a count: read per routing)
        self._processes: dict[str, ProcessHandle] = {}
        self._exits_pending: set[str] = set()  # dropped while their process still ran: its exit code comes later
        # Counters for /metrics (the HTTP layer renders them).
        self.router_decisions: dict[str, int] = {}  # decision reason -> count
        self.num_rejected = 0
        self.num_failed_by_worker_loss = 0
        self.num_snapshots_requested = 0
        self.num_handoff_fallbacks = 0  # prefill legs that ended without the KV (relayed to the decode worker)
        self.handoff_endings: dict[str, int] = {}  # outcome of those legs -> count
        self.pairs = PairChooser(self.state, PairChoiceConfig(config.local_prefill_threshold_tokens,
                                                              config.kv_bytes_per_token))
        # SLO admission (None: admit whatever the queue limit allows) refuses at arrival what no worker can serve
        # within its SLO; adaptive pools (None: fixed roles) lend a worker of the idle pool to mixed duty. Both
        # price over the router's own tally of routed calls.
        self.admission = admission
        self.pools = pools
        pricing = admission if admission is not None else (pools.admission if pools is not None else None)
        calibration = pricing.default_model if pricing is not None else None
        self.tally = (AdmissionGate(pricing, config.block_size, self._kv_capacity_tokens,
                                    calibration if isinstance(calibration, CalibratedTimeModel) else None,
                                    config.reserves_on_arrival)
                      if pricing is not None else None)
        self.retired_spec_decode_tokens = [0, 0]  # (draft, accepted) of workers that left: keeps totals monotone
        self._socket: RouterSocket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._last_check_at = clock()
        self.address = ""

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> str:
        """Bind the socket, start reading it and start the monitor loop; returns the bound address."""
        self._socket = RouterSocket(self.config.bind_address, self.secret)
        self.address = self._socket.address
        self._socket.start(self._handle)
        self._tasks = [asyncio.create_task(self._monitor_loop())]
        return self.address

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
            self._send(worker_id, rpc.ResetPrefixCache("reset requested through the API"))
        return worker_ids

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Tell every worker to stop (they abort what is left), wait for their goodbyes, then close."""
        for worker_id in sorted(self.workers):
            self._send(worker_id, rpc.Shutdown("router shutting down"))
        deadline = self.clock() + timeout_s
        while self.workers and self.clock() < deadline:
            await asyncio.sleep(0.05)
        for worker_id in sorted(self.workers):
            self._remove_worker(worker_id, "did not acknowledge shutdown")
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self._socket is not None:
            self._socket.close()
        self._socket = None

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
        request_ids = (entry.call.request_id,)
        if entry.prefill_worker and entry.prefill_worker in self.workers:
            self._send(entry.prefill_worker, rpc.Abort(request_ids))
        self._send(entry.worker_id, rpc.Abort(request_ids))

    # -- routing --------------------------------------------------------------------------------

    def _route(self, call: GenerateCall, sink: DeltaSink) -> CallRecord:
        if call.request_id in self._calls:
            raise RejectedError(f"request id {call.request_id!r} is already in flight", status_code=400)
        if not self._serving_roles() or self.identity is None:
            self.num_rejected += 1
            raise RejectedError(f"cluster not ready: {self.is_ready()[1]}", status_code=503,
                                retry_after_s=self.config.retry_after_s)
        if self.num_waiting >= self.config.max_num_waiting:
            self.num_rejected += 1
            raise RejectedError(f"too many queued requests ({self.num_waiting} waiting, limit "
                                f"{self.config.max_num_waiting}); retry later", status_code=429,
                                retry_after_s=self.config.retry_after_s)
        cache_key = CacheKey(self.identity.model_revision, self.identity.kv_layout)
        request = RouteRequest.from_tokens(call.request_id, call.prompt_token_ids, cache_key, self.config.block_size,
                                           call.sampling.max_tokens, call.tenant)
        now = self.clock()
        # Before placing: the policy's commit adds the prompt's blocks to the index under the chosen worker.
        matched = self.state.index.match(request.block_hashes) if self.tally is not None else {}
        if self.admission is not None:
            self._admit(call, matched, now)
        try:
            entry, reason = self._place(call, sink, request, matched, now)
        except CapacityError as exc:
            self.num_rejected += 1
            raise RejectedError(str(exc), status_code=503, retry_after_s=self.config.retry_after_s) from exc
        self.router_decisions[reason] = self.router_decisions.get(reason, 0) + 1
        if self.tally is not None:
            prefiller = entry.prefill_worker or entry.worker_id
            self.tally.on_routed(call.request_id, prefiller, entry.worker_id, len(call.prompt_token_ids),
                                 self.state.matched_tokens(request, matched.get(prefiller, 0)),
                                 call.sampling.max_tokens, now)
        self._calls[call.request_id] = entry
        self._num_waiting += 1
        self.workers[entry.worker_id].in_flight.add(call.request_id)
        add = rpc.AddRequest(call.request_id, call.prompt_token_ids, call.sampling, call.tenant, call.slo_class)
        if not entry.prefill_worker:
            self._send(entry.worker_id, add)
            return entry
        # The decode leg first, so it usually knows the request before the reservation arrives (either order works).
        self.workers[entry.prefill_worker].in_flight.add(call.request_id)
        self._send(entry.worker_id, replace(add, prefill_worker=entry.prefill_worker,
                                            kv_load_failure_policy=self.config.kv_load_failure_policy))
        if entry.finished:  # the decode worker was unreachable: it left the pool and failed this call with it
            return entry
        self._send(entry.prefill_worker, replace(add, decode_worker=entry.worker_id,
                                                 decode_address=self.workers[entry.worker_id].register.kv_address))
        return entry

    def _admit(self, call: GenerateCall, matched: Mapping[str, int], now: float) -> None:
        """Refuse (429) a call no serving option can take within its SLO; see `AdmissionGate`."""
        assert self.admission is not None and self.tally is not None
        prefill, decode, mixed = self._serving("prefill"), self._serving("decode"), self._serving("mixed")
        pairs = ([(p, d) for p in prefill for d in decode] + [(d, d) for d in decode if not prefill]
                 + [(w, w) for w in mixed])
        if not pairs:  # only prefill workers serve: placement runs calls whole on them, so price them so
            pairs = [(p, p) for p in prefill]
        decision = self.tally.check(call.request_id, len(call.prompt_token_ids), call.sampling.max_tokens,
                                    matched, pairs, now)
        if not decision.admitted:
            self.num_rejected += 1
            stage = "prefill" if decision.reason.startswith("prefill") else "decode"
            self.router_decisions[f"slo_reject_{stage}"] = self.router_decisions.get(f"slo_reject_{stage}", 0) + 1
            raise RejectedError(f"request cannot meet its SLO ({self.admission.name} admission): "
                                f"{decision.reason}; retry later", status_code=429,
                                retry_after_s=self.config.retry_after_s)

    def _lent_worker(self, call: GenerateCall, matched: Mapping[str, int], decode: list[str],
                     now: float) -> str | None:
        """Adaptive pools: update both pools' pressure, then the lent worker to take this call whole, if any."""
        assert self.pools is not None and self.tally is not None
        prompt_len = len(call.prompt_token_ids)
        request = AdmissionRequest(call.request_id, prompt_len, call.sampling.max_tokens)
        cached = {w: num_blocks * self.config.block_size for w, num_blocks in matched.items()}
        lent, switch = self.pools.route(request, cached, self._serving("prefill"), decode, self.tally.prefill_load,
                                        self.tally.decode_load, now)
        if switch is not None:
            log.info("adaptive pools: %s %s (%s)", "lent" if switch.lent else "returned", switch.worker_id,
                     switch.reason)
        return lent

    def _kv_capacity_tokens(self, worker_id: str) -> int:
        record = self.workers.get(worker_id)
        stats = record.stats if record is not None else None
        return 0 if stats is None else (stats.num_used_blocks + stats.num_free_blocks) * self.config.block_size

    def _serving_roles(self) -> dict[str, list[str]]:
        """role -> its serving workers, sorted (only roles that have one); callers must not mutate the lists."""
        if self._serving_by_role is None:
            by_role: dict[str, list[str]] = {}
            for worker_id in sorted(self.workers):
                record = self.workers[worker_id]
                if record.stats is not None:
                    by_role.setdefault(record.register.role, []).append(worker_id)
            self._serving_by_role = by_role
        return self._serving_by_role

    def _serving(self, role: str) -> list[str]:
        return self._serving_roles().get(role, [])

    def _place(self, call: GenerateCall, sink: DeltaSink, request: RouteRequest, matched: Mapping[str, int],
               now: float) -> tuple[CallRecord, str]:
        """Mixed pool only: the cluster policy. With prefill and decode pools: the pair chooser, whose
        short-prompt ("local_prefill") calls go to the mixed pool by the policy when there is one; with adaptive
        pools, a worker lent to mixed duty may take the call whole ("pool_lent")."""
        decode_workers = {w: self.workers[w].register.kv_address.partition("://")[0] for w in self._serving("decode")}
        mixed = self._serving("mixed")
        if decode_workers and self.pools is not None:
            lent = self._lent_worker(call, matched, sorted(decode_workers), now)
            if lent is not None:
                self.state.commit(request, lent, matched.get(lent, 0), now)
                return CallRecord(call, lent, sink, by_policy=False), "pool_lent"
        if decode_workers:
            pair = self.pairs.choose(request, self._serving("prefill"), decode_workers, now,
                                     whole=call.sampling.prompt_logprobs is not None)
            if pair.prefill_worker:
                return CallRecord(call, pair.decode_worker, sink, prefill_worker=pair.prefill_worker,
                             by_policy=False), "pair"
            if not mixed:
                self.state.commit(request, pair.decode_worker,
                                  self.state.index.match(request.block_hashes).get(pair.decode_worker, 0), now)
                return CallRecord(call, pair.decode_worker, sink, by_policy=False), "local_prefill"
        decision = self.policy.choose(request, mixed or sorted(self.workers), now)
        return CallRecord(call, decision.worker_id, sink), decision.reason

    def _end_call(self, entry: CallRecord) -> None:
        """Idempotent: a send on the way to ending a call (the abort of a consumer that left) may find its worker
        gone, and that worker's removal ends the call first."""
        if entry.finished:
            return
        entry.finished = True
        if entry.num_tokens_seen == 0:
            self._num_waiting -= 1
            # Ended before its first token: what routing put in the prefix index for it may never be stored.
            for worker_id in (entry.worker_id, entry.prefill_worker):
                record = self.workers.get(worker_id)
                if record is not None and record.index_dirty_at is None:
                    record.index_dirty_at = self.clock()
        request_id = entry.call.request_id
        self._calls.pop(request_id, None)
        if self.tally is not None:
            self.tally.on_ended(request_id)
        for worker_id in (entry.worker_id, entry.prefill_worker):
            record = self.workers.get(worker_id)
            if record is not None:
                record.in_flight.discard(request_id)
        if entry.by_policy:
            self.policy.on_finished(request_id, self.clock())
        else:
            self.state.load.on_finished(request_id)

    def _on_delta(self, delta: TokenDelta) -> None:
        entry = self._calls.get(delta.request_id)
        if entry is None or entry.finished:
            return  # the consumer already went away; the worker's late abort delta is dropped
        if delta.new_token_ids and entry.num_tokens_seen == 0:
            now = self.clock()
            self.policy.on_first_token(delta.request_id, now - entry.call.arrival_at, now)
            self._num_waiting -= 1
        entry.num_tokens_seen += len(delta.new_token_ids)
        if self.tally is not None and delta.new_token_ids:
            self.tally.on_tokens(delta.request_id, len(delta.new_token_ids), self.clock())
        if delta.finished:
            if entry.prefill_worker and delta.worker_id == entry.prefill_worker and entry.worker_id in self.workers:
                # Ended by its prefill leg (an add it could not take): the decode leg waits for KV that never comes.
                self._send(entry.worker_id, rpc.Abort((delta.request_id,)))
            self._end_call(entry)
        entry.sink(delta)
