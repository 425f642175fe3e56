"""One worker process: registers with the router, then runs the engine loop and streams results back.

Loop invariant: while the engine has work, messages are drained without blocking between steps
(a prefill worker also looks between the layers of a step, and sends a new handoff's KV reservation
at once; other messages wait for the step's end) and every step's outputs go out as one
`TokenDeltas` frame; while idle the worker blocks on the socket for at most `idle_poll_s`. A
heartbeat (`Stats`, plus new `KVEvents`) goes out every `heartbeat_interval_s` either way, between steps;
the router's liveness check does not wait for those: a thread with a socket of its own sends `Alive` every
`rpc.ALIVE_INTERVAL_S` from registration on, so a step longer than the router's worker timeout (a long
prefill of a real model on a loaded host) does not get the worker removed. The
worker exits on `Shutdown` (aborting what is left, so every request still gets its final delta) or
when the router has been silent for `router_timeout_s`.

Roles: `mixed` runs whole requests; `prefill` also runs handoffs (prefill, stream the KV to the decode
worker the router named, report legs that end without the KV); `decode` also owns KV storage that
prefill workers write into and adopts completed handoffs (`kvbaton.engine.handoff_*`). A prefill
worker sends no deltas for a handed-off request: the decode worker answers for it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from socket import gethostname

import torch
import zmq

from kvbaton.core.cluster_secret import ClusterSecret
from kvbaton.core.config import CacheConfig, EngineConfig, SchedulerConfig
from kvbaton.core.errors import KvbatonError
from kvbaton.core.request import FinishReason
from kvbaton.engine.engine import Engine, RequestOutput
from kvbaton.engine.handoff import DEFAULT_LEASE_S, TransferCounters, kv_layout_for
from kvbaton.engine.handoff_decode import DecodeHandoffs
from kvbaton.engine.handoff_prefill import PrefillHandoffs
from kvbaton.model.registry import LoadedModel, load_model, load_model_front
from kvbaton.server import rpc
from kvbaton.server.base import TokenDelta, TokenLogprob
from kvbaton.server.identity import tokenizer_probe_hash
from kvbaton.server.rpc_auth import secure_dealer
from kvbaton.server.step_log import StepLog
from kvbaton.server.worker_kv import DecodeKV, PrefillLinks
from kvbaton.transfer.faults import FaultRule
from kvbaton.transfer.layout import KVLayout

ROLES = ("mixed", "prefill", "decode")

log = logging.getLogger("kvbaton.worker")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    router_address: str  # e.g. tcp://127.0.0.1:5557
    worker_id: str
    role: str = "mixed"
    model: str = "smollm2-135m"
    dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    num_blocks: int = 2048
    host_num_blocks: int = 0  # the prefix cache's host tier (kvbaton.cache.host_tier); 0 = off
    max_num_batched_tokens: int = 512
    num_speculative_tokens: int = 0  # prompt-lookup speculative decoding (scheduler/spec_decode.py); 0 = off
    enable_prefix_cache: bool = True
    # Build every linear shape a step of up to max_num_batched_tokens rows can use before registering: oneDNN
    # keeps one primitive per row bucket (~0.5 MB each, `model.llama.Linear`), so RSS then stays flat.
    warm_up: bool = False
    seed: int = 0
    num_threads: int = 0  # torch intra-op threads; 0 = torch's default (all cores)
    queue_policy: str = ""  # local waiting-queue policy; "" = the one the router names at register_ack
    register_timeout_s: float = 60.0  # give up when no register_ack/refuse arrives in time
    router_timeout_s: float = 15.0  # exit when nothing arrived from the router for this long
    idle_poll_s: float = 0.02
    kv_transport: str = "shm"  # decode workers: how prefill workers reach their KV (shm | tcp)
    kv_host: str = "127.0.0.1"  # decode workers: where the KV receiver listens
    kv_lease_s: float = DEFAULT_LEASE_S  # every reservation / held block of a handoff expires after this
    # Prefill role: None reserves a handoff's decode KV as it arrives; N waits until at most N prompt tokens are
    # left to compute ahead of it (late reservation, `engine.handoff_prefill`).
    reserve_ahead_tokens: int | None = None
    transfer_faults: tuple[FaultRule, ...] = ()  # prefill workers: scripted faults on outgoing KV (tests)
    step_log: str = ""  # write each step's shape and period here at exit (kvbaton.server.step_log)
    # The router's: the RPC and every KV link authenticate with it (core/cluster_secret.py). Required to run.
    cluster_secret: ClusterSecret | None = None
    # Rank processes behind this worker's one scheduler (kvbaton.engine.rank_group), each with num_threads threads.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    @property
    def num_ranks(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


def kv_layout_of(loaded: LoadedModel, block_size: int) -> str:
    """The layout id the engine will have (Engine computes it the same way from the same inputs)."""
    dtype_name = str(loaded.dtype).removeprefix("torch.")
    return loaded.config.kv_layout_id(dtype_name, block_size)


class _AliveThread:
    """Sends `rpc.Alive` every `interval_s` on its own DEALER socket (a zmq socket belongs to one thread) until
    stopped. It needs the GIL only for a moment per beat, which a step's torch ops release."""

    def __init__(self, context: zmq.Context, router_address: str, worker_id: str, secret: ClusterSecret,
                 interval_s: float = rpc.ALIVE_INTERVAL_S) -> None:
        self._socket = context.socket(zmq.DEALER)
        secure_dealer(self._socket, secret)
        self._socket.setsockopt(zmq.IDENTITY, rpc.alive_identity(worker_id).encode())
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 4)  # an unreachable router queues a few beats, not a backlog
        self._socket.connect(router_address)
        self._frame = rpc.encode(rpc.Alive(worker_id))
        self._interval_s = interval_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{worker_id}-alive", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                try:
                    self._socket.send(self._frame, zmq.NOBLOCK)
                except zmq.Again:
                    pass  # the router is not reachable right now: the next beat tries again
                if self._stopped.wait(self._interval_s):
                    return
        finally:
            self._socket.close()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()


class Worker:
    def __init__(self, config: WorkerConfig, loaded: LoadedModel | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if config.role not in ROLES:
            raise KvbatonError(f"role must be one of {ROLES}, got {config.role!r}")
        self.config = config
        if config.num_threads > 0:  # before the model loads: co-located workers must not oversubscribe cores
            torch.set_num_threads(config.num_threads)
        if loaded is None:  # a parallel worker's ranks load their shards; this process needs no weights
            loaded = (load_model_front(config.model, config.dtype) if config.num_ranks > 1
                      else load_model(config.model, config.dtype, config.device))
        self.loaded = loaded
        if config.warm_up and config.num_ranks == 1:  # ranks warm their own linears up (Engine's warm_up_rows)
            rows = config.max_num_batched_tokens
            self.loaded.model.warm_up_linears(rows, rows)
        self._clock = clock
        self.engine: Engine | None = None
        self._wants_logprobs: set[str] = set()
        self._in_flight: set[str] = set()  # added to the engine, final delta not yet sent
        self._last_event_seq = 0
        self._num_step_calls = 0
        self._step_log = StepLog(config.step_log) if config.step_log else None
        self._checked_at_step_call = -1  # invariants are checked once per idle period
        self._invariant_error = ""
        self._last_router_at = 0.0
        self._stopping = ""
        self.prefill: PrefillHandoffs | None = None
        self.decode: DecodeHandoffs | None = None
        self._decode_kv: DecodeKV | None = None
        self._prefill_links: PrefillLinks | None = None
        self._deferred: list[rpc.Message] = []  # read between two layers of a step, handled after it (`_drain`)

    def register_message(self) -> rpc.Register:
        cfg = self.config
        return rpc.Register(cfg.worker_id, cfg.role, cfg.model, self.loaded.revision,
                            kv_layout_of(self.loaded, cfg.block_size), cfg.block_size, cfg.num_blocks,
                            tokenizer_probe_hash(self.loaded.tokenizer), os.getpid(),
                            self._decode_kv.address if self._decode_kv is not None else "", gethostname())

    def run(self) -> str:
        """Serve until told to stop; returns why it stopped. Raises KvbatonError if refused or orphaned."""
        secret = self.config.cluster_secret
        if secret is None:
            raise KvbatonError(f"worker {self.config.worker_id} has no cluster secret: give it the router's "
                               "(--cluster-secret-file FILE or the KVBATON_CLUSTER_SECRET variable)")
        context = zmq.Context()
        socket = context.socket(zmq.DEALER)
        secure_dealer(socket, secret)
        socket.setsockopt(zmq.IDENTITY, self.config.worker_id.encode())
        socket.setsockopt(zmq.LINGER, 1000)
        socket.connect(self.config.router_address)
        cfg = self.config
        layout = kv_layout_for(self.loaded, cfg.block_size, cfg.tensor_parallel_size, cfg.pipeline_parallel_size)
        alive: _AliveThread | None = None
        try:
            if cfg.role == "decode":  # storage first: its address goes into the registration
                self._decode_kv = DecodeKV(cfg.worker_id, layout, cfg.num_blocks, cfg.kv_transport, cfg.kv_host,
                                           secret=secret, shared=cfg.num_ranks > 1)
            ack = self._register(socket)
            alive = _AliveThread(context, cfg.router_address, cfg.worker_id, secret)
            try:
                self._start(socket, layout, ack, secret)
            except Exception as exc:  # the router counts this worker in: tell it why it will not serve
                socket.send(rpc.encode(rpc.Goodbye(cfg.worker_id, f"failed to start: {exc}")))
                raise
            return self._serve(socket, ack.heartbeat_interval_s)
        except KeyboardInterrupt:
            # SIGTERM or Ctrl-C (a worker being drained): leave without ending the requests here, so the router
            # moves them to other workers at once (migration) instead of streaming an abort to their clients.
            socket.send(rpc.encode(rpc.Goodbye(cfg.worker_id, "stopped by a signal")), zmq.NOBLOCK)
            raise
        finally:
            if alive is not None:
                alive.stop()
            socket.close()
            context.term()
            if self._step_log is not None:
                self._step_log.write()
            if self.engine is not None:
                self.engine.close()  # its rank processes, if any
            if self._prefill_links is not None:
                self._prefill_links.close()
            if self._decode_kv is not None:
                self.engine = self.decode = None  # drop every view of the shared region before unmapping it
                self._decode_kv.close()

    def _start(self, socket: zmq.Socket, layout: KVLayout, ack: rpc.RegisterAck, secret: ClusterSecret) -> None:
        """Build the engine (with the queue policy the router named) and the role's handoff drivers."""
        cfg = self.config
        self.engine = self._build_engine(cfg.queue_policy or ack.queue_policy)
        if self._decode_kv is not None:
            self.decode = DecodeHandoffs(self.engine, layout, self._decode_kv.receiver, cfg.kv_lease_s, self._clock)
            self.engine.between_layers = self.decode.pump  # grants and KV between layers; adoption after
        if cfg.role == "prefill":
            self._prefill_links = PrefillLinks(cfg.worker_id, layout, cfg.transfer_faults, self._clock, secret=secret)
            self.prefill = PrefillHandoffs(self.engine, layout, self._prefill_links, self._prefill_links.connect,
                                           cfg.kv_lease_s, self._clock, cfg.reserve_ahead_tokens)
            if cfg.reserve_ahead_tokens is None:  # a late reservation waits for its turn between steps anyway
                self.engine.between_layers = lambda: self._read_mid_step(socket)

    # -- registration ---------------------------------------------------------------------------

    def _register(self, socket: zmq.Socket) -> rpc.RegisterAck:
        socket.send(rpc.encode(self.register_message()))
        deadline = self._clock() + self.config.register_timeout_s
        while self._clock() < deadline:
            if not socket.poll(100):
                continue
            message = rpc.decode(socket.recv())
            if isinstance(message, rpc.RegisterAck):
                return message
            if isinstance(message, rpc.RegisterRefuse):
                raise KvbatonError(f"router refused worker {self.config.worker_id}: {message.reason}")
            if isinstance(message, rpc.Shutdown):
                raise KvbatonError(f"router shut down before registering worker {self.config.worker_id}")
        raise KvbatonError(f"no answer from the router at {self.config.router_address} within "
                           f"{self.config.register_timeout_s:g} s (a router whose cluster secret differs cannot be "
                           "reached either)")

    def _build_engine(self, queue_policy: str) -> Engine:
        cfg = self.config
        engine_config = EngineConfig(
            model=cfg.model, dtype=cfg.dtype, device=cfg.device, seed=cfg.seed,
            tensor_parallel_size=cfg.tensor_parallel_size, pipeline_parallel_size=cfg.pipeline_parallel_size,
            rank_num_threads=cfg.num_threads,
            cache=CacheConfig(cfg.block_size, cfg.num_blocks, cfg.enable_prefix_cache, cfg.host_num_blocks),
            scheduler=SchedulerConfig(max_num_batched_tokens=cfg.max_num_batched_tokens, queue_policy=queue_policy,
                                      num_speculative_tokens=cfg.num_speculative_tokens),
        )
        decode_kv = self._decode_kv
        kv_region = decode_kv.region if decode_kv is not None and cfg.num_ranks > 1 else None
        kv_cache = decode_kv.kv_cache if decode_kv is not None and kv_region is None else None
        engine = Engine(engine_config, loaded=self.loaded, clock=self._clock, kv_cache=kv_cache, kv_region=kv_region,
                        warm_up_rows=cfg.max_num_batched_tokens if cfg.warm_up else 0)
        if engine.kv_layout != kv_layout_of(self.loaded, cfg.block_size):
            raise KvbatonError(f"engine KV layout {engine.kv_layout} differs from the registered one")
        return engine

    # -- the loop -------------------------------------------------------------------------------

    def _serve(self, socket: zmq.Socket, heartbeat_interval_s: float) -> str:
        engine = self.engine
        assert engine is not None
        self._last_router_at = self._clock()
        next_heartbeat_at = self._last_router_at
        # Handoffs wait on the transport as well as on the router socket: poll both briefly when idle.
        idle_poll_ms = int(self.config.idle_poll_s * 1000) if self.config.role == "mixed" else 2
        while not self._stopping:
            if not engine.has_unfinished_requests():
                if self._step_log is not None:
                    self._step_log.on_idle()
                socket.poll(idle_poll_ms)
            self._drain(socket)
            self._pump_handoffs(socket)
            if engine.has_unfinished_requests():
                self._step(socket)
            now = self._clock()
            if now >= next_heartbeat_at:
                self._send_heartbeat(socket, now)
                next_heartbeat_at = now + heartbeat_interval_s
            if not self._stopping and now - self._last_router_at > self.config.router_timeout_s:
                self._drain(socket)  # after a step longer than the timeout, the router's pings are still unread
            if not self._stopping and now - self._last_router_at > self.config.router_timeout_s:
                self._stopping = f"router silent for more than {self.config.router_timeout_s:g} s"
                self._finish_all(socket)
                raise KvbatonError(f"worker {self.config.worker_id}: {self._stopping}; exiting")
        self._finish_all(socket)
        self._send_heartbeat(socket, self._clock())
        socket.send(rpc.encode(rpc.Goodbye(self.config.worker_id, self._stopping)))
        return self._stopping

    def _drain(self, socket: zmq.Socket) -> None:
        if self._deferred:
            deferred, self._deferred = self._deferred, []
            for message in deferred:
                self._handle(socket, message)
        while not self._stopping:
            try:
                payload = socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._last_router_at = self._clock()
            message = self._decode(socket, payload)
            if message is not None:
                self._handle(socket, message)

    def _read_mid_step(self, socket: zmq.Socket) -> None:
        """Between two layers of a prefill worker's step: a handoff routed here asks its decode worker for blocks
        now instead of after the step, so the reservation's round trip overlaps the step (the simulator's model:
        a handoff reserves as it arrives). Only `PrefillHandoffs.submit` runs here, which touches the handoff
        legs and the transport, not the engine; every other message waits for `_drain`, in arrival order. A
        handoff is the first message about its request, so taking it ahead of deferred ones reorders nothing
        that concerns one request."""
        while not self._stopping and socket.get(zmq.EVENTS) & zmq.POLLIN:
            message = self._decode(socket, socket.recv(zmq.NOBLOCK))
            self._last_router_at = self._clock()
            if message is None:
                continue
            if isinstance(message, rpc.AddRequest) and message.decode_worker and self.prefill is not None:
                self._add_handoff(socket, message)
            else:
                self._deferred.append(message)

    def _decode(self, socket: zmq.Socket, payload: bytes) -> rpc.Message | None:
        """The router's message, or None for a frame this worker cannot read (a router of another version): it is
        dropped, and the request it names, if any, fails with the reason, so one frame never stops the worker."""
        try:
            return rpc.decode(payload)
        except rpc.ProtocolError as exc:
            log.error("worker %s dropped an unreadable message: %s", self.config.worker_id, exc)
            if exc.request_id:
                self._send_failed(socket, exc.request_id, 0, f"worker {self.config.worker_id} cannot read it: {exc}")
            return None

    def _send_failed(self, socket: zmq.Socket, request_id: str, num_prompt_tokens: int, error: str) -> None:
        """The final delta of a request this worker does not take."""
        failed = TokenDelta(request_id, (), "", True, "error", num_prompt_tokens, error=error,
                            worker_id=self.config.worker_id)
        socket.send(rpc.encode(rpc.TokenDeltas(self.config.worker_id, (failed,))))

    def _handle(self, socket: zmq.Socket, message: rpc.Message) -> None:
        engine = self.engine
        assert engine is not None
        if isinstance(message, rpc.AddRequest) and (message.decode_worker or message.prefill_worker):
            self._add_handoff(socket, message)
        elif isinstance(message, rpc.AddRequest):
            try:
                engine.add_request(list(message.prompt_token_ids), message.sampling, request_id=message.request_id,
                                   tenant=message.tenant, slo_class=message.slo_class,
                                   output_token_ids=message.output_token_ids)
            except KvbatonError as exc:
                self._send_failed(socket, message.request_id, len(message.prompt_token_ids), str(exc))
                return
            self._in_flight.add(message.request_id)
            if message.sampling.logprobs is not None:
                self._wants_logprobs.add(message.request_id)
        elif isinstance(message, rpc.Abort):
            for request_id in message.request_ids:
                if self.prefill is not None and self.prefill.owns(request_id):
                    self.prefill.abort(request_id)
                elif self.decode is not None and self.decode.owns(request_id):
                    self._emit(socket, [out for out in [self.decode.abort(request_id)] if out is not None])
                else:
                    engine.abort_request(request_id)
        elif isinstance(message, rpc.HandoffFailed):
            if self.decode is not None:
                self._emit(socket, self.decode.on_prefill_failed(message.request_id, message.reason, message.refused))
        elif isinstance(message, rpc.SnapshotRequest):
            self._send_snapshot(socket)
        elif isinstance(message, rpc.ResetPrefixCache):
            engine.reset_prefix_cache()  # its KV events go out with the next heartbeat
        elif isinstance(message, rpc.Shutdown):
            self._stopping = f"shutdown: {message.reason}"
        # Ping only refreshes _last_router_at; a late RegisterAck is harmless.

    def _add_handoff(self, socket: zmq.Socket, message: rpc.AddRequest) -> None:
        """A prefill leg (decode_worker set) or a decode leg (prefill_worker set) of a disaggregated request."""
        if message.decode_worker and self.prefill is not None:
            self.prefill.submit(message.request_id, message.prompt_token_ids, message.sampling, message.decode_worker,
                                message.decode_address, message.tenant, message.slo_class)
            return
        if message.prefill_worker and self.decode is not None:
            try:
                self.decode.expect(message.request_id, message.prompt_token_ids, message.sampling,
                                   message.prefill_worker, message.kv_load_failure_policy, message.tenant,
                                   message.slo_class)
            except KvbatonError as exc:
                self._emit(socket, [RequestOutput(message.request_id, (), "", (), True, FinishReason.ERROR,
                                                  len(message.prompt_token_ids), 0, str(exc))])
                return
            self._in_flight.add(message.request_id)
            if message.sampling.logprobs is not None:
                self._wants_logprobs.add(message.request_id)
            return
        error = f"worker {self.config.worker_id} has role {self.config.role!r} and cannot take this handoff leg"
        self._send_failed(socket, message.request_id, len(message.prompt_token_ids), error)

    def _pump_handoffs(self, socket: zmq.Socket) -> None:
        if self.prefill is not None:
            self.prefill.poll()
            for report in self.prefill.take_reports():
                socket.send(rpc.encode(rpc.HandoffEnded(self.config.worker_id, report.request_id,
                                                        report.decode_worker, report.outcome, report.reason)))
        if self.decode is not None:
            self._emit(socket, self.decode.poll())

    def _step(self, socket: zmq.Socket) -> None:
        assert self.engine is not None
        started_s = time.perf_counter()
        outputs = self.engine.step()
        self._num_step_calls += 1
        if self.prefill is not None:
            outputs = self.prefill.on_outputs(outputs)
        self._emit(socket, outputs)
        if self.engine.failed and not self._stopping:
            # A rank died: its requests just ended with the error; the Goodbye makes the router drop this worker.
            self._stopping = f"cannot run: {self.engine.failed}"
        if self._step_log is not None and self.engine.last_plan is not None:
            self._step_log.on_step(self.engine.last_plan, started_s, time.perf_counter(),
                                   self.engine.has_unfinished_requests())

    def _emit(self, socket: zmq.Socket, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                self._in_flight.discard(out.request_id)
        if outputs:
            deltas = tuple(self._to_delta(out) for out in outputs)
            socket.send(rpc.encode(rpc.TokenDeltas(self.config.worker_id, deltas)))

    def _to_delta(self, out: RequestOutput) -> TokenDelta:
        logprobs: tuple[TokenLogprob, ...] = ()
        if out.request_id in self._wants_logprobs:
            logprobs = tuple(TokenLogprob(t.token_id, t.logprob, t.top_logprobs) for t in out.new_logprobs)
            if out.finished:
                self._wants_logprobs.discard(out.request_id)
        reason = out.finish_reason.value if out.finish_reason is not None else None
        prompt_logprobs = tuple(TokenLogprob(t.token_id, t.logprob, t.top_logprobs, t.rank)
                                for t in out.prompt_logprobs) if out.prompt_logprobs else ()
        return TokenDelta(out.request_id, out.new_token_ids, out.new_text, out.finished, reason,
                          out.num_prompt_tokens, out.num_cached_tokens, logprobs, out.error, self.config.worker_id,
                          {} if out.queue_time_s is None else {"queue_s": out.queue_time_s},
                          prompt_logprobs=prompt_logprobs)

    def _finish_all(self, socket: zmq.Socket) -> None:
        """Abort whatever is left and step until each request has sent its final delta."""
        engine = self.engine
        assert engine is not None
        for request_id in sorted(self._in_flight):
            if self.decode is not None and self.decode.owns(request_id):
                self._emit(socket, [out for out in [self.decode.abort(request_id)] if out is not None])
            engine.abort_request(request_id)
        if self.prefill is not None:
            for request_id in self.prefill.live_request_ids():
                self.prefill.abort(request_id, "prefill worker stopping")
        while engine.has_unfinished_requests():
            self._step(socket)
        self._pump_handoffs(socket)  # let the aborts out

    # -- heartbeat, events, snapshot ------------------------------------------------------------

    def _send_heartbeat(self, socket: zmq.Socket, now: float) -> None:
        engine = self.engine
        assert engine is not None
        if engine.prefix_cache is not None:
            events = engine.prefix_cache.take_events()
            if events:
                self._last_event_seq = events[-1].seq
                socket.send(rpc.encode(rpc.KVEvents(self.config.worker_id, tuple(e.to_wire() for e in events))))
        if not self._has_work() and self._checked_at_step_call != self._num_step_calls:
            self._checked_at_step_call = self._num_step_calls
            try:
                engine.check_invariants()
                for driver in (self.prefill, self.decode):
                    if driver is not None:
                        driver.check_invariants()
                self._invariant_error = ""
            except AssertionError as exc:
                self._invariant_error = str(exc) or "check_invariants failed"
        s = engine.stats()
        socket.send(rpc.encode(rpc.Stats(
            self.config.worker_id, s.num_waiting, s.num_running, s.num_queued_prefill_tokens, s.num_used_blocks,
            s.num_free_blocks, s.num_cached_blocks, s.prefix_cache_queries_tokens, s.prefix_cache_hits_tokens,
            s.num_preemptions, s.num_steps, now, self._invariant_error, *self._transfer_stats(),
            engine.scheduler.num_draft_tokens, engine.scheduler.num_accepted_tokens, s.num_host_cached_blocks,
            s.num_host_loaded_blocks, s.num_host_saved_blocks, s.num_evictable_blocks)))

    def _has_work(self) -> bool:
        """Anything running or in a handoff, including a reservation made before the router's expect arrived (or
        after a cancel older than a lease): its blocks are held outside the engine until it ends."""
        assert self.engine is not None
        return self.engine.has_unfinished_requests() or any(
            driver is not None and driver.num_live > 0 for driver in (self.prefill, self.decode)) or (
            self.decode is not None and self.decode.destination.num_reserved_blocks > 0)

    def _transfer_stats(self) -> tuple[int | float, ...]:
        counters, num_live, num_held = TransferCounters(), 0, 0
        if self.prefill is not None:
            counters, num_live = self.prefill.counters, self.prefill.num_live
            num_held = self.prefill.source.num_held_blocks
        elif self.decode is not None:
            counters, num_live = self.decode.counters, self.decode.num_live
            num_held = self.decode.destination.num_reserved_blocks
        return (*counters.as_tuple(), num_live, num_held)

    def _send_snapshot(self, socket: zmq.Socket) -> None:
        cache = self.engine.prefix_cache if self.engine is not None else None
        events = []
        if cache is not None:
            pending = cache.take_events()  # already reflected in the snapshot below
            if pending:
                self._last_event_seq = pending[-1].seq
            events = cache.snapshot()
        seq = max([self._last_event_seq, *(e.seq for e in events)])
        socket.send(rpc.encode(rpc.SnapshotResponse(self.config.worker_id, seq, tuple(e.to_wire() for e in events))))
