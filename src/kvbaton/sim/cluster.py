"""The discrete-event cluster: arrivals, worker steps and KV transfers on one heap keyed by (time, rank, seq).

Request lifecycle (the same contract as the live router, `kvbaton.router.base`):
  arrival  -> the live router's placement (`kvbaton.router.placement.ClusterPlacement`) admits or refuses
              it and picks the worker, or the prefill/decode pair, from the same heartbeats, KV events
              and routed calls a live router hears of (a short prompt prefills on its decode worker)
  steps    -> the worker's LocalScheduler plans, the cost model prices the plan, time advances
  mixed    -> tokens stream until the exact output length; the policy hears on_first_token
              and on_finished
  prefill  -> the real handoff protocol (`sim/handoff.py`, driven by this class's handoff event
              handlers): reserve on the decode worker (or be
              refused and retry: backpressure), then the prefill runs with max_tokens=1 and
              streams its KV over the prefill worker's egress link (FIFO: transfers contend);
              on the ack (sent as the last message arrives, even mid-step) the decode worker
              adopts the blocks after its step in flight (`LocalScheduler.admit_prefilled`)
              and decodes from the first token; the router hears the first token then, as live.
With an admission policy (`kvbaton.router.admission`), arrivals it refuses, and prefilled requests
the decode stage refuses when their KV arrives (its blocks released), end as `rejected` records.
Every worker reports a heartbeat at time 0, when it starts serving, then (stats + its radix cache's real KV
events, and with a cluster KV store its store node's events) at most every `heartbeat_s` of simulated time while
busy, and whenever it goes idle. Everything is
a pure function of the inputs and the seed: no clock. Events at equal times come arrivals and transfer events
first (rank 0, in the order they were pushed: `seq`), then the workers' step ends in the cluster spec's worker
order (rank 1, 2, ...): an order that does not depend on when a step's end was pushed.
"""

from __future__ import annotations

import gc
import heapq
import math
import random
from collections.abc import Callable, Mapping, Sequence
from collections import deque
from dataclasses import replace
from typing import Any

from kvbaton.bench.records import RequestRecord
from kvbaton.bench.workloads.base import WorkloadRequest
from kvbaton.cache.kv_store import KVStore, StoreConfig
from kvbaton.cache.store_tier import StoreTier
from kvbaton.core.config import CacheConfig, SchedulerConfig
from kvbaton.core.errors import InvalidRequestError, KvbatonError
from kvbaton.core.request import FinishReason, Request
from kvbaton.core.sampling import SamplingParams
from kvbaton.core.step import StepPlan
from kvbaton.router.admission import AdmissionPolicy
from kvbaton.router.base import RouteRequest
from kvbaton.router.placement import ClusterPlacement, PlacementConfig, Refusal
from kvbaton.router.policies import local_queue_policy
from kvbaton.router.pools import PoolBalancer
from kvbaton.router.state import RouterState
from kvbaton.sim.costs.base import CostModel
from kvbaton.sim.flight import Flight
from kvbaton.sim.config import SimConfig, StoreReport, WorkerHardware, WorkerReport
from kvbaton.sim.handoff import Delivery, HandoffEvent, SimHandoffs, check_same_layout
from kvbaton.sim.links import get_link
from kvbaton.sim.prompts import SimPrompts
from kvbaton.sim.spec import ClusterSpec
from kvbaton.sim.store_io import StoreLinks, kv_read_s_per_token, router_prefill_model
from kvbaton.sim.worker import SimWorker, TokenFn
from kvbaton.transfer import AdoptedKV
from kvbaton.transfer.source import num_due_to_reserve

# The kinds of heap events: arrival, step end, a protocol message, a retry, a store node lost or back.
_ARRIVAL, _STEP_DONE, DELIVERY, RETRY, _STORE_NODE = 0, 1, 2, 3, 4


class ClusterSim:
    def __init__(self, spec: ClusterSpec, cost_model: CostModel, config: SimConfig = SimConfig(),
                 token_for: TokenFn | None = None, admission: AdmissionPolicy | None = None,
                 pools: PoolBalancer | None = None, hardware: Mapping[str, WorkerHardware] | None = None) -> None:
        """`hardware`: per worker id, its own cost model and KV pool where its pool's GPU is not `cost_model`'s
        (per-pool GPUs and power caps); the others run on `cost_model` with `config.cache`."""
        self.spec = spec
        self.admission = admission
        self.pools = pools
        self.cost_model = cost_model
        self.config = config
        sched = config.scheduler or SchedulerConfig(queue_policy=local_queue_policy(config.policy))
        # Decode workers keep no prefix cache (nor a store node): their KV arrives by handoff into reserved blocks,
        # so a cache would only hold finished requests' blocks until reservations evict them.
        decode_cache = replace(config.cache, enable_prefix_cache=False)
        hardware = hardware or {}
        costs = {w.worker_id: hardware[w.worker_id].cost_model if w.worker_id in hardware else cost_model
                 for w in spec.workers}
        check_same_layout(costs)
        caches: dict[str, CacheConfig] = {}  # per worker: its role's cache, with its own pool's size
        for w in spec.workers:
            own = hardware.get(w.worker_id)
            cache = decode_cache if w.role == "decode" else config.cache
            caches[w.worker_id] = cache if own is None else replace(cache, num_blocks=own.num_blocks)

        self.front_ids = [w.worker_id for w in spec.workers if w.role in ("mixed", "prefill")]
        # The KV store: one node per front worker's host, named by the worker's id, and per node the store holding
        # it: one store over every node (shared), or with `store_private` one per node, its worker's alone (islands).
        self.store_of: dict[str, KVStore] = {}
        if config.store_prices is not None:
            store_config = StoreConfig(config.store_dram_blocks, config.store_disk_blocks)
            if config.store_private:
                self.store_of = {wid: KVStore(store_config, [wid]) for wid in self.front_ids}
            else:
                shared = KVStore(store_config, self.front_ids)
                self.store_of = dict.fromkeys(self.front_ids, shared)
        # Its links (each node's NIC and disk), which loads from every worker share: they queue for them.
        self.store_links = StoreLinks(config.store_prices) if config.store_prices is not None else None
        back_at: dict[str, float | None] = {}  # per node, when its last loss so far ends
        for loss in sorted(config.store_node_losses, key=lambda loss: loss.at_s):
            if loss.node_id not in self.store_of:
                raise InvalidRequestError(f"no store node {loss.node_id!r} to lose: the store's nodes are the mixed "
                                          f"and prefill workers' hosts ({', '.join(self.front_ids)})"
                                          if self.store_of else "a store node loss needs a KV store")
            last_back_at = back_at.get(loss.node_id, float("-inf"))  # -inf: not lost before (at_s is finite, >= 0)
            if last_back_at is None or last_back_at >= loss.at_s:
                raise InvalidRequestError(f"store node {loss.node_id} is lost at {loss.at_s} s while lost already")
            back_at[loss.node_id] = loss.back_at_s
        self.num_store_node_losses = 0
        self.workers = {w.worker_id: SimWorker(w, sched, caches[w.worker_id], config.cache_key, costs[w.worker_id],
                                               token_for, random.Random(f"{config.seed}:{w.worker_id}"),
                                               self.store_of.get(w.worker_id), config.store_prices, self.store_links)
                        for w in spec.workers}
        for rank, worker in enumerate(self.workers.values(), start=1):  # simultaneous step ends: in worker order
            worker.rank = rank
        self.decode_ids = [w.worker_id for w in spec.workers if w.role == "decode"]
        # The live router's placement object: it hears what a live router hears (heartbeats, KV events, routed calls
        # and their tokens) and decides as it does.
        self.placement = ClusterPlacement(
            PlacementConfig(policy=config.policy, seed=config.seed, block_size=config.cache.block_size,
                            max_num_waiting=config.max_num_waiting,
                            local_prefill_threshold_tokens=config.local_prefill_threshold_tokens,
                            kv_bytes_per_token=cost_model.kv_bytes_per_token,
                            reserve_ahead_tokens=config.reserve_ahead_tokens, store_prices=config.store_prices,
                            store_private=config.store_private,
                            **self._calibration(cost_model, sched, config)),
            admission, pools)
        self._tracks_tokens = self.placement.tracks_tokens
        prefill = {w.worker_id: self.workers[w.worker_id] for w in spec.workers if w.role == "prefill"}
        self.handoffs: SimHandoffs | None = None
        if prefill:
            decode = {wid: self.workers[wid] for wid in self.decode_ids}
            self.handoffs = SimHandoffs(prefill, decode, get_link(spec.link), cost_model.kv_bytes_per_token,
                                        config.handoff_lease_s, lambda at, d: self._push(at, DELIVERY, d))
            for worker in prefill.values():
                worker.on_executed = self._stream_from(worker)
                worker.scheduler.on_preempted = self.handoffs.on_preempted
        self._next_expiry_at = config.handoff_lease_s / 10
        # Runs of quiet decode steps (SimWorker.start_step), except with the store, whose loads and saves land on any
        # worker at any time. Whatever reads the router's state first hears the runs' steps that ended
        # (`_hear_runs`); whatever changes a worker mid-run first cuts its run at the step in flight (`_settle`).
        self._decode_runs = config.decode_runs and not self.store_of
        self._runs: dict[str, SimWorker] = {}  # the workers whose step in flight is a run
        self._rank = 0  # the rank of the event being handled (time, rank, seq): 0 but for a worker's step end
        self.now = 0.0
        self._heap: list[tuple[float, int, int, int, object]] = []
        self._seq = 0
        self._flights: dict[str, Flight] = {}
        self._unreserved: dict[str, deque[Flight]] = {}  # late reservation: per prefill worker, FIFO
        # What a worker in the middle of a step handles after it, as a live worker does: a prefill worker reads
        # protocol messages between steps; a decode worker applies them as they arrive (between two layers of
        # its step) and adopts the KV of a completed leg between steps.
        self._inbox: dict[str, list[Delivery | HandoffEvent]] = {}
        self._records: list[RequestRecord] = []
        self._params: dict[int, SamplingParams] = {}
        self.prompts = SimPrompts(config.cache_key, config.cache.block_size)
        self._on_record: Callable[[RequestRecord], None] | None = None
        # Output tokens that copy their prompt (kvbaton.sim.outputs.CopyingOutputs) read it here and forget a
        # request once it ends.
        if token_for is not None and hasattr(token_for, "prompt_of"):
            token_for.prompt_of = self.prompt_of  # type: ignore[attr-defined]
        self._forget_tokens: Callable[[str], None] | None = getattr(token_for, "forget", None)

    def _calibration(self, cost_model: CostModel, sched: SchedulerConfig, config: SimConfig) -> dict[str, Any]:
        """The router's time models fitted to the cost model, for placements that weigh seconds of this GPU (the
        store's loads, the conductor's TTFT); other runs keep the router's defaults, as before the store."""
        if not self.store_of and config.policy != "conductor":
            return {}
        parallel = self.spec.workers[0].parallel
        return {"prefill_model": router_prefill_model(cost_model, parallel, config.max_model_len),
                "kv_read_s_per_token": kv_read_s_per_token(cost_model, parallel),
                "step_tokens": sched.max_num_batched_tokens}

    # ---- the loop ------------------------------------------------------------------------------------

    @property
    def state(self) -> RouterState:
        return self.placement.state

    def run(self, requests: Sequence[WorkloadRequest],
            on_record: Callable[[RequestRecord], None] | None = None) -> list[RequestRecord]:
        """Simulate `requests` (arrival_s relative to 0) to completion; records come back in request order."""
        self._on_record = on_record
        for worker in self.workers.values():  # each starts serving with its first heartbeat, as a live worker
            if worker.worker_id not in self.placement.serving(worker.spec.role):
                self._heartbeat(worker, self.now, force=True)
                self.placement.add_worker(worker.worker_id, worker.spec.role, self.spec.link)
        # Arrivals wait in their own list, sorted by (time, seq) as the heap would order them, and merge with the
        # heap's head: the same total order on (time, seq), from a heap ~requests-in-flight deep instead of
        # holding every future arrival.
        arrivals: list[tuple[float, int, int, int, object]] = []
        for request in requests:
            self._seq += 1
            arrivals.append((request.arrival_s, 0, self._seq, _ARRIVAL, request))
        arrivals.sort(key=lambda event: event[:3])
        arrivals.reverse()  # popped from the end
        for loss in self.config.store_node_losses:
            self._push(loss.at_s, _STORE_NODE, (loss.node_id, False))
            if loss.back_at_s is not None:
                self._push(loss.back_at_s, _STORE_NODE, (loss.node_id, True))
        # The loop makes no reference cycles (`test_event_loop_makes_no_reference_cycles`): everything it drops is
        # freed by reference counting, so the cyclic collector, which would otherwise scan the young objects of
        # every ~700 allocations (~5-10 % of a run), is paused while it runs and restored as it was after.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            self._run_events(arrivals)
        finally:
            if gc_was_enabled:
                gc.enable()
        if self._flights:  # every request ends with exactly one record: one left in flight is a simulator bug
            stuck = sorted(self._flights)
            raise AssertionError(f"{len(stuck)} request(s) ended the simulation without a record: "
                                 f"{', '.join(stuck[:5])}{', ...' if len(stuck) > 5 else ''}")
        order = {r.request_id: r.index for r in requests}
        return sorted(self._records, key=lambda r: order[r.request_id])

    def _run_events(self, arrivals: list[tuple[float, int, int, int, object]]) -> None:
        """Process events in (time, rank, seq) order until none is left; `arrivals` sorted last-first."""
        heap = self._heap
        heappop = heapq.heappop
        handoffs = self.handoffs
        while heap or arrivals:
            if arrivals and (not heap or arrivals[-1] < heap[0]):  # seqs differ: payloads are never compared
                now, rank, seq, kind, payload = arrivals.pop()
            else:
                now, rank, seq, kind, payload = heappop(heap)
            if kind == _STEP_DONE and payload.step_seq != seq:  # type: ignore[attr-defined]
                continue  # the end of a run that was cut: the step in flight ends earlier, at its own event
            self.now, self._rank = now, rank
            if kind == _STEP_DONE:
                self._on_step_done(payload, now)  # type: ignore[arg-type]
            elif kind == _ARRIVAL:
                self._on_arrival(payload, now)  # type: ignore[arg-type]
            elif kind == DELIVERY:
                self._on_delivery(payload, now)  # type: ignore[arg-type]
            elif kind == RETRY:
                self._start_handoff(self._flights.get(payload), now)  # type: ignore[arg-type, call-overload]
            else:
                self._on_store_node(*payload, now)  # type: ignore[misc, call-arg]
            if handoffs is not None and now >= self._next_expiry_at:
                self._expire(now)

    def _expire(self, now: float) -> None:
        """Lease expiry on every handoff leg (after the first event at or past its due time): it may free blocks on
        any worker, so every run is cut first."""
        self._next_expiry_at = now + self.config.handoff_lease_s / 10
        for worker in list(self._runs.values()):
            self._settle(worker)
        self._on_handoff_events(self.handoffs.expire(now), now)  # type: ignore[union-attr]

    def _push(self, at: float, kind: int, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at, 0, self._seq, kind, payload))

    def _kick(self, worker: SimWorker, now: float) -> None:
        """Start the worker's next step if it is idle and has something to run."""
        if worker.busy:
            return
        until = None
        if self._decode_runs:  # a run's quiet steps end before the next lease expiry (which follows any event)
            until = self._next_expiry_at if self.handoffs is not None else math.inf
        end = worker.start_step(now, until, self.config.heartbeat_s)
        for request in worker.take_finished():  # failed at scheduling time
            self._on_request_finished(worker, request, now)
        if end is None:
            self._heartbeat(worker, now, force=True)
        else:
            if worker.has_run:
                self._runs[worker.worker_id] = worker
            self._push_step_end(worker)

    def _push_step_end(self, worker: SimWorker) -> None:
        self._seq += 1
        worker.step_seq = self._seq
        heapq.heappush(self._heap, (worker.step_end_at, worker.rank, self._seq, _STEP_DONE, worker))

    def _hear_runs(self) -> None:
        """Before the router's state is read: it hears the tokens and heartbeats of the runs' steps that have ended by
        now, as it would have at each of them."""
        for worker in self._runs.values():
            self._hear_quiet(worker)

    def _settle(self, worker: SimWorker) -> None:
        """Before anything outside `worker` changes it (or reads its step): a run in flight ends with the step in
        flight now, its ended steps heard and applied (SimWorker.cut_run), and its step end is pushed again."""
        if self._runs.pop(worker.worker_id, None) is None:
            return
        self._hear_quiet(worker)
        worker.cut_run(self.now, self._rank)
        self._push_step_end(worker)

    # ---- events ----------------------------------------------------------------------------------------

    def _on_arrival(self, wr: WorkloadRequest, now: float) -> None:
        rid = wr.request_id
        if self._runs:
            self._hear_runs()
        # RouteRequest.from_tokens, keeping the block tuples: the front worker's cache reuses them and the hashes.
        prompt, prompt_blocks = self.prompts.prompt(wr)
        if wr.output_tokens < 1 or wr.num_prompt_tokens + wr.output_tokens > self.config.max_model_len:
            # Malformed (SamplingParams refuses max_tokens < 1) or too long: failed at ingress, never dropped.
            flight = self._flights[rid] = Flight(wr, "", prompt, prompt_blocks)
            self._fail(flight, f"output_tokens must be at least 1, got {wr.output_tokens}" if wr.output_tokens < 1
                       else f"prompt + output ({wr.num_prompt_tokens + wr.output_tokens} tokens) exceed "
                            f"max_model_len {self.config.max_model_len}", now)
            return
        placement = self.placement.place(RouteRequest(rid, prompt_blocks.block_hashes, len(prompt),
                                                            wr.output_tokens), now)
        if isinstance(placement, Refusal):
            flight = self._flights[rid] = Flight(wr, "", prompt, prompt_blocks)
            self._reject(flight, placement.reason, now)
            return
        front = self.workers[placement.prefiller]
        # One worker serves it whole unless it is a pair, or a mixed worker's call; at_decode: a decode worker's.
        whole = not placement.prefill_worker and front.spec.role != "mixed"
        flight = Flight(wr, front.worker_id, prompt, prompt_blocks, whole=whole,
                        at_decode=whole and front.spec.role == "decode")
        self._flights[rid] = flight
        if self.workers[placement.worker_id].spec.role == "decode":
            flight.decode = placement.worker_id
        if placement.prefill_worker:
            if not self.workers[flight.decode].can_ever_hold(wr.num_prompt_tokens + wr.output_tokens):
                self._fail(flight, f"decode worker {flight.decode} has too few KV blocks for the request", now)
                return
            flight.prefill_request = Request(rid, prompt, self._sampling(1), now, tenant=wr.tenant,
                                             slo_class=wr.slo_class, max_model_len=self.config.max_model_len)
            if self.config.reserve_ahead_tokens is None:
                self._start_handoff(flight, now)  # the prefill starts once the decode worker grants blocks
            else:
                self._unreserved.setdefault(flight.front, deque()).append(flight)
                self._reserve_in_turn(flight.front, now)
            return
        request = Request(rid, prompt, self._sampling(wr.output_tokens), now, tenant=wr.tenant,
                          slo_class=wr.slo_class, max_model_len=self.config.max_model_len)
        self._admit(front, flight, request, now)

    def _admit(self, worker: SimWorker, flight: Flight, request: Request, now: float) -> None:
        self._settle(worker)
        try:
            worker.scheduler.add_request(request, flight.prompt_blocks)
        except KvbatonError as exc:
            self._fail(flight, str(exc), now)
            return
        self._kick(worker, now)

    def _on_step_done(self, worker: SimWorker, now: float) -> None:
        if self._runs and self._runs.pop(worker.worker_id, None) is not None:
            # A run ends: the router hears its steps before the last, as their heartbeats and tokens came then,
            # before the last step's update changes what the heartbeats carry.
            self._hear_quiet(worker)
        self._on_general_step_done(worker, now)
        if now - worker.last_heartbeat_at >= self.config.heartbeat_s:  # _heartbeat's own test, without the call
            self._heartbeat(worker, now, force=False)
        if self._inbox:
            for item in self._inbox.pop(worker.worker_id, ()):
                if type(item) is HandoffEvent:
                    self._on_handoff_events([item], now)
                else:
                    self._on_handoff_events(self.handoffs.deliver(item, now), now)  # type: ignore[union-attr, arg-type]
        if self._unreserved:
            self._reserve_in_turn(worker.worker_id, now)
        self._kick(worker, now)

    def _on_store_node(self, node_id: str, back: bool, now: float) -> None:
        """The store node of `node_id`'s host is lost with all it holds (its worker serves on, and recomputes what it
        would have loaded; its writes go to other nodes, or with a private store nowhere), or back, empty. The router
        hears it with the heartbeat that follows at once, as the node's CLEARED event."""
        store = self.store_of[node_id]
        if back:
            store.add_node(node_id)
        else:
            store.remove_node(node_id)
            self.num_store_node_losses += 1
        self._heartbeat(self.workers[node_id], now, force=True)

    def _on_first_token(self, worker: SimWorker, request_id: str, token_id: int, now: float) -> None:
        flight = self._flights[request_id]
        flight.first_token_id = token_id
        if flight.decode and not flight.at_decode:  # a handoff: the router hears it from the decode worker
            self.handoffs.on_first_token(request_id, token_id, now)  # type: ignore[union-attr]
        else:
            self.placement.on_tokens(request_id, 1, now)

    def _on_general_step_done(self, worker: SimWorker, now: float) -> None:
        outputs, finished = worker.finish_step(now)
        flights = self._flights
        for out in outputs:
            flight = flights[out.request_id]
            token_times_s = flight.token_times_s
            if not token_times_s:
                self._on_first_token(worker, out.request_id, out.token.token_id, now)
            elif self._tracks_tokens:
                self.placement.on_tokens(out.request_id, 1, now)
            token_times_s.append(now)
        for request in finished:
            self._on_request_finished(worker, request, now)

    def _hear_quiet(self, worker: SimWorker) -> None:
        """The tokens and heartbeats of the steps of `worker`'s run that have ended by the event being handled and
        the router has not heard yet, as they would have come (SimWorker.take_quiet)."""
        request_ids, times = worker.take_quiet(self.now, self._rank)
        if not times:
            return
        flights = self._flights
        for request_id in request_ids:
            flights[request_id].token_times_s.extend(times)
            if self._tracks_tokens:
                for at in times:
                    self.placement.on_tokens(request_id, 1, at)
        heartbeat_s = self.config.heartbeat_s
        for at in times:
            if at - worker.last_heartbeat_at >= heartbeat_s:
                self._heartbeat(worker, at, force=False)

    def _on_request_finished(self, worker: SimWorker, request: Request, now: float) -> None:
        flight = self._flights[request.request_id]
        role = "mixed" if flight.whole else worker.spec.role
        if role != "decode":
            flight.cached_tokens = max(request.num_cached_tokens, 0)
            if request.first_scheduled_at is not None:
                flight.queue_s = request.first_scheduled_at - request.arrival_at
        if request.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
            self._fail(flight, request.finish_message or request.finish_reason.value, now)
            return
        if role != "prefill":
            self._complete(flight, now)
        # else the prefill worker's part is done; the KV is in flight

    # ---- bookkeeping ------------------------------------------------------------------------------------

    def _sampling(self, max_tokens: int) -> SamplingParams:
        params = self._params.get(max_tokens)
        if params is None:
            params = self._params[max_tokens] = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                               ignore_eos=True)
        return params

    def _heartbeat(self, worker: SimWorker, now: float, force: bool) -> None:
        if not force and now - worker.last_heartbeat_at < self.config.heartbeat_s:
            return
        worker.last_heartbeat_at = now
        placement = self.placement
        placement.on_stats(worker.stats(), now)
        if worker.cache is not None:
            events = worker.cache.take_events()
            if events and not placement.on_kv_events(worker.worker_id, events):
                placement.apply_snapshot(worker.worker_id, worker.cache.snapshot())
        store = self.store_of.get(worker.worker_id)
        if store is not None:  # the worker's host is a store node: its events travel with the heartbeat
            store_events = store.take_events(worker.worker_id)
            if store_events and not placement.on_store_events(worker.worker_id, store_events):
                placement.apply_store_snapshot(worker.worker_id, store.snapshot(worker.worker_id))

    def prompt_of(self, request_id: str) -> list[int]:
        """The prompt token ids of a request in flight."""
        return self._flights[request_id].prompt

    def close(self) -> None:
        """The sim is being dropped: cut its reference cycles (the hooks that call back into it, the workers' radix
        trees, the router's prefix trees) so that everything it holds is freed by reference counting, not by the
        cyclic collector traversing the whole run. Nothing may use the sim afterwards."""
        for worker in self.workers.values():
            worker.on_executed = None
            worker.scheduler.on_preempted = None
            if worker.cache is not None:
                worker.cache.close()
        self.handoffs = None
        self.placement.state.index.close()

    def store_report(self) -> StoreReport | None:
        """What the cluster KV store did over the run (None: no store)."""
        links = self.store_links
        if not self.store_of or links is None:
            return None
        tiers = [w.cache.tier for w in self.workers.values()
                 if w.cache is not None and isinstance(w.cache.tier, StoreTier)]
        stores = list(self.store_of.values()) if self.config.store_private else [self.store_of[self.front_ids[0]]]
        return StoreReport(sum(t.num_loaded_blocks for t in tiers), sum(t.num_remote_loaded_blocks for t in tiers),
                           sum(t.num_saved_blocks for t in tiers), sum(s.num_dropped_puts for s in stores),
                           links.num_waits, links.wait_s, self.num_store_node_losses)

    def worker_reports(self) -> list[WorkerReport]:
        reports = []
        for w in self.workers.values():
            s = w.scheduler.stats()
            tier = w.cache.tier if w.cache is not None else None
            reports.append(WorkerReport(w.worker_id, w.spec.role, w.num_steps, w.busy_s, s.num_preemptions,
                                        s.prefix_cache_hits_tokens, s.prefix_cache_queries_tokens,
                                        tier.num_loaded_blocks if tier is not None else 0,
                                        tier.num_saved_blocks if tier is not None else 0,
                                        w.scheduler.num_draft_tokens, w.scheduler.num_accepted_tokens))
        return reports

    # -- the disaggregated part: reservations, KV streaming, deliveries and adoption ----------------

    def _reserve_in_turn(self, worker_id: str, now: float) -> None:
        """Late reservation: the FIFO's head reserves while its prefill worker has at most `reserve_ahead_tokens`
        prompt tokens to compute ahead of it (queued in its scheduler, or of handoffs asking for blocks now); a
        handoff that waited a whole lease for its turn fails, as live (`PrefillHandoffs._reserve_in_turn`).

        Runs whenever that can change: an arrival, a grant, the prefill worker's step end, and any request of that
        worker ending (`ClusterSim._emit`), so that the FIFO moves on when its head fails."""
        unreserved = self._unreserved.get(worker_id)
        if not unreserved:
            return
        limit = self.config.reserve_ahead_tokens
        assert limit is not None
        lease_s = self.config.handoff_lease_s
        expired = []  # the FIFO is in arrival order: its head waited longest
        while unreserved and now - unreserved[0].workload.arrival_s > lease_s:
            expired.append(unreserved.popleft())
        for flight in expired:  # each _fail asks again for the FIFO as it now stands (no expired head left)
            if self._flights.get(flight.workload.request_id) is flight:
                self._fail(flight, f"no turn to reserve KV on {flight.decode} within the {lease_s:g} s lease", now)
        if not unreserved:
            return
        ahead_tokens = self.workers[worker_id].scheduler.num_queued_prefill_tokens() + sum(
            f.workload.num_prompt_tokens for f in self._flights.values()
            if f.front == worker_id and f.reserving and f.prefill_request is not None)
        flights = self._flights
        live = [f for f in unreserved if flights.get(f.workload.request_id) is f]  # some ended while waiting
        num_due = num_due_to_reserve(ahead_tokens, (f.workload.num_prompt_tokens for f in live), limit)
        unreserved.clear()
        unreserved.extend(live[num_due:])
        for flight in live[:num_due]:
            self._start_handoff(flight, now)

    def _start_handoff(self, flight: Flight | None, now: float) -> None:
        if flight is None or flight.prefill_request is None:
            return  # ended while waiting to retry
        self._settle(self.workers[flight.front])
        flight.reserving = True
        request = flight.prefill_request
        handoffs = self.handoffs
        assert handoffs is not None
        handoffs.start(request.request_id, flight.attempts, flight.front, flight.decode, request.num_prompt_tokens, now)

    def _stream_from(self, worker: SimWorker) -> Callable[[StepPlan, float], None]:
        return lambda plan, now: self.handoffs.on_executed(worker, plan, now)  # type: ignore[union-attr]

    def _on_handoff_events(self, events: list[HandoffEvent], now: float) -> None:
        for event in events:
            flight = self._flights.get(event.request_id)
            if flight is None:
                continue
            if event.kind == "granted" and flight.prefill_request is not None:
                request, flight.prefill_request = flight.prefill_request, None
                self._admit(self.workers[flight.front], flight, request, now)
                if self._unreserved:
                    self._reserve_in_turn(flight.front, now)
            elif event.kind == "refused":
                flight.attempts += 1
                if flight.attempts >= self.config.max_handoff_attempts:
                    self._fail(flight, f"decode worker {flight.decode} refused {flight.attempts} times: "
                                       f"{event.reason}", now)
                else:
                    self._push(now + self.config.handoff_retry_s, RETRY, event.request_id)
            elif event.kind == "complete" and event.transfer_id is not None:
                self._settle(self.workers[flight.decode])
                adopted = self.handoffs.adopt(flight.decode, event.transfer_id, now)  # type: ignore[union-attr]
                if adopted is None:
                    self._fail(flight, "handoff ended: the KV's lease ran out before the decode worker adopted it",
                               now)
                else:
                    self._adopt(flight, adopted, now)
            elif event.kind == "ended":
                front = self.workers[flight.front]
                self._settle(front)
                front.scheduler.abort_request(event.request_id, now)
                front.take_finished()
                self._fail(flight, f"handoff ended: {event.reason}", now)

    def _adopt(self, flight: Flight, adopted: AdoptedKV, now: float) -> None:
        wr = flight.workload
        request = Request(wr.request_id, list(flight.prompt), self._sampling(wr.output_tokens), wr.arrival_s,
                          tenant=wr.tenant, slo_class=wr.slo_class, max_model_len=self.config.max_model_len,
                          output_token_ids=[adopted.first_token.token_id])
        flight.transfer_bytes = self.handoffs.bytes_of.pop(wr.request_id, 0)  # type: ignore[union-attr]
        self.handoffs.forget(wr.request_id)  # type: ignore[union-attr]
        decode = self.workers[flight.decode]
        if self._runs:  # the gate reads the router's tally of tokens
            self._hear_runs()
        # The decode stage's own gate (with admission): the prefill is already paid for.
        decision = self.placement.check_decode(wr.request_id, wr.num_prompt_tokens, wr.output_tokens, flight.decode,
                                               now)
        if decision is not None and not decision.admitted:
            decode.pool.release(adopted.block_ids)
            self._reject(flight, decision.reason, now)
            return
        flight.at_decode = True
        self.placement.on_tokens(wr.request_id, 1, now)  # the router hears the first token from the decode worker
        # The client sees the first token when the decode worker adopts the KV and streams it, as live: between
        # its steps, so after the one in flight (the prefill worker sampled it earlier; the router hears it here).
        if flight.token_times_s and self.config.first_token_at == "decode":
            flight.token_times_s[0] = decode.step_end_at if decode.busy else now
        decode.offer_handoff(request, adopted.num_tokens, adopted.block_ids, now)
        self._kick(decode, now)

    def _on_delivery(self, delivery: Delivery, now: float) -> None:
        worker = self.workers[delivery.to_worker]
        self._settle(worker)
        if not worker.busy:
            self._on_handoff_events(self.handoffs.deliver(delivery, now), now)  # type: ignore[union-attr]
        elif worker.spec.role == "decode":  # grants and KV now; a completed leg is adopted after the step
            events = self.handoffs.deliver(delivery, now)  # type: ignore[union-attr]
            if events:
                self._inbox.setdefault(delivery.to_worker, []).extend(events)
        else:
            self._inbox.setdefault(delivery.to_worker, []).append(delivery)

    # -- how a request ends: its one record, and the policies that hear of it ----------------------

    def _finish_policies(self, flight: Flight, now: float) -> None:
        if self.handoffs is not None:
            self.handoffs.cancel(flight.workload.request_id, now)
            self.handoffs.bytes_of.pop(flight.workload.request_id, None)
        self.placement.on_finished(flight.workload.request_id, now)

    def _complete(self, flight: Flight, now: float) -> None:
        self._finish_policies(flight, now)
        wr = flight.workload
        times = tuple(flight.token_times_s)
        handed_off = flight.decode and flight.decode != flight.front and len(times) > 1
        workers = (flight.front, flight.decode) if handed_off else (flight.front,)
        self._emit(RequestRecord(
            request_id=wr.request_id, arrival_s=wr.arrival_s, status="completed", slo_class=wr.slo_class,
            tenant=wr.tenant, prompt_tokens=wr.num_prompt_tokens, cached_tokens=flight.cached_tokens,
            output_tokens=len(times), first_token_s=times[0], token_times_s=times, finish_s=now,
            queue_s=flight.queue_s, worker_ids=workers, transfer_bytes=flight.transfer_bytes))

    def _fail(self, flight: Flight, reason: str, now: float) -> None:
        self._finish_policies(flight, now)
        wr = flight.workload
        self._emit(RequestRecord(
            request_id=wr.request_id, arrival_s=wr.arrival_s, status="failed", reason=reason,
            slo_class=wr.slo_class, tenant=wr.tenant, prompt_tokens=wr.num_prompt_tokens,
            output_tokens=len(flight.token_times_s), finish_s=now, worker_ids=(flight.front,),
            transfer_bytes=flight.transfer_bytes))

    def _reject(self, flight: Flight, reason: str, now: float) -> None:
        self._finish_policies(flight, now)
        wr = flight.workload
        times = tuple(flight.token_times_s)
        self._emit(RequestRecord(
            request_id=wr.request_id, arrival_s=wr.arrival_s, status="rejected", reason=reason,
            slo_class=wr.slo_class, tenant=wr.tenant, prompt_tokens=wr.num_prompt_tokens,
            output_tokens=len(times), first_token_s=times[0] if times else None, token_times_s=times,
            finish_s=now, worker_ids=(flight.front,)))

    def _emit(self, record: RequestRecord) -> None:
        flight = self._flights.pop(record.request_id)
        if self._forget_tokens is not None:
            self._forget_tokens(record.request_id)
        self._records.append(record)
        if self._on_record is not None:
            self._on_record(record)
        if self._unreserved:  # late reservation: its front's FIFO may move on now (its head, or tokens ahead, ended)
            assert record.finish_s is not None, "a record is emitted when its request ends"
            self._reserve_in_turn(flight.front, record.finish_s)
