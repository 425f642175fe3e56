"""`kvbaton serve --ray ADDRESS`: the worker processes placed on the nodes of a Ray cluster.

A local launch starts each worker as a child process of the router. With Ray, each worker gets a Ray
actor (`WorkerHost`) that holds the worker's share (`RayWorker`: its torch threads' CPUs and its
`--gpus-per-worker` GPUs once for each of its TP x PP rank processes), the actors spread over the
cluster's nodes; the actor starts the same `kvbaton worker` command as a child process
on its node (with that node's Python, and the node's IP for the KV receiver) and reports its exit.
Everything after that is the local launch's: the workers connect back to the router's RPC address,
which the launcher binds on its own node's IP so that every node reaches it, register, and are watched
through `RayWorkerProcess`, the `ProcessHandle` of the actor's child. Between nodes KV moves over TCP
(shared memory reaches one host only). With `--kv-store-gb` every node that holds workers runs a store node, on
its IP: the launcher's node the launcher's own, every other one a `StoreHost` actor's (pinned to that node, holding
no CPU). Each worker is told its node's (`--kv-store`: its saves go there, its loads read it first through shared
memory) and every node's (`--kv-store-nodes`: what its own lacks is read from the others over TCP). With
`--kv-store-gb auto` each of those other nodes sizes its own for the workers placed on it (twice their KV pools,
within half of its own /dev/shm's free space); the launcher's node, started before the placement, for all of them
within its own.

`--ray local` starts a single-node Ray instance on the loopback interface (to try it on one machine,
and for the tests); `--ray auto` joins the cluster running on this machine (`ray start --head`), and
`--ray HOST:PORT` the one at that address. Every node must run the same Python environment with
kvbaton installed, as vLLM asks of its Ray nodes. Ray is optional: `pip install 'kvbaton[ray]'`
(`make install` includes it).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeVar

from kvbaton.core.cluster_secret import ClusterSecret, worker_environment
from kvbaton.core.errors import KvbatonError

T = TypeVar("T")

LOCAL = "local"  # --ray local: start a single-node Ray instance on 127.0.0.1
CONNECT_TIMEOUT_S = 5.0  # a Ray cluster's address must take a TCP connection within this


def import_ray(address: str) -> ModuleType:
    """Ray, imported for `--ray ADDRESS`. A local instance must bind the loopback interface only: Ray reads
    whether to bind the machine's address once, when it is imported."""
    if address == LOCAL and "ray" not in sys.modules:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray's switch to its single-host binding
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        import ray
    except ImportError:
        raise KvbatonError("--ray needs Ray installed: pip install 'kvbaton[ray]'") from None
    return ray


def check_answers(address: str) -> None:
    """Refuse a cluster address where nothing takes a connection: `ray.init` would retry it for many minutes. The
    address is first resolved as `ray.init` resolves it (`auto`, RAY_ADDRESS, 127.0.0.1 -> this node's IP)."""
    if "://" in address:  # ray://: Ray Client connects on its own terms
        return
    from ray._private.services import canonicalize_bootstrap_address

    host, _, port = str(canonicalize_bootstrap_address(address)).rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise ConnectionError(f"nothing answers at {host}:{port} ({exc.strerror or exc})") from None


@dataclass(frozen=True, slots=True)
class RayWorker:
    """One worker to place: its id, its `kvbaton worker` arguments and what its actor holds on its node (a worker
    of TP x PP ranks holds each rank's share: the launcher's `ray_share`)."""

    worker_id: str
    args: tuple[str, ...]
    num_cpus: float = 0.0
    num_gpus: float = 0.0


def _shares_text(counts: Mapping[float, int], name: str) -> str:
    """'2 workers with 2 CPUs each', or '1 worker with 2 CPUs and 1 with 1 CPUs' where the workers differ."""
    parts = [f"{count} with {each:g} {name}s" for each, count in sorted(counts.items(), reverse=True)]
    if len(parts) == 1:
        return parts[0] + " each"
    return ", ".join(parts[:-1]) + " and " + parts[-1]


def placement_refusal(workers: Sequence[RayWorker], nodes: Sequence[Mapping[str, float]]) -> str:
    """Why the alive nodes (each one's Ray resources) cannot hold `workers` at all; "" when they may. Only what
    cannot be placed whatever Ray does is refused: more of a resource than the cluster has, or more workers with a
    share (or more) than the nodes have room for such a share (a worker runs on one node)."""
    for name, field in (("CPU", "num_cpus"), ("GPU", "num_gpus")):
        need = sum(getattr(worker, field) for worker in workers)
        have = sum(float(node.get(name, 0.0)) for node in nodes)
        if need > have + 1e-9:
            counts: dict[float, int] = {}
            for worker in workers:
                counts[getattr(worker, field)] = counts.get(getattr(worker, field), 0) + 1
            return (f"the Ray cluster has {have:g} {name}s; its {len(workers)} workers ({_shares_text(counts, name)}) "
                    f"need {need:g} (see --threads-per-worker, --gpus-per-worker, -tp/-pp)")
    for share in sorted({(worker.num_cpus, worker.num_gpus) for worker in workers}, reverse=True):
        wanted = [(name, each) for name, each in zip(("CPU", "GPU"), share) if each]
        if not wanted:
            continue
        held = [w for w in workers if w.num_cpus >= share[0] and w.num_gpus >= share[1]]
        room = sum(min(int(float(node.get(name, 0.0)) / each + 1e-9) for name, each in wanted) for node in nodes)
        if room < len(held):
            text = " and ".join(f"{each:g} {name}s" for name, each in wanted)
            more = "" if all((w.num_cpus, w.num_gpus) == share for w in held) else " or more"
            have = "; ".join(", ".join(f"{float(node.get(name, 0.0)):g} {name}s" for name, _ in wanted)
                             for node in nodes)
            return (f"the Ray cluster's nodes can hold {room} of the {len(held)} workers with {text}{more} each (a "
                    f"worker runs on one node); its nodes have {have} (see --threads-per-worker, --gpus-per-worker, "
                    f"-tp/-pp)")
    return ""


class WorkerHost:
    """A Ray actor's body: one `kvbaton worker` process on the actor's node (Ray turns it into an actor class)."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None

    def start(self, worker_args: Sequence[str], secret_hex: str, extra_environment: Mapping[str, str] | None = None
              ) -> tuple[str, int]:
        """Start the worker with `worker_args` (after `kvbaton worker`), this node's IP for its KV receiver and the
        cluster secret in its environment (never on its command line); returns (node IP, worker pid). That
        environment is the actor's, with the CUDA_VISIBLE_DEVICES Ray set to the actor's GPUs (`--gpus-per-worker`):
        the worker's `--device cuda` is the first of them; `extra_environment` (the launcher's, e.g. the store's
        streaming copies) replaces what it names."""
        import ray

        node_ip = ray.util.get_node_ip_address()
        environment = worker_environment(ClusterSecret.from_hex(secret_hex), {**os.environ, **(extra_environment or {})})
        self._process = subprocess.Popen([sys.executable, "-m", "kvbaton.cli", "worker", *worker_args,
                                          "--kv-host", node_ip], env=environment)
        return node_ip, self._process.pid

    def node(self) -> tuple[str, str]:
        """(Ray node id, IP) of the node this actor was placed on."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def wait(self) -> int:
        """Block until the worker exits; its exit code."""
        assert self._process is not None, "start() first"
        return self._process.wait()

    def send_signal(self, signum: int) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signum)


class StoreHost:
    """A Ray actor's body: the KV store node of the actor's node, its own process (`store_server.start_process`)."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[str] | None = None

    def start(self, store_args: Sequence[str], secret_hex: str) -> tuple[str, int]:
        """Start the node with `store_args` (all but its host: this node's IP) and the cluster secret; its address
        and pid."""
        import ray

        from kvbaton.server.store_server import start_process

        self._process, address = start_process(store_args, ClusterSecret.from_hex(secret_hex),
                                               ray.util.get_node_ip_address())
        return address, self._process.pid

    def stop(self) -> None:
        from kvbaton.server.store_server import stop_process

        process, self._process = self._process, None
        if process is not None:
            stop_process(process)


def stores_to_start(worker_nodes: Sequence[str], own_node: str) -> list[str]:
    """The nodes (Ray node ids) that need a store node started: each one holding a worker, once, in the order first
    seen, but `own_node` (the launcher's, which runs its own)."""
    return [node for node in dict.fromkeys(worker_nodes) if node != own_node]


def with_store_nodes(args: Sequence[str], own: str, nodes: Sequence[str]) -> tuple[str, ...]:
    """A worker's arguments with its host's store node (`own`) and the cluster's (`nodes`, own among them)."""
    return (*args, "--kv-store", own, "--kv-store-nodes", ",".join(nodes))


class RayWorkerProcess:
    """A worker started by a `WorkerHost` actor, seen as the launcher sees a local `subprocess.Popen`: `poll`
    (the cluster's `ProcessHandle`), `wait(timeout)`, `kill`, `pid` (on `node_ip`)."""

    def __init__(self, ray: ModuleType, actor: Any, node_ip: str, pid: int) -> None:
        self._ray = ray
        self.actor = actor
        self.node_ip = node_ip
        self.pid = pid
        self.returncode: int | None = None
        self._exit = actor.wait.remote()  # resolves with the exit code; with an error if the actor or node died

    def poll(self) -> int | None:
        if self.returncode is None:
            ready, _ = self._ray.wait([self._exit], timeout=0)
            if ready:
                self.returncode = self._exit_code()
        return self.returncode

    def _exit_code(self) -> int:
        try:
            return int(self._ray.get(self._exit))
        except self._ray.exceptions.RayError:  # its actor, or its node, is gone: so is the process it ran
            return -signal.SIGKILL

    def wait(self, timeout: float | None = None) -> int:
        ready, _ = self._ray.wait([self._exit], timeout=timeout)
        if not ready:
            raise subprocess.TimeoutExpired(f"kvbaton worker (pid {self.pid} on {self.node_ip})", timeout or 0.0)
        code = self.poll()
        assert code is not None
        return code

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            self.actor.send_signal.remote(signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


async def _gather(refs: Sequence[Any]) -> list[Any]:
    """Ray's object refs awaited together; cancelled (a timeout, a stop), the gather's CancelledError is retrieved here
    rather than logged by asyncio as never retrieved."""
    gathered = asyncio.gather(*refs)
    try:
        return await gathered
    finally:
        if gathered.done() and not gathered.cancelled():
            gathered.exception()


async def _placed_within(placing: Awaitable[T], timeout_s: float, num_workers: int) -> T:
    """`placing`'s result, or a clear error once Ray has not placed the workers within `timeout_s`."""
    try:
        return await asyncio.wait_for(placing, timeout_s)
    except TimeoutError:
        raise KvbatonError(f"Ray did not place all {num_workers} workers within {timeout_s:g} s") from None


class RayPlacement:
    """The Ray cluster the workers run on: connect, start one actor per worker, and let go of it all."""

    def __init__(self, address: str) -> None:
        ray = self.ray = import_ray(address)
        if ray.is_initialized():
            raise KvbatonError("Ray is already initialised in this process")
        try:
            if address == LOCAL:  # "local", not None: a new instance even where RAY_ADDRESS or `ray start` name one
                ray.init(address=LOCAL, include_dashboard=False)
            else:
                check_answers(address)
                ray.init(address=address)
        except (ConnectionError, ValueError, RuntimeError) as exc:  # no cluster there, a malformed address
            raise KvbatonError(f"cannot join the Ray cluster at {address!r}: {exc}") from None
        self._actors: list[Any] = []
        self._placed: tuple[list[Any], list[tuple[str, str]]] | None = None  # actors `place` placed ahead, where
        self._stores: list[Any] = []  # the StoreHost actors (one per node holding workers, but this one's)
        # store node address -> (the IP of the Ray node it runs on, its pid there), for the nodes but this one
        self.store_nodes: dict[str, tuple[str, int]] = {}
        self._host_class = ray.remote(WorkerHost)
        self._store_class = ray.remote(StoreHost)

    @property
    def node_ip(self) -> str:
        """This process's node: where the router's RPC socket is bound for the workers to reach it."""
        return str(self.ray.util.get_node_ip_address())

    @property
    def num_nodes(self) -> int:
        return sum(1 for node in self.ray.nodes() if node.get("Alive"))

    def check_resources(self, workers: Sequence[RayWorker]) -> None:
        """Refuse what the cluster cannot place at all, rather than wait for it until the startup timeout."""
        refusal = placement_refusal(workers, [node.get("Resources", {}) for node in self.ray.nodes()
                                              if node.get("Alive")])
        if refusal:
            raise KvbatonError(refusal)

    async def start(self, workers: Sequence[RayWorker], timeout_s: float, secret: ClusterSecret,
                    environment: Mapping[str, str] | None = None,
                    store_args: Callable[[int], Sequence[str]] | None = None,
                    local_store: str = "") -> dict[str, RayWorkerProcess]:
        """One actor per worker, holding its share, spread over the nodes (those `place` placed ahead, if it did);
        returns once every worker process runs.
        Each actor hands `secret` to its worker: it travels in the actor call, over Ray's own channel (which
        authenticates with RAY_AUTH_TOKEN where the cluster runs `RAY_AUTH_MODE=token`).

        With `store_args` (a store node's arguments but its host, for the number of workers on its node) the workers
        are placed first, then every node that holds one gets its store node (this node's is `local_store`, the
        launcher's), then each worker starts told its node's and every node's (`with_store_nodes`)."""
        placed_ahead, self._placed = self._placed, None
        if placed_ahead is not None:
            actors, where = placed_ahead
            if len(actors) != len(workers):
                raise KvbatonError(f"{len(actors)} actors placed ahead for {len(workers)} workers")
        else:
            actors, where = self._new_actors(workers), None
        started = await _placed_within(self._start_all(actors, workers, secret, environment, store_args, local_store,
                                                       where), timeout_s, len(workers))
        return {worker.worker_id: RayWorkerProcess(self.ray, actor, node_ip, pid)
                for worker, actor, (node_ip, pid) in zip(workers, actors, started)}

    async def place(self, workers: Sequence[RayWorker], timeout_s: float) -> int:
        """Place the actors of `workers` (their shares held, their arguments not needed yet) ahead of `start`, which
        then starts the workers in them, in the same order; returns once Ray placed them all, how many are on this
        node (what sizes this node's store node before the router that reads it starts)."""
        actors = self._new_actors(workers)
        where = await _placed_within(_gather([actor.node.remote() for actor in actors]), timeout_s, len(workers))
        self._placed = (actors, where)
        own = self.ray.get_runtime_context().get_node_id()
        return sum(1 for node, _ in where if node == own)

    def _new_actors(self, workers: Sequence[RayWorker]) -> list[Any]:
        """One actor per worker, holding its share, spread over the nodes (Ray places them as they come)."""
        self.check_resources(workers)
        actors = []
        for worker in workers:
            # Threaded: `wait` blocks for the whole life of the worker while `send_signal` still gets through.
            actor = self._host_class.options(num_cpus=worker.num_cpus, num_gpus=worker.num_gpus,
                                             scheduling_strategy="SPREAD", max_concurrency=4).remote()
            actors.append(actor)
            self._actors.append(actor)
        return actors

    async def _start_all(self, actors: Sequence[Any], workers: Sequence[RayWorker], secret: ClusterSecret,
                         environment: Mapping[str, str] | None, store_args: Callable[[int], Sequence[str]] | None,
                         local_store: str, where: Sequence[tuple[str, str]] | None = None) -> list[tuple[str, int]]:
        args = [worker.args for worker in workers]
        if store_args:
            if where is None:  # (node id, IP), once each is placed
                where = await _gather([actor.node.remote() for actor in actors])
            own = self.ray.get_runtime_context().get_node_id()
            addresses = {own: local_store}
            starting = stores_to_start([node for node, _ in where], own)
            ips = dict(where)
            stores = [self._store_class.options(num_cpus=0, scheduling_strategy=self._on_node(node)).remote()
                      for node in starting]
            self._stores.extend(stores)
            on_node = Counter(node for node, _ in where)
            for node, (address, pid) in zip(starting, await _gather([store.start.remote(list(store_args(on_node[node])),
                                                                                         secret.to_hex())
                                                                      for node, store in zip(starting, stores)])):
                addresses[node] = address
                self.store_nodes[address] = (ips[node], pid)
            nodes = list(addresses.values())
            args = [with_store_nodes(worker.args, addresses[node], nodes) for worker, (node, _) in zip(workers, where)]
        return await _gather([actor.start.remote(list(arguments), secret.to_hex(), dict(environment or {}))
                              for actor, arguments in zip(actors, args)])

    def _on_node(self, node_id: str) -> Any:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return NodeAffinitySchedulingStrategy(node_id, soft=False)

    def close(self) -> None:
        """End the actors, killing a worker process still running under one, and disconnect; a local instance
        stops with it."""
        if self._actors:  # a worker still running (a start that failed half-way) goes down with its actor
            stopped = [actor.send_signal.remote(signal.SIGKILL) for actor in self._actors]
            self.ray.wait(stopped, num_returns=len(stopped), timeout=5.0)
        for actor in self._actors:
            self.ray.kill(actor)
        self._actors.clear()
        if self._stores:  # after the workers: their last saves are dropped, not sent to a node that is gone
            stopped = [store.stop.remote() for store in self._stores]
            self.ray.wait(stopped, num_returns=len(stopped), timeout=20.0)
        for store in self._stores:
            self.ray.kill(store)
        self._stores.clear()
        self.ray.shutdown()
