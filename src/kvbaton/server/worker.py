"""One worker process: registers with its router(s), then runs the engine loop and streams results back.

Several routers may share the worker (`server/worker_links.py`): it registers with each, sends each its heartbeats
and KV events, takes requests from all, and answers each request to the router that sent it. A router silent for
`router_link_timeout_s` while another is heard is given up (its requests aborted, their blocks freed) and registered
with again until it answers; while every router is silent nothing is given up (they may only be slow). A router that
does not know the worker (restarted at its address, a lone one too) answers its heartbeat with `RegisterAgain`: its
requests there are aborted and the worker registers again, with a snapshot. A router that shuts down ends only its
own requests.

Loop invariant: while the engine has work, messages are drained without blocking between steps
(a prefill worker also looks between the layers of a step, and sends a new handoff's KV reservation
at once; other messages wait for the step's end) and every step's outputs go out as one
`TokenDeltas` frame; while idle the worker blocks on the socket for at most `idle_poll_s`. A
heartbeat (`Stats`, with the new KV events in the same frame: `rpc.Heartbeat`) goes out every
`heartbeat_interval_s` either way, between steps;
the router's liveness check does not wait for those: a thread with a socket of its own sends `Alive` every
`rpc.ALIVE_INTERVAL_S` from registration on, so a step longer than the router's worker timeout (a long
prefill of a real model on a loaded host) does not get the worker removed. The
worker exits on `Shutdown` from its last router (aborting what is left, so every request still gets its final
delta) or when every router has been silent for `router_timeout_s`.

Roles: `mixed` runs whole requests; `prefill` also runs handoffs (prefill, stream the KV to the decode
worker the router named, report legs that end without the KV); `decode` also owns KV storage that
prefill workers write into and adopts completed handoffs (`kvbaton.engine.handoff_*`). A prefill
worker sends no deltas for a handed-off request: the decode worker answers for it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from socket import gethostname

import torch
import zmq

from kvbaton.core.cluster_secret import ClusterSecret
from kvbaton.core.config import CacheConfig, EngineConfig, SchedulerConfig
from kvbaton.core.errors import KvbatonError
from kvbaton.engine.engine import Engine
from kvbaton.engine.handoff import DEFAULT_LEASE_S, TransferCounters, kv_layout_for
from kvbaton.engine.handoff_decode import DecodeHandoffs
from kvbaton.engine.handoff_prefill import PrefillHandoffs
from kvbaton.engine.kv_staging import KVStaging
from kvbaton.model.registry import LoadedModel, load_model, load_model_front
from kvbaton.server import rpc
from kvbaton.server.base import TokenDelta
from kvbaton.server.identity import tokenizer_probe_hash
from kvbaton.server.step_log import StepLog
from kvbaton.server.store_client import KnownStoreNodes, StoreNodes
from kvbaton.server.worker_kv import DecodeKV, PrefillLinks
from kvbaton.server.worker_links import REGISTER_RESEND_S, RouterLink, RouterLinks
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
    router_timeout_s: float = 15.0  # exit when nothing arrived from any router for this long
    # More routers to serve over the same engine (server/worker_links.py); each gets its own registration.
    more_router_addresses: tuple[str, ...] = ()
    # One of several routers silent this long (while another is heard) is given up: its requests are aborted and
    # their blocks freed; the worker keeps sending it registrations, so a router that comes back gets it again.
    router_link_timeout_s: float = 5.0
    idle_poll_s: float = 0.02
    kv_transport: str = "shm"  # decode workers: how prefill workers reach their KV (shm | tcp)
    kv_host: str = "127.0.0.1"  # decode workers: where the KV receiver listens
    kv_lease_s: float = DEFAULT_LEASE_S  # every reservation / held block of a handoff expires after this
    # Prefill role: None reserves a handoff's decode KV as it arrives; N waits until at most N prompt tokens are
    # left to compute ahead of it (late reservation, `engine.handoff_prefill`).
    reserve_ahead_tokens: int | None = None
    transfer_faults: tuple[FaultRule, ...] = ()  # prefill workers: scripted faults on outgoing KV (tests)
    step_log: str = ""  # write each step's shape and period here at exit (kvbaton.server.step_log)
    kv_store_address: str = ""  # this host's KV store node (kvbaton.server.store_server); "" = none
    # Every store node of the cluster (one per host, this host's among them): loads go on from the others over TCP
    # for what this host's lacks (`store_client.StoreNodes`). Empty: this host's node only.
    kv_store_nodes: tuple[str, ...] = ()
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
        # The store nodes this worker's loads read (its flags', then every one its routers name); None: no store.
        self.store_nodes = (KnownStoreNodes((config.kv_store_address, *config.kv_store_nodes))
                            if config.kv_store_address else None)
        self.engine: Engine | None = None
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
        # Read between two layers of a step, handled after it (`_drain`), with the link each came on.
        self._deferred: list[tuple[RouterLink, rpc.Message]] = []
        self._links = RouterLinks(config.worker_id, config.cluster_secret, clock)  # connected by `run`

    def register_message(self) -> rpc.Register:
        cfg = self.config
        return rpc.Register(cfg.worker_id, cfg.role, cfg.model, self.loaded.revision,
                            kv_layout_of(self.loaded, cfg.block_size), cfg.block_size, cfg.num_blocks,
                            tokenizer_probe_hash(self.loaded.tokenizer), os.getpid(),
                            self._decode_kv.address if self._decode_kv is not None else "", gethostname(),
                            cfg.tensor_parallel_size, cfg.pipeline_parallel_size, cfg.kv_store_address)

    def run(self) -> str:
        """Serve until told to stop; returns why it stopped. Raises KvbatonError if refused or orphaned."""
        secret = self.config.cluster_secret
        if secret is None:
            raise KvbatonError(f"worker {self.config.worker_id} has no cluster secret: give it the router's "
                               "(--cluster-secret-file FILE or the KVBATON_CLUSTER_SECRET variable)")
        cfg = self.config
        context = zmq.Context()
        links = self._links = RouterLinks(cfg.worker_id, secret, self._clock, context)
        for address in (cfg.router_address, *cfg.more_router_addresses):
            links.add(address)
        layout = kv_layout_for(self.loaded, cfg.block_size, cfg.tensor_parallel_size, cfg.pipeline_parallel_size)
        try:
            if cfg.role == "decode":  # storage first: its address goes into the registration
                self._decode_kv = DecodeKV(cfg.worker_id, layout, cfg.num_blocks, cfg.kv_transport, cfg.kv_host,
                                           secret=secret, pin_memory=cfg.device.startswith("cuda"),
                                           shared=cfg.num_ranks > 1)
            ack = self._register()
            try:
                self._start(layout, ack, secret)
            except Exception as exc:  # the routers count this worker in: tell them why it will not serve
                links.broadcast(rpc.Goodbye(cfg.worker_id, f"failed to start: {exc}"))
                raise
            return self._serve(ack.heartbeat_interval_s)
        except KeyboardInterrupt:
            # SIGTERM or Ctrl-C (a worker being drained): leave without ending the requests here, so the router
            # moves them to other workers at once (migration) instead of streaming an abort to their clients.
            links.broadcast(rpc.Goodbye(cfg.worker_id, "stopped by a signal"))
            raise
        finally:
            links.close()
            context.term()
            if self._step_log is not None:
                self._step_log.write()
            if self.engine is not None:
                self.engine.close()  # its rank processes and store IO thread, if any
            if self._prefill_links is not None:
                self._prefill_links.close()
            if self._decode_kv is not None:
                self.engine = self.decode = None  # drop every view of the shared region before unmapping it
                self._decode_kv.close()

    def _start(self, layout: KVLayout, ack: rpc.RegisterAck, secret: ClusterSecret) -> None:
        """Build the engine (with the queue policy the router named) and the role's handoff drivers."""
        cfg = self.config
        self.engine = self._build_engine(cfg.queue_policy or ack.queue_policy)
        if self._decode_kv is not None:
            landing = self._decode_kv.kv_cache
            staging = (KVStaging(self.engine.storage.kv_cache, host_kv=landing)
                       if landing is not self.engine.storage.kv_cache else None)
            self.decode = DecodeHandoffs(self.engine, layout, self._decode_kv.receiver, cfg.kv_lease_s, self._clock,
                                         staging)
            self.engine.between_layers = self.decode.pump  # grants and KV between layers; adoption after
        if cfg.role == "prefill":
            self._prefill_links = PrefillLinks(cfg.worker_id, layout, cfg.transfer_faults, self._clock, secret=secret)
            self.prefill = PrefillHandoffs(self.engine, layout, self._prefill_links, self._prefill_links.connect,
                                           cfg.kv_lease_s, self._clock, cfg.reserve_ahead_tokens)
            if cfg.reserve_ahead_tokens is None:  # a late reservation waits for its turn between steps anyway
                self.engine.between_layers = self._read_mid_step

    # -- registration ---------------------------------------------------------------------------

    def _register(self) -> rpc.RegisterAck:
        """Register with every router; returns the first acknowledgement (the others may come later, in the loop)."""
        deadline = self._clock() + self.config.register_timeout_s
        first: rpc.RegisterAck | None = None
        while first is None and self._clock() < deadline:
            self._send_registrations(self._clock())
            self._links.poll(100)
            for link, payload in self._links.frames():
                try:
                    message = rpc.decode(payload)
                except rpc.ProtocolError:
                    continue
                if isinstance(message, rpc.RegisterAck):
                    self._on_registered(link)
                    first = first or message
                elif isinstance(message, rpc.RegisterRefuse):
                    raise KvbatonError(f"router refused worker {self.config.worker_id}: {message.reason} "
                                       f"(router {link.address})")
                elif isinstance(message, rpc.Shutdown):
                    raise KvbatonError(f"router shut down before registering worker {self.config.worker_id} "
                                       f"(router {link.address})")
                elif isinstance(message, rpc.AddRouter):  # a router sends its peers right after its acknowledgement
                    self._links.add(message.address)
                elif isinstance(message, rpc.StoreNodesKnown):
                    self._on_store_nodes(message)
        if first is not None:
            return first
        addresses = ", ".join(link.address for link in self._links.links)
        raise KvbatonError(f"no answer from the router at {addresses} within "
                           f"{self.config.register_timeout_s:g} s (a router whose cluster secret differs cannot be "
                           "reached either)")

    def _on_store_nodes(self, message: rpc.StoreNodesKnown) -> None:
        """A router's list of the store nodes: loads read on from the new ones (over TCP) from the next one on."""
        if self.store_nodes is not None and self.store_nodes.add(message.addresses.split(",")):
            log.info("worker %s: KV store nodes %s", self.config.worker_id, message.addresses)

    def _send_registrations(self, now: float) -> None:
        """Register with each open link not registered: at once while its router is unreachable (the send fails),
        again REGISTER_RESEND_S after one that went out unanswered."""
        payload = b""
        for link in self._links.links:
            if link.registered or link.closed or link.leaving or now - link.register_sent_at < REGISTER_RESEND_S:
                continue
            payload = payload or rpc.encode(self.register_message())
            if link.send_bytes(payload):
                link.register_sent_at = now

    def _on_registered(self, link: RouterLink) -> None:
        """A router acknowledged this worker: it gets heartbeats and KV events from now on, and (when it joined or
        came back after the engine started) a snapshot to rebuild its prefix index from."""
        if link.registered:
            return  # a late second acknowledgement
        link.registered = True
        link.last_heard_at = self._clock()
        self._links.start_alive(link)
        if self.engine is not None:
            log.info("worker %s registered with router %s", self.config.worker_id, link.address)
            self._send_snapshot(link)

    def _build_engine(self, queue_policy: str) -> Engine:
        cfg = self.config
        engine_config = EngineConfig(
            model=cfg.model, dtype=cfg.dtype, device=cfg.device, seed=cfg.seed,
            tensor_parallel_size=cfg.tensor_parallel_size, pipeline_parallel_size=cfg.pipeline_parallel_size,
            rank_num_threads=cfg.num_threads,
            cache=CacheConfig(cfg.block_size, cfg.num_blocks, cfg.enable_prefix_cache),
            scheduler=SchedulerConfig(max_num_batched_tokens=cfg.max_num_batched_tokens, queue_policy=queue_policy,
                                      num_speculative_tokens=cfg.num_speculative_tokens),
        )
        # On the CPU a decode worker's engine computes in the memory its KV lands in; a device's storage is its own,
        # and handoffs are staged through the landing memory (engine/kv_staging.py, `_start_handoffs`). A parallel
        # worker's ranks map the decode worker's shared region.
        decode_kv = self._decode_kv
        kv_region = decode_kv.region if decode_kv is not None and cfg.num_ranks > 1 else None
        on_host = cfg.device == "cpu"
        kv_cache = decode_kv.kv_cache if decode_kv is not None and kv_region is None and on_host else None
        store_link = None
        if cfg.kv_store_address:
            address, nodes, secret = cfg.kv_store_address, self.store_nodes, cfg.cluster_secret
            store_link = lambda: StoreNodes(address, nodes, secret)  # noqa: E731 - built on the store IO thread
        engine = Engine(engine_config, loaded=self.loaded, clock=self._clock, kv_cache=kv_cache, kv_region=kv_region,
                        warm_up_rows=cfg.max_num_batched_tokens if cfg.warm_up else 0, create_store_link=store_link)
        engine.worker_id = cfg.worker_id
        if engine.kv_layout != kv_layout_of(self.loaded, cfg.block_size):
            raise KvbatonError(f"engine KV layout {engine.kv_layout} differs from the registered one")
        return engine

    # -- the loop -------------------------------------------------------------------------------

    def _serve(self, heartbeat_interval_s: float) -> str:
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
                self._links.poll(idle_poll_ms)
            self._drain()
            self._pump_handoffs()
            if engine.has_unfinished_requests():
                self._step()
            now = self._clock()
            if now >= next_heartbeat_at:
                self._send_heartbeat(now)
                next_heartbeat_at = now + heartbeat_interval_s
                self._send_registrations(now)
            self._check_links(now)
            if not self._stopping and now - self._last_router_at > self.config.router_timeout_s:
                self._drain()  # after a step longer than the timeout, the routers' pings are still unread
            if not self._stopping and now - self._last_router_at > self.config.router_timeout_s:
                self._stopping = f"every router silent for more than {self.config.router_timeout_s:g} s"
                self._finish_all()
                raise KvbatonError(f"worker {self.config.worker_id}: {self._stopping}; exiting")
        self._finish_all()
        self._send_heartbeat(self._clock())
        self._links.broadcast(rpc.Goodbye(self.config.worker_id, self._stopping))
        return self._stopping

    def _check_links(self, now: float) -> None:
        """Give up a router silent past `router_link_timeout_s` while another is heard (its requests are aborted, so
        their blocks are freed) and register with it again until it answers. While every router is silent nothing is
        given up (they may only be slow); the worker exits once none has been heard for `router_timeout_s`. Close a
        link whose router shut down once its requests have ended."""
        links = self._links
        for link in links.links:
            if link.leaving and not link.request_ids:
                link.send(rpc.Goodbye(self.config.worker_id, "its router shut down; serving the others"))
                links.close_link(link)
        timeout_s = self.config.router_link_timeout_s
        registered = links.registered
        if not any(now - link.last_heard_at > timeout_s for link in registered):
            return
        self._drain()  # after a long step, the pings are still unread
        if not any(now - link.last_heard_at <= timeout_s for link in registered):
            # Every router silent: perhaps only slow (a loaded host), so nothing is given up; the worker-wide
            # router_timeout_s decides. A router restarted at its address tells this worker to register again
            # (`rpc.RegisterAgain`) as soon as it hears its heartbeat.
            return
        for link in registered:
            if now - link.last_heard_at > timeout_s:
                log.warning("worker %s gives up router %s (silent for %.1f s); %d request(s) aborted",
                            self.config.worker_id, link.address, now - link.last_heard_at, len(link.request_ids))
                link.registered = False
                link.register_sent_at = float("-inf")  # try it again at once: it may be back
                self._abort(sorted(link.request_ids))

    def _drain(self) -> None:
        if self._deferred:
            deferred, self._deferred = self._deferred, []
            for link, message in deferred:
                self._handle(link, message)
        for link, payload in self._links.frames():
            link.last_heard_at = self._last_router_at = self._clock()
            message = self._decode(link, payload)
            if message is not None:
                self._handle(link, message)
            if self._stopping:
                return

    def _read_mid_step(self) -> None:
        """Between two layers of a prefill worker's step: a handoff routed here asks its decode worker for blocks
        now instead of after the step, so the reservation's round trip overlaps the step (the simulator's model:
        a handoff reserves as it arrives). Only `PrefillHandoffs.submit` runs here, which touches the handoff
        legs and the transport, not the engine; every other message waits for `_drain`, in arrival order. A
        handoff is the first message about its request, so taking it ahead of deferred ones reorders nothing
        that concerns one request."""
        for link in self._links.links:
            while not self._stopping and link.has_input():
                payload = link.recv()
                if payload is None:
                    break
                link.last_heard_at = self._last_router_at = self._clock()
                message = self._decode(link, payload)
                if message is None:
                    continue
                if isinstance(message, rpc.AddRequest) and message.decode_worker and self.prefill is not None:
                    self._add_handoff(link, message)
                else:
                    self._deferred.append((link, message))

    def _decode(self, link: RouterLink, payload: bytes) -> rpc.Message | None:
        """The router's message, or None for a frame this worker cannot read (a router of another version): it is
        dropped, and the request it names, if any, fails with the reason, so one frame never stops the worker."""
        try:
            return rpc.decode(payload)
        except rpc.ProtocolError as exc:
            log.error("worker %s dropped an unreadable message: %s", self.config.worker_id, exc)
            if exc.request_id:
                self._send_failed(link, exc.request_id, 0, f"worker {self.config.worker_id} cannot read it: {exc}")
            return None

    def _send_failed(self, link: RouterLink, request_id: str, num_prompt_tokens: int, error: str) -> None:
        """The final delta of a request this worker does not take (to the router that sent it)."""
        failed = TokenDelta(request_id, (), "", True, "error", num_prompt_tokens, error=error,
                            worker_id=self.config.worker_id)
        link.send(rpc.TokenDeltas(self.config.worker_id, (failed,)))

    def _handle(self, link: RouterLink, message: rpc.Message) -> None:
        engine = self.engine
        assert engine is not None
        if isinstance(message, rpc.AddRequest) and (message.decode_worker or message.prefill_worker):
            self._add_handoff(link, message)
        elif isinstance(message, rpc.AddRequest):
            try:
                engine.add_request(list(message.prompt_token_ids), message.sampling, request_id=message.request_id,
                                   tenant=message.tenant, slo_class=message.slo_class,
                                   output_token_ids=message.output_token_ids)
            except KvbatonError as exc:
                self._send_failed(link, message.request_id, len(message.prompt_token_ids), str(exc))
                return
            self._links.assign(message.request_id, link)
            self._in_flight.add(message.request_id)
        elif isinstance(message, rpc.Abort):
            self._abort(message.request_ids)
        elif isinstance(message, rpc.HandoffFailed):
            if self.decode is not None:
                self._emit(self.decode.on_prefill_failed(message.request_id, message.reason, message.refused))
        elif isinstance(message, rpc.SnapshotRequest):
            self._send_snapshot(link)
        elif isinstance(message, rpc.ResetPrefixCache):
            engine.reset_prefix_cache(clear_store=True)  # KV events go out with the next heartbeat; the node clears soon
        elif isinstance(message, rpc.Shutdown):
            others = [other for other in self._links.registered if other is not link]
            if others:  # one router of several stops: end its requests, then leave it; the others are served on
                link.registered, link.leaving = False, True
                self._abort(sorted(link.request_ids))
            else:
                self._stopping = f"shutdown: {message.reason}"
        elif isinstance(message, rpc.AddRouter):
            if self._links.add(message.address) is not None:
                log.info("worker %s: router %s joined; registering", self.config.worker_id, message.address)
        elif isinstance(message, rpc.StoreNodesKnown):
            self._on_store_nodes(message)
        elif isinstance(message, rpc.RegisterAck):
            self._on_registered(link)
        elif isinstance(message, rpc.RegisterAgain):
            if link.registered:  # the router restarted (or dropped this worker): what it sent here is gone with it
                log.warning("worker %s: router %s does not know it; registering again, %d request(s) aborted",
                            self.config.worker_id, link.address, len(link.request_ids))
                link.registered = False
                link.register_sent_at = float("-inf")
                self._abort(sorted(link.request_ids))
        elif isinstance(message, rpc.RegisterRefuse):
            log.error("router %s refused worker %s: %s", link.address, self.config.worker_id, message.reason)
            link.refused = message.reason
            self._links.close_link(link)
        # Ping only refreshes the link's last_heard_at.

    def _abort(self, request_ids: tuple[str, ...] | list[str]) -> None:
        """Abort requests wherever they run (engine, prefill leg, decode handoff); each still sends its final
        delta."""
        engine = self.engine
        assert engine is not None
        for request_id in request_ids:
            if self.prefill is not None and self.prefill.owns(request_id):
                self.prefill.abort(request_id)
            elif self.decode is not None and self.decode.owns(request_id):
                self._emit([out for out in [self.decode.abort(request_id)] if out is not None])
            else:
                engine.abort_request(request_id)

    def _add_handoff(self, link: RouterLink, message: rpc.AddRequest) -> None:
        """A prefill leg (decode_worker set) or a decode leg (prefill_worker set) of a disaggregated request."""
        if message.decode_worker and self.prefill is not None:
            self._links.assign(message.request_id, link)  # its HandoffEnded, if any, goes back to this router
            self.prefill.submit(message.request_id, message.prompt_token_ids, message.sampling, message.decode_worker,
                                message.decode_address, message.tenant, message.slo_class)
            return
        if message.prefill_worker and self.decode is not None:
            try:
                self.decode.expect(message.request_id, message.prompt_token_ids, message.sampling,
                                   message.prefill_worker, message.kv_load_failure_policy, message.tenant,
                                   message.slo_class)
            except KvbatonError as exc:
                self._send_failed(link, message.request_id, len(message.prompt_token_ids), str(exc))
                return
            self._links.assign(message.request_id, link)
            self._in_flight.add(message.request_id)
            return
        error = f"worker {self.config.worker_id} has role {self.config.role!r} and cannot take this handoff leg"
        self._send_failed(link, message.request_id, len(message.prompt_token_ids), error)

    def _pump_handoffs(self) -> None:
        if self.prefill is not None:
            self.prefill.poll()
            links = self._links
            for report in self.prefill.take_reports():
                link = links.link_of(report.request_id) or self._default_link()
                if link is not None:
                    link.send(rpc.HandoffEnded(self.config.worker_id, report.request_id, report.decode_worker,
                                               report.outcome, report.reason))
            # A prefill leg sends no final delta: its request leaves its link once the leg is gone.
            if len(links.owner) > self.prefill.num_live + len(self._in_flight):
                for request_id in [r for r in links.owner if r not in self._in_flight and not self.prefill.owns(r)]:
                    links.release(request_id)
        if self.decode is not None:
            self._emit(self.decode.poll())

    def _step(self) -> None:
        assert self.engine is not None
        started_s = time.perf_counter()
        outputs = self.engine.step()
        self._num_step_calls += 1
        if self.prefill is not None:
            outputs = self.prefill.on_outputs(outputs)
        self._emit(outputs)
        if self.engine.failed and not self._stopping:
            # A rank died: its requests just ended with the error; the Goodbye makes the router drop this worker.
            self._stopping = f"cannot run: {self.engine.failed}"
        if self._step_log is not None and self.engine.last_plan is not None:
            self._step_log.on_step(self.engine.last_plan, started_s, time.perf_counter(),
                                   self.engine.has_unfinished_requests())

    def _default_link(self) -> RouterLink | None:
        """Where a request no router is known for answers (one added before links existed): the first open link."""
        links = self._links.open_links
        return links[0] if links else None

    def _emit(self, outputs: list[TokenDelta]) -> None:
        """Each output's delta to the router that sent its request: one frame per router per step."""
        if not outputs:
            return
        links = self._links
        by_link: dict[int, tuple[RouterLink, list[TokenDelta]]] = {}
        for out in outputs:
            link = links.link_of(out.request_id) or self._default_link()
            if out.finished:
                self._in_flight.discard(out.request_id)
                links.release(out.request_id)
            if link is None:
                continue
            entry = by_link.get(id(link))
            if entry is None:
                entry = by_link[id(link)] = (link, [])
            entry[1].append(out)
        for link, deltas in by_link.values():
            link.send(rpc.TokenDeltas(self.config.worker_id, tuple(deltas)))


    def _finish_all(self) -> None:
        """Abort whatever is left and step until each request has sent its final delta."""
        engine = self.engine
        assert engine is not None
        for request_id in sorted(self._in_flight):
            if self.decode is not None and self.decode.owns(request_id):
                self._emit([out for out in [self.decode.abort(request_id)] if out is not None])
            engine.abort_request(request_id)
        if self.prefill is not None:
            for request_id in self.prefill.live_request_ids():
                self.prefill.abort(request_id, "prefill worker stopping")
        while engine.has_unfinished_requests():
            self._step()
        self._pump_handoffs()  # let the aborts out

    # -- heartbeat, events, snapshot ------------------------------------------------------------

    def _flush_events(self) -> None:
        """The prefix cache's new KV events, to every registered router (each keeps its own index from them)."""
        events = self._take_events()
        if events is not None:
            self._links.broadcast(events)

    def _take_events(self) -> rpc.KVEvents | None:
        """The prefix cache's new KV events as one message (None when there are none)."""
        engine = self.engine
        if engine is None or engine.prefix_cache is None:
            return None
        events = engine.prefix_cache.take_events()
        if not events:
            return None
        self._last_event_seq = events[-1].seq
        return rpc.KVEvents(self.config.worker_id, tuple(e.to_wire() for e in events))

    def _send_heartbeat(self, now: float) -> None:
        """Stats to every registered router, with the new KV events in the same frame (`rpc.Heartbeat`)."""
        engine = self.engine
        assert engine is not None
        events = self._take_events()
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
        stats = rpc.Stats(
            self.config.worker_id, s.num_waiting, s.num_running, s.num_queued_prefill_tokens, s.num_used_blocks,
            s.num_free_blocks, s.num_cached_blocks, s.prefix_cache_queries_tokens, s.prefix_cache_hits_tokens,
            s.num_preemptions, s.num_steps, now, self._invariant_error, *self._transfer_stats(),
            engine.scheduler.num_draft_tokens, engine.scheduler.num_accepted_tokens,
            s.num_store_loaded_blocks, s.num_store_saved_blocks, s.num_evictable_blocks, *self._store_load_stats())
        self._links.broadcast(stats if events is None else rpc.Heartbeat(events, stats))

    def _store_load_stats(self) -> tuple[int, float, str, int, float]:
        """(bytes, seconds, transport, loads, round-trip seconds) of the loads from the KV store so far (zeros without
        one)."""
        io = self.engine.store_io if self.engine is not None else None
        if io is None:
            return 0, 0.0, "", 0, 0.0
        num_bytes, seconds, num_loads, round_trip_s = io.load_totals
        return num_bytes, seconds, io.transport, num_loads, round_trip_s

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

    def _send_snapshot(self, link: RouterLink) -> None:
        """The whole prefix cache to one router. Events not yet sent go to every router first: the snapshot covers
        them, and the others must not miss them."""
        self._flush_events()
        cache = self.engine.prefix_cache if self.engine is not None else None
        events = cache.snapshot() if cache is not None else []
        seq = max([self._last_event_seq, *(e.seq for e in events)])
        link.send(rpc.SnapshotResponse(self.config.worker_id, seq, tuple(e.to_wire() for e in events)))
