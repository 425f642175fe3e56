"""`kvbaton serve`: start N local worker processes and the router (cluster manager + HTTP API) in this one.

Order: refuse a non-loopback host without an API key (`server/auth.py`) -> load the tokenizer (not the
weights) -> bind the RPC socket -> spawn workers, each handed the cluster secret in its environment (never
its command line) -> wait until all have registered (each was checked against the router's tokenizer
probe and the first one's layout) -> serve HTTP. On SIGINT/SIGTERM: drain (new generation requests get 503
with Retry-After, not a refused connection, while the in-flight ones finish up to the drain deadline), stop
accepting, tell the workers to shut down, kill any straggler by pid, exit 0. Workers run in their own session
so a terminal's Ctrl-C reaches only the router, which then stops them in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import socket
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

import uvicorn
import uvloop

from kvbaton.core.cluster_secret import SECRET_ENV, ClusterSecret, worker_environment
from kvbaton.transfer.store_slots import SHM_DIRECTORY, with_streaming_copies
from kvbaton.server.store_client import TRANSPORT_ENV as STORE_TRANSPORT_ENV
from kvbaton.core.errors import KvbatonError
from kvbaton.model.config import ModelConfig
from kvbaton.model.registry import kv_block_bytes, read_model_header, resolve_model_source
from kvbaton.model.token_cache import DEFAULT_MAX_CACHED_CHARS
from kvbaton.server.api import create_app
from kvbaton.server.auth import ApiAuth, ApiKeys, check_exposure
from kvbaton.server.cluster import ClusterConfig, ClusterManager
from kvbaton.server.identity import tokenizer_probe_hash
from kvbaton.router.pairs import DEFAULT_LOCAL_PREFILL_THRESHOLD_TOKENS
from kvbaton.server.ray_workers import RayPlacement, RayWorker, RayWorkerProcess
from kvbaton.server.store_server import shm_capped_gb
from kvbaton.server.store_server import start_process as start_store_process
from kvbaton.server.store_server import stop_process as stop_store_process
from kvbaton.server.responses_store import DEFAULT_MAX_NUM_RESPONSES, DEFAULT_TTL_S, ResponseStore
from kvbaton.router.admission import AdmissionPolicy, AdmissionSLO, CalibratedTimeModel, create_admission
from kvbaton.router.pools import PoolBalancer
from kvbaton.sim.costs.linear import load_linear_model

T = TypeVar("T")

DEFAULT_RPC_ADDRESS = "tcp://127.0.0.1:*"  # workers on this host; with --ray the launcher binds its node's IP instead


@dataclass(frozen=True, slots=True)
class ServeConfig:
    model: str = "smollm2-135m"
    num_workers: int = 2  # mixed workers
    num_prefill: int = 0  # disaggregated pools: prefill workers hand their KV to decode workers
    num_decode: int = 0
    kv_transport: str = "shm"  # shm (same host, written in place) | tcp
    local_prefill_threshold_tokens: int = DEFAULT_LOCAL_PREFILL_THRESHOLD_TOKENS
    kv_load_failure_policy: str = "recompute"
    policy: str = "preble"
    host: str = "127.0.0.1"
    port: int = 8000  # 0 = any free port (the printed URL has the real one)
    rpc_address: str = DEFAULT_RPC_ADDRESS  # where workers connect; "*" = any free port
    dtype: str = "auto"
    device: str = "cpu"  # every worker's (kvbaton.model.device); with Ray GPUs, "cuda" is each worker's own GPU
    block_size: int = 16
    num_blocks: int = 2048  # per worker
    # This host's KV store node (kvbaton.server.store_server): DRAM in GB (0 = none; None = `auto_store_gb`, what
    # `kvbaton serve` takes unless told) and its disk tier "DIR:GB".
    kv_store_gb: float | None = 0.0
    kv_store_disk: str = ""
    # set by the launcher once the store node listens, and handed to every worker and router; a joined router's is
    # the node it reads (`kvbaton router --kv-store`)
    kv_store_address: str = ""
    max_num_batched_tokens: int = 512
    num_speculative_tokens: int = 0  # prompt-lookup drafts per decode on every worker (0: off)
    warm_up: bool = False  # workers build every linear shape before serving (Worker: WorkerConfig.warm_up)
    max_num_waiting: int = 256
    threads_per_worker: int = 0  # torch threads in each worker; 0 = this machine's cores shared evenly among workers
    # Rank processes per worker (kvbaton.engine.rank_group), vLLM's names; a pool's own degree (0: these) lets
    # prefill and decode differ (DistServe: prefill TP for latency, decode TP for capacity).
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    prefill_tensor_parallel_size: int = 0
    decode_tensor_parallel_size: int = 0
    prefill_pipeline_parallel_size: int = 0
    decode_pipeline_parallel_size: int = 0

    def parallelism(self, role: str) -> tuple[int, int]:
        """(tensor, pipeline) parallel size of a worker of `role`."""
        tp = {"prefill": self.prefill_tensor_parallel_size, "decode": self.decode_tensor_parallel_size}.get(role, 0)
        pp = {"prefill": self.prefill_pipeline_parallel_size, "decode": self.decode_pipeline_parallel_size}.get(role, 0)
        return tp or self.tensor_parallel_size, pp or self.pipeline_parallel_size

    @property
    def num_threads_per_worker(self) -> int:
        """Co-located workers that each spin all cores' OpenMP threads slow each other down many times over. A
        parallel worker's every rank gets this many (the cores are shared among all ranks)."""
        if self.threads_per_worker > 0:
            return self.threads_per_worker
        num_ranks = sum(tp * pp for tp, pp in (self.parallelism(role) for _, role in worker_roles(self)))
        return max(1, (os.cpu_count() or 1) // max(1, num_ranks))
    seed: int = 0
    startup_timeout_s: float = 300.0  # every worker registered within this
    drain_timeout_s: float = 30.0  # in-flight requests may finish within this after a stop signal
    migration_limit: int = 3  # times a call may move to another worker after losing one (0: it fails)
    router_link_timeout_s: float = 5.0  # workers give up a router silent this long while another is heard
    worker_exit_timeout_s: float = 10.0  # then stragglers are killed
    # SLO admission (kvbaton.router.admission): none | baseline | early | predicted. The others price each
    # arrival with the step times of `cost_profile` (a `kvbaton profile` file) against the SLOs.
    admission: str = "none"
    ttft_slo_s: float = 0.0
    tpot_slo_s: float = 0.0
    cost_profile: str = ""
    adaptive_pools: bool = False  # lend a worker of the idle pool to mixed duty (kvbaton.router.pools)
    step_log_dir: str = ""  # each worker logs its step shapes and periods to <dir>/<worker id>.steps.jsonl
    tokenizer_cache_chars: int = DEFAULT_MAX_CACHED_CHARS  # ingress tokenization cache bound (0: off)
    tool_call_parser: str = ""  # "hermes": tool_choice "auto" reads the model's <tool_call> blocks
    # /v1/responses' stored responses (server/responses_store.py): how many, and for how long
    max_stored_responses: int = DEFAULT_MAX_NUM_RESPONSES
    stored_response_ttl_s: float = DEFAULT_TTL_S
    # "" = the local queue the routing policy pairs with; "fcfs"; "priority" (vLLM's: requests' `priority` field)
    scheduling_policy: str = ""
    reserve_ahead_tokens: int | None = None  # prefill workers' late KV reservation (None: on arrival)
    # Place the workers on a Ray cluster (server/ray_workers.py): "local" | "auto" | its address; "" = local processes.
    ray_address: str = ""
    gpus_per_worker: float = 0.0  # with Ray: GPUs per rank each worker's actor holds (Ray sets its CUDA_VISIBLE_DEVICES)
    # Trust (server/auth.py): API keys (None or empty: none, allowed on loopback only unless allow_unauthenticated);
    # the client's tenant honoured within its key's; /metrics behind a key too.
    api_keys: ApiKeys | None = None
    allow_unauthenticated: bool = False
    trust_tenant_header: bool = False
    metrics_require_key: bool = False
    # What the RPC and the KV links authenticate with (core/cluster_secret.py); None: a fresh one for this run.
    cluster_secret: ClusterSecret | None = None
    # Several routers (`kvbaton serve --routers N`): this process is the first; the others are `kvbaton router --join`
    # processes with `router_args` (the shared options), on the next HTTP ports (any free ones when port is 0).
    num_routers: int = 1
    router_args: tuple[str, ...] = ()
    # `kvbaton router --join ADDRESS`: start no worker; join the cluster whose router's RPC listens at ADDRESS.
    join_address: str = ""


def _slo_and_profile(config: ServeConfig, flag: str,
                     time_model: CalibratedTimeModel | None) -> tuple[AdmissionSLO, CalibratedTimeModel]:
    if config.ttft_slo_s <= 0 or config.tpot_slo_s <= 0 or not config.cost_profile:
        raise KvbatonError(f"{flag} needs --ttft-slo, --tpot-slo and --cost-profile FILE (step times measured by "
                           f"`kvbaton profile --model {config.model} --threads {config.num_threads_per_worker} "
                           f"--out FILE`)")
    # Every worker runs the same model on the same kind of host: one profile prices them all, corrected online
    # by what the router measures (CalibratedTimeModel).
    model = time_model if time_model is not None else CalibratedTimeModel(load_linear_model(config.cost_profile))
    return AdmissionSLO(config.ttft_slo_s, config.tpot_slo_s), model


def admission_policy(config: ServeConfig, time_model: CalibratedTimeModel | None = None) -> AdmissionPolicy | None:
    """The router's admission policy for `config`, or None; a bad combination is a KvbatonError."""
    if config.admission == "none":
        return None
    slo, model = _slo_and_profile(config, f"--admission {config.admission}", time_model)
    return create_admission(config.admission, slo, {}, default_model=model)


def pool_balancer(config: ServeConfig, time_model: CalibratedTimeModel | None = None) -> PoolBalancer | None:
    """The router's adaptive-pools policy for `config`, or None (fixed roles)."""
    if not config.adaptive_pools:
        return None
    if not config.num_prefill or not config.num_decode:
        raise KvbatonError("--adaptive-pools needs disaggregated pools (--prefill N --decode M)")
    slo, model = _slo_and_profile(config, "--adaptive-pools", time_model)
    return PoolBalancer(slo, {}, default_model=model)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the launcher owns SIGINT/SIGTERM and never re-raises them."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def worker_roles(config: ServeConfig) -> list[tuple[str, str]]:
    """(worker id, role) of every worker the launcher starts: w* mixed, p* prefill, d* decode."""
    return ([(f"w{i}", "mixed") for i in range(config.num_workers)]
            + [(f"p{i}", "prefill") for i in range(config.num_prefill)]
            + [(f"d{i}", "decode") for i in range(config.num_decode)])


def worker_command(config: ServeConfig, router_address: str, worker_id: str, role: str = "mixed") -> list[str]:
    return [sys.executable, "-m", "kvbaton.cli", "worker", *worker_args(config, router_address, worker_id, role)]


def serving_max_model_len(config: ServeConfig, model_config: ModelConfig) -> int:
    """The longest prompt + output the router accepts: the model's context, or one worker's KV pool if smaller (a
    request the pool cannot hold would fail on the worker, a 500, where the router answers a 400 at ingress)."""
    return min(model_config.max_position_embeddings, config.num_blocks * config.block_size)


def worker_args(config: ServeConfig, router_address: str, worker_id: str, role: str = "mixed") -> list[str]:
    """The arguments of `kvbaton worker` for one worker of `config`."""
    return ["--role", role, "--router", router_address,
            "--model", config.model, "--worker-id", worker_id, "--dtype", config.dtype, "--device", config.device,
            "--block-size", str(config.block_size), "--num-blocks", str(config.num_blocks),
            "--max-num-batched-tokens", str(config.max_num_batched_tokens), "--seed", str(config.seed),
            "--speculative-tokens", str(config.num_speculative_tokens), *(["--warm-up"] if config.warm_up else []),
            "--threads", str(config.num_threads_per_worker), "--kv-transport", config.kv_transport,
            "--router-link-timeout", str(config.router_link_timeout_s),
            *(["--step-log", str(Path(config.step_log_dir) / f"{worker_id}.steps.jsonl")] if config.step_log_dir else []),
            *(["--reserve-ahead-tokens", str(config.reserve_ahead_tokens)]
              if config.reserve_ahead_tokens is not None else []),
            *(["--kv-store", config.kv_store_address] if config.kv_store_address else []),
            *_parallel_args(*config.parallelism(role))]


def store_environment(config: ServeConfig, base: Mapping[str, str]) -> dict[str, str]:
    """What a worker's environment gets for the KV store beyond `base` (the one it has): streaming copies for store
    loads (they copy a row of blocks per memcpy) and a store transport forced in the launcher's environment (tests
    run the cross-host path on one host); nothing without a store. Local workers and Ray's actors both take it."""
    if not config.kv_store_gb:
        return {}
    extras = {key: value for key, value in with_streaming_copies(dict(base)).items() if base.get(key) != value}
    if STORE_TRANSPORT_ENV in os.environ:
        extras[STORE_TRANSPORT_ENV] = os.environ[STORE_TRANSPORT_ENV]
    return extras


def auto_store_gb(config: ServeConfig, block_bytes: int, shm_directory: str = SHM_DIRECTORY, *,
                  num_workers: int | None = None) -> float:
    """The store node's DRAM when `kvbaton serve` is not told (`--kv-store-gb auto`): twice the KV pools of the
    workers it starts (every host a store node by default; SGLang's HiCache sizes its host pool at 2x the device
    pool), or of `num_workers` of them (with Ray, those placed on its node), at most half of what `shm_directory`
    has free (the node's DRAM is a file there, filled as blocks come); 0, no store, with no worker (a joined router)
    or without that directory."""
    if num_workers is None:
        num_workers = config.num_workers + config.num_prefill + config.num_decode
    if not num_workers:
        return 0.0
    return shm_capped_gb(auto_store_bytes(config, block_bytes, num_workers), block_bytes, shm_directory)


def auto_store_bytes(config: ServeConfig, block_bytes: int, num_workers: int) -> int:
    """`auto`'s DRAM for a store node serving `num_workers` workers: twice their KV pools."""
    return 2 * num_workers * config.num_blocks * block_bytes


def store_node_args(model_config: ModelConfig, dtype: str, block_size: int, gb: float | None, disk: str = "",
                    auto_bytes: int = 0) -> list[str]:
    """A store node's arguments but its host (`python -m kvbaton.server.store_server`): sized for the blocks of workers
    of `model_config` in `dtype` and laid out as their KV pools (2 rows a layer), with `gb` of DRAM and `disk`
    ("DIR:GB", or none). `kvbaton serve` starts its nodes so, and `kvbaton store-node` on another host. `gb` None:
    `auto_bytes` of DRAM within half of what the node's own /dev/shm has free (what `kvbaton serve --ray` gives the
    store node of each other node it places workers on, `auto_store_bytes` of those workers)."""
    block_bytes = kv_block_bytes(model_config, dtype, block_size)
    dram = ["--kv-store-gb", str(gb)] if gb is not None else ["--kv-store-gb", "auto", "--kv-store-auto-bytes",
                                                              str(auto_bytes)]
    return ["--block-bytes", str(block_bytes), "--block-tokens", str(block_size),
            "--block-rows", str(2 * model_config.num_layers), *dram,
            *(["--kv-store-disk-gb", disk] if disk else [])]


def ray_share(config: ServeConfig, role: str) -> tuple[float, float]:
    """(CPUs, GPUs) the Ray actor of a worker of `role` holds: each of its TP x PP rank processes runs its own torch
    threads (`num_threads_per_worker` each) and, with `--gpus-per-worker`, holds that many GPUs (one per rank with
    the usual 1); a worker of one rank is its own only rank."""
    tp, pp = config.parallelism(role)
    return float(config.num_threads_per_worker * tp * pp), config.gpus_per_worker * tp * pp


def _parallel_args(tp: int, pp: int) -> list[str]:
    return ([] if tp == 1 else ["--tensor-parallel-size", str(tp)]) + \
        ([] if pp == 1 else ["--pipeline-parallel-size", str(pp)])


class Launcher:
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.secret = config.cluster_secret or ClusterSecret.generate()
        self.processes: dict[str, subprocess.Popen[bytes] | RayWorkerProcess] = {}
        self.placement: RayPlacement | None = None
        self.url = ""
        self._stop = asyncio.Event()
        self._server: _Server | None = None
        self._cluster: ClusterManager | None = None
        self._drain_timer: asyncio.TimerHandle | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self.routers: dict[str, subprocess.Popen[bytes]] = {}  # URL -> the other routers' processes (--routers N)
        self.store_process: subprocess.Popen[str] | None = None
        # a store node's arguments but its host for the workers on its node: Ray's other nodes start theirs so
        self.store_args: Callable[[int], list[str]] | None = None
        self._store_auto = False

    def request_stop(self) -> None:
        """Signal handler: the first call drains, then stops the HTTP server; a second one stops at once. While
        draining the server still accepts: new calls are answered 503 with Retry-After (a load balancer moves them
        to another router) and /ready fails, while those in flight finish."""
        server, cluster = self._server, self._cluster
        for process in self.routers.values():  # each drains its own streams meanwhile
            if process.poll() is None:
                process.send_signal(signal.SIGTERM if not self._stop.is_set() else signal.SIGINT)
        if server is not None:
            if self._stop.is_set():
                server.force_exit = True
                server.should_exit = True
            elif cluster is not None:
                # What still runs at the drain deadline is aborted just before it (a second to spare): its stream
                # ends with finish reason "abort" instead of being cut off when uvicorn cancels its handler.
                drain_s = self.config.drain_timeout_s
                loop = asyncio.get_running_loop()
                self._drain_timer = loop.call_later(max(0.0, min(drain_s - 1.0, 0.9 * drain_s)), cluster.abort_all)
                cluster.draining = True
                self._drain_task = loop.create_task(self._exit_when_drained(server, cluster))
            else:
                server.should_exit = True
        self._stop.set()

    async def _exit_when_drained(self, server: _Server, cluster: ClusterManager) -> None:
        await cluster.drain(self.config.drain_timeout_s, until=lambda: server.force_exit)
        server.should_exit = True

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.request_stop)
        config = self.config
        check_exposure(config.host, config.api_keys, config.allow_unauthenticated)
        model_config, tokenizer = read_model_header(resolve_model_source(config.model))  # the workers read the weights
        self._store_auto = config.kv_store_gb is None  # with Ray, each other node's store is sized by its workers
        if config.kv_store_gb is None:
            config = self.config = replace(config, kv_store_gb=auto_store_gb(config, self._store_block_bytes(model_config)))
            if config.kv_store_disk and not config.kv_store_gb:
                raise KvbatonError(f"--kv-store-disk-gb needs the store's DRAM: {SHM_DIRECTORY} has no room for it here "
                                   "(give --kv-store-gb)")
        # One calibrated model for both: what admission learns about this host, the balancer prices with too.
        wanted = (config.admission != "none" or config.adaptive_pools) and config.cost_profile
        time_model = CalibratedTimeModel(load_linear_model(config.cost_profile)) if wanted else None
        admission, pools = admission_policy(config, time_model), pool_balancer(config, time_model)
        http_socket = _bind_http(config.host, config.port)  # fail on a taken port before starting any worker
        try:
            if config.ray_address:
                self.placement = RayPlacement(config.ray_address)
                for sig in (signal.SIGINT, signal.SIGTERM):  # ray.init replaced them with its own (sys.exit)
                    loop.add_signal_handler(sig, self.request_stop)
                config = self.config = self.placed_on_ray(config, self.placement)
                if self._store_auto and config.kv_store_gb > 0:
                    # This node's store node is sized by the workers Ray places here, like every other node's: the
                    # actors are placed now (the workers start in them later, once the router runs).
                    on_this_node = await self._until_stopped(self.placement.place(
                        self._ray_workers(config, ""), config.startup_timeout_s))
                    if on_this_node is None:  # a stop signal during the placement
                        http_socket.close()
                        self._let_go_of_ray()
                        print("kvbaton: stopped", flush=True)
                        return 0
                    # One worker's worth when none is placed here: no worker writes to it then, but the router
                    # reads its events and the other nodes' workers may ask it.
                    config = self.config = replace(config, kv_store_gb=auto_store_gb(
                        config, self._store_block_bytes(model_config), num_workers=max(1, on_this_node)))
            if config.kv_store_gb > 0:  # before the router: it reads the store node's events
                # With Ray, on this node's IP: workers on other nodes read it over TCP (store_tcp), this node's over
                # shared memory.
                host = self.placement.node_ip if self.placement is not None else "127.0.0.1"
                self.store_args = lambda num_workers: self._store_args(model_config, num_workers)
                config = self.config = replace(config, kv_store_address=self._start_store(model_config, host))
            cluster = ClusterManager(ClusterConfig(
                bind_address=config.rpc_address, model_name=config.model, policy=config.policy,
                block_size=config.block_size, tokenizer_probe_hash=tokenizer_probe_hash(tokenizer), seed=config.seed,
                max_num_waiting=config.max_num_waiting,
                local_prefill_threshold_tokens=config.local_prefill_threshold_tokens,
                kv_load_failure_policy=config.kv_load_failure_policy,
                reserve_ahead_tokens=config.reserve_ahead_tokens,
                scheduling_policy=config.scheduling_policy,
                kv_bytes_per_token=model_config.kv_bytes_per_token(2 if config.dtype != "float32" else 4),
                cluster_secret=self.secret, migration_limit=config.migration_limit,
                kv_store_address=config.kv_store_address, kv_store_block_bytes=self._store_block_bytes(model_config)),
                admission=admission, pools=pools)
            self._cluster = cluster
            address = await cluster.start()
        except BaseException:
            http_socket.close()
            self._let_go_of_ray()
            self._stop_store()
            raise
        try:
            if config.join_address:
                try:
                    await cluster.join(config.join_address, config.startup_timeout_s)
                except TimeoutError as exc:
                    raise KvbatonError(f"router did not join: {exc}") from None
            else:
                await self._start_workers(address)
                for worker_id, process in self.processes.items():
                    cluster.watch_process(worker_id, process)
                if not await self._wait_for_workers(cluster):
                    return 0  # stopped during startup
            app = create_app(cluster, tokenizer, config.model, max_model_len=serving_max_model_len(config,
                                                                                              model_config),
                             tokenizer_cache_chars=config.tokenizer_cache_chars,
                             tool_call_parser=config.tool_call_parser,
                             priority_scheduling=config.scheduling_policy == "priority",
                             responses=ResponseStore(config.max_stored_responses,
                                                     ttl_s=config.stored_response_ttl_s),
                             auth=ApiAuth(config.api_keys, trust_tenant_header=config.trust_tenant_header,
                                          metrics_require_key=config.metrics_require_key))
            freeze_startup_heap()
            # uvicorn's annotation says int, but it only hands the value to asyncio.wait_for: a fraction counts too.
            graceful_s: int = config.drain_timeout_s  # type: ignore[assignment]
            self._server = server = _Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                                           timeout_graceful_shutdown=graceful_s))
            serving = asyncio.create_task(self._server.serve(sockets=[http_socket]))
            while not self._server.started and not serving.done():
                await asyncio.sleep(0.05)
            if serving.done():
                raise KvbatonError(f"HTTP server on {config.host}:{config.port} did not start")
            port = http_socket.getsockname()[1]
            host = f"[{config.host}]" if ":" in config.host else config.host
            self.url = f"http://{host}:{port}"
            pools = f"{config.num_workers} mixed + {config.num_prefill} prefill + {config.num_decode} decode worker(s)"
            if config.join_address:
                pools = f"the {cluster.num_serving_workers} worker(s) of the cluster it joined at {config.join_address}"
            elif not self.processes:
                pools = f"the {cluster.num_serving_workers} worker(s) that came back to {address}"
            nodes = ""
            if self.placement is not None:
                ips = sorted({p.node_ip for p in self.processes.values() if isinstance(p, RayWorkerProcess)})
                nodes = f" on Ray node(s) {' '.join(ips)}"
            pids = " ".join(str(p.pid) for p in self.processes.values())
            print(f"kvbaton: serving {config.model} at {self.url} with {pools}{nodes}, policy {config.policy}"
                  + (f" (pids {pids})" if pids else ""), flush=True)
            if config.kv_store_address:  # what `kvbaton router --join ... --kv-store` takes to price store hits too
                owner = f"pid {self.store_process.pid}" if self.store_process is not None else "read by this router"
                print(f"kvbaton: KV store node at {config.kv_store_address} ({owner})", flush=True)
                for store_address, (node_ip, pid) in (self.placement.store_nodes if self.placement else {}).items():
                    print(f"kvbaton: KV store node at {store_address} (pid {pid} on Ray node {node_ip})", flush=True)
            if config.num_routers > 1:
                await self._start_routers(address, port)
            if self._stop.is_set():  # a signal arrived while the server was starting
                self._server.should_exit = True
            try:
                await serving  # returns after a stop signal, once open connections closed or the drain deadline hit
            except SystemExit as exc:  # uvicorn exits this way when its startup fails
                raise KvbatonError(f"HTTP server stopped with status {exc.code}") from None
            if server.force_exit:  # uvicorn skips the app's lifespan shutdown then: left pending, its task would be
                await server.lifespan.shutdown()  # cancelled as the loop closes and log a traceback
            # What still runs gets the rest of the drain, unless a second signal came (uvicorn's force_exit): then
            # the workers are told to stop at once and abort it.
            await cluster.drain(config.drain_timeout_s, until=lambda: server.force_exit)
            return 0
        finally:
            if self._drain_timer is not None:
                self._drain_timer.cancel()
            if self._drain_task is not None:
                self._drain_task.cancel()
            http_socket.close()
            await self._stop_routers()  # before this router's shutdown: the workers stop with their last router
            self._stop_unregistered(cluster)
            await cluster.shutdown(timeout_s=config.worker_exit_timeout_s)
            self._reap()
            self._stop_store()
            self._let_go_of_ray()
            print("kvbaton: stopped", flush=True)

    async def _start_routers(self, rpc_address: str, port: int) -> None:
        """Start the other routers of `--routers N` (`kvbaton router --join` this one) and wait until each is ready.

        Consecutive ports rather than one port shared with SO_REUSEPORT: a client's stream lives in the router
        process that accepted it (the kernel would spread connections blindly, and a router's death must end only
        its own clients' streams), and a load balancer in front health-checks each router on its own port."""
        config = self.config
        environment = {**os.environ, SECRET_ENV: self.secret.to_hex()}  # the secret never on a command line
        host = f"[{config.host}]" if ":" in config.host else config.host
        for index in range(1, config.num_routers):
            router_port = config.port + index if config.port else _free_port(config.host)
            command = [sys.executable, "-m", "kvbaton.cli", "router", "--join", rpc_address, "--port",
                       str(router_port), *config.router_args,
                       *(["--kv-store", config.kv_store_address] if config.kv_store_address else [])]
            self.routers[f"http://{host}:{router_port}"] = subprocess.Popen(command, start_new_session=True,
                                                                             env=environment)
        deadline = time.monotonic() + config.startup_timeout_s
        for url, process in self.routers.items():
            while not await asyncio.to_thread(_is_ready, url):
                if process.poll() is not None:
                    raise KvbatonError(f"router {url} (pid {process.pid}) exited with code {process.returncode} "
                                       "during startup")
                if time.monotonic() > deadline or self._stop.is_set():
                    raise KvbatonError(f"router {url} not ready within {config.startup_timeout_s:g} s")
                await asyncio.sleep(0.1)
            print(f"kvbaton: router at {url} (pid {process.pid}) serves the same workers", flush=True)

    async def _stop_routers(self) -> None:
        """Stop the other routers (they drain their streams first), killing any still running after the drain."""
        for process in self.routers.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        timeout_s = self.config.drain_timeout_s + self.config.worker_exit_timeout_s
        for process in self.routers.values():
            try:
                await asyncio.to_thread(process.wait, timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                await asyncio.to_thread(process.wait, 5.0)

    @staticmethod
    def placed_on_ray(config: ServeConfig, placement: RayPlacement) -> ServeConfig:
        """`config` for workers on Ray's nodes: the RPC socket on this node's IP unless given (workers elsewhere
        must reach it), and KV over TCP when there is more than one node (shared memory reaches one host)."""
        changes: dict[str, str] = {}
        if config.rpc_address == DEFAULT_RPC_ADDRESS:
            changes["rpc_address"] = f"tcp://{placement.node_ip}:*"
        if config.kv_transport == "shm" and placement.num_nodes > 1 and config.num_prefill:
            print("kvbaton: the Ray cluster has several nodes: KV moves over TCP", file=sys.stderr, flush=True)
            changes["kv_transport"] = "tcp"
        return replace(config, **changes)

    async def _start_workers(self, address: str) -> None:
        config = self.config
        if self.placement is None:
            environment = worker_environment(self.secret, dict(os.environ))
            environment.update(store_environment(config, environment))
            for worker_id, role in worker_roles(config):
                process = subprocess.Popen(worker_command(config, address, worker_id, role), start_new_session=True,
                                           env=environment)
                self.processes[worker_id] = process
            return
        environment = store_environment(config, {})  # what the actors add to their node's environment
        started = await self._until_stopped(self.placement.start(
            self._ray_workers(config, address), config.startup_timeout_s, self.secret, environment,
            store_args=self.store_args if config.kv_store_address else None, local_store=config.kv_store_address))
        self.processes.update(started or {})

    @staticmethod
    def _ray_workers(config: ServeConfig, address: str) -> list[RayWorker]:
        """The workers as Ray actors start them, in `worker_roles` order. With a store, each worker's `--kv-store`
        is its node's: the placement adds it once it knows where each runs (this node's store, or the one it starts
        on the worker's node)."""
        unplaced = replace(config, kv_store_address="")
        return [RayWorker(worker_id, tuple(worker_args(unplaced, address, worker_id, role)), *ray_share(config, role))
                for worker_id, role in worker_roles(config)]

    async def _until_stopped(self, placing: Awaitable[T]) -> T | None:
        """`placing`'s result, or None once a stop signal came first: Ray may wait for resources until the startup
        timeout, and a signal ends the wait (closing the placement then ends the actors placed so far and those
        still pending)."""
        placing = asyncio.ensure_future(placing)
        stopping = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({placing, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not placing.done():
            placing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            return await placing
        return None

    def _start_store(self, model_config: ModelConfig, host: str) -> str:
        """Start this host's KV store node (its own process, sized for the workers' blocks, listening on `host`);
        returns its address. With Ray this is the launcher's node's; the other nodes that hold workers get theirs
        from the placement (`RayPlacement.start`'s `store_args`)."""
        self.store_process, address = start_store_process(self._store_args(model_config), self.secret, host)
        return address

    def _store_args(self, model_config: ModelConfig, num_workers: int = 0) -> list[str]:
        """This host's store node's arguments (`num_workers` 0), or those of another Ray node's holding `num_workers`
        workers: with `--kv-store-gb auto`, sized by that node for them (twice their KV pools within half its own
        /dev/shm); else the same GB on every node."""
        config = self.config
        if num_workers and self._store_auto:
            auto = auto_store_bytes(config, self._store_block_bytes(model_config), num_workers)
            return store_node_args(model_config, config.dtype, config.block_size, None, config.kv_store_disk, auto)
        return store_node_args(model_config, config.dtype, config.block_size, config.kv_store_gb, config.kv_store_disk)

    def _store_block_bytes(self, model_config: ModelConfig) -> int:
        return kv_block_bytes(model_config, self.config.dtype, self.config.block_size)

    def _stop_store(self) -> None:
        process, self.store_process = self.store_process, None
        if process is not None:
            stop_store_process(process)

    def _let_go_of_ray(self) -> None:
        if self.placement is not None:
            self.placement.close()
            self.placement = None

    async def _wait_for_workers(self, cluster: ClusterManager) -> bool:
        """True once every worker registered; False on a stop signal; raises if a worker died or timed out."""
        # None to start: a router restarted at its RPC address (`kvbaton router` without --join) waits for one of the
        # cluster's workers, which keep registering there, to come back.
        num_workers = self.config.num_workers + self.config.num_prefill + self.config.num_decode or 1
        waiting = asyncio.ensure_future(cluster.wait_for_workers(num_workers,
                                                                 self.config.startup_timeout_s))
        try:
            while not waiting.done():
                if self._stop.is_set():
                    return False
                for worker_id, process in sorted(self.processes.items()):
                    code = process.poll()
                    if code is not None:
                        why = cluster.lost_workers.get(worker_id, "see its output above")
                        ended = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                        raise KvbatonError(f"worker {worker_id} (pid {process.pid}) {ended} during startup: {why}")
                await asyncio.sleep(0.05)
            waiting.result()
            return True
        except TimeoutError as exc:
            raise KvbatonError(f"cluster did not start: {exc}") from exc
        finally:
            waiting.cancel()

    def _stop_unregistered(self, cluster: ClusterManager) -> None:
        """SIGTERM the workers still starting (the router cannot tell them to stop): else they would wait out their
        registration timeout, and `_reap` for them, before being killed."""
        for worker_id, process in self.processes.items():
            if worker_id not in cluster.workers and worker_id not in cluster.lost_workers and process.poll() is None:
                process.terminate()

    def _reap(self) -> None:
        """Wait for every worker to exit; kill (by pid) any still running after the timeout."""
        deadline_s = time.monotonic() + self.config.worker_exit_timeout_s
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.0, deadline_s - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5.0)


def freeze_startup_heap() -> None:
    """Once the router is built: what it holds to start (modules, tokenizer, app, cluster state, ~230k objects)
    lives as long as the process, so it is moved out of the cyclic collector's reach (`gc.freeze`, as vLLM does
    after startup) and full collections scan only what serving allocates. Measured with
    benchmarks/router_overhead.py's router (preble, pre-tokenized prompts): the two full collections of 3,000
    requests took 0.16-0.23 s before (~60 us a request, each a pause of ~0.1 s), 0.007 s after."""
    gc.collect()
    gc.freeze()


def _free_port(host: str) -> int:
    """A port free now (another process may take it before the router binds it: a start-up error, not a hang)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def _is_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=2.0) as response:
            return int(response.status) == 200
    except (OSError, ValueError):
        return False


def _bind_http(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise KvbatonError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def run_router_loop(main: Coroutine[object, object, T]) -> T:
    """Run the router's event loop on uvloop: per request it costs the HTTP server and the zmq sockets a
    fraction of asyncio's default selector loop (measured in benchmarks/router_overhead.py)."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def serve(config: ServeConfig) -> int:
    return run_router_loop(Launcher(config).run())
