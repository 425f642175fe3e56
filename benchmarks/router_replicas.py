"""Router replicas: 1 and 2 kvbaton routers in front of the same 8 instant workers, sglang-router cache_aware in the
same run: req/s, CPU per request of each router process, cache-hit ratio and busiest/mean worker load. One JSON line.

Setup (router_overhead.py's, whose pieces this reuses): 2,000-character prompts, 80 % of each a prefix shared within
one of 8 groups; non-streaming `POST /v1/completions`, 4 output tokens; closed-loop clients over keep-alive
connections, `--concurrency` in flight in all. With 2 routers there is one client process per router, each with half
the concurrency and half the requests (what a load balancer spreading connections evenly would send).

- kvbaton:<N>: N router processes (router_overhead.py's `kvbaton-router` role: ClusterManager + the OpenAI app), each
  its own RPC socket; 8 fake workers in one process, each with one DEALER per router (as `kvbaton worker --router
  A,B` has), registered with every router. Unlike router_overhead.py's fake workers, these keep a prefix cache: the
  chained block hashes of every prompt they served (the router's own hashing), so a request's cached tokens are the
  leading blocks its worker already holds, and each new block goes out as a STORED KV event to every router — the
  sync the replicas rely on. Workers answer at once and report no queue (`num_queued_prefill_tokens` 0), or, with
  `--service-us-per-token T`, serve one request at a time for T per uncached token and report their queue in every
  heartbeat: then routers that piled onto one worker between heartbeats would show in busiest/mean.
- kvbaton:1:half: one router with the load one of the two replicas gets, the baseline that isolates the sync's cost
  (a router with half the connections handles fewer requests per event-loop wakeup, which costs CPU per request of
  itself).
- kvbaton:1:paced: the like-with-like baseline of a replica: one router with a replica's share of requests and
  connections, its client paced to the requests per second each replica of this round's kvbaton:2 served (median of
  the two), so the lone router and a replica run at one rate over one length of time; a replica's CPU per request over
  this one (`replica_cpu_over_lone_at_the_replicas_rate`) leaves the sync's cost and the other router's share of the
  machine. `targets.replica_cpu_over_lone` keeps the first figure: the lone router at full load (twice a replica's rate).
- kvbaton:2:one: two routers, all the load on the first; the second only keeps up with the workers (heartbeats, the
  KV events of the first's requests), so its CPU over the run's requests is the sync's cost per request, measured
  directly rather than as the difference of two noisy figures.
- sglang:cache_aware: `python -m sglang_router.launch_router` over 8 fake HTTP workers that keep the same kind of
  cache over 64-character blocks of the prompt text (sglang-router routes on text; it does not tokenize).

Per system: hit ratio = cached / prompt units summed over the workers (tokens for kvbaton, characters for sglang),
busiest/mean = the most requests one worker served over the mean, both over the measured requests only. CPU is
utime+stime of each router process over the measured requests (router_overhead.py's `process_tree_cpu_s`); the
client's is its processes' own over the load (`time.process_time`). Each router's idle CPU (heartbeats, pings, its
monitor) is sampled for 2 s before the run; `*_above_idle` subtracts it over the run's length: the per-request work
alone, which is what the replicas' sync could add to (a replica serves half the requests over a longer run, so its
fixed per-second cost weighs twice as much per request in the raw figure). Every process here shares this machine's cores (`cores` says how many
each could run on): the aggregate req/s of 2 routers is bounded by the machine, not by the routers.

    .venv/bin/python benchmarks/router_replicas.py [--num-requests 2000 --num-warmup 200]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import zmq

from kvbaton.cache.events import KVEvent, KVEventKind
from kvbaton.cache.hashing import CacheKey, hash_block_tokens
from kvbaton.core.cluster_secret import SECRET_ENV, ClusterSecret
from kvbaton.server import rpc
from kvbaton.server.base import TokenDelta
from kvbaton.server.rpc_auth import secure_dealer
from overhead_backends import REPLY_TEXT, REPLY_TOKEN_IDS, cluster_secret, serve_http_worker
from router_overhead import MODEL, PROFILE_ENV, _body, _spawn, _stop, _wait_ready, free_port, make_prompts, process_tree_cpu_s

BLOCK_SIZE = 16
TEXT_BLOCK_CHARS = 64
IDLE_S = 2.0  # how long each router's idle CPU is sampled before the measured run
KEY = CacheKey("fake-revision", "fake-layout")  # what the fake workers register with: the routers hash under it


class WorkerTally:
    """One fake worker's prefix cache (chained block hashes) and what it served."""

    def __init__(self) -> None:
        self.cached: set[int] = set()
        self.seq = 0
        self.num_requests = 0
        self.prompt_units = 0
        self.cached_units = 0

    def serve(self, hashes: list[int], num_units: int, unit_per_block: int) -> tuple[int, list[int]]:
        """(cached units, new block hashes) of one request."""
        hit = 0
        while hit < len(hashes) and hashes[hit] in self.cached:
            hit += 1
        new = hashes[hit:]
        self.cached.update(new)
        cached_units = min(hit * unit_per_block, num_units)
        self.num_requests += 1
        self.prompt_units += num_units
        self.cached_units += cached_units
        return cached_units, new

    def as_json(self) -> dict[str, int]:
        return {"num_requests": self.num_requests, "prompt_units": self.prompt_units,
                "cached_units": self.cached_units}


def _write_summary(path: str, tallies: dict[str, WorkerTally]) -> None:
    temporary = path + ".tmp"
    Path(temporary).write_text(json.dumps({w: t.as_json() for w, t in tallies.items()}))
    os.replace(temporary, path)


def run_cached_rpc_workers(router_addresses: list[str], num_workers: int, summary_path: str,
                           service_us_per_token: float = 0.0, kv_events: str = "heartbeat") -> None:
    """`num_workers` fake workers, each registered with every router; see the module docstring. With
    `service_us_per_token`, each worker serves its requests one at a time, each taking that long per uncached prompt
    token, and its heartbeats report the queue (waiting requests, their uncached tokens) as a real worker's do.
    `kv_events`: "heartbeat" sends a worker's new KV events in its heartbeat's frame (`rpc.Heartbeat`), as
    `kvbaton worker` does (server/worker.py `_send_heartbeat`); "immediate" sends one frame per request at once."""
    context = zmq.Context()
    secret = cluster_secret()
    sockets: dict[zmq.Socket, str] = {}
    by_worker: dict[str, list[zmq.Socket]] = {}
    for i in range(num_workers):
        worker_id = f"fake{i:02d}"
        for address in router_addresses:
            socket = context.socket(zmq.DEALER)
            secure_dealer(socket, secret)
            socket.setsockopt(zmq.IDENTITY, worker_id.encode())
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(address)
            socket.send(rpc.encode(rpc.Register(worker_id, "mixed", MODEL, KEY.model_revision, KEY.kv_layout,
                                                BLOCK_SIZE, 100_000, "", os.getpid())))
            sockets[socket] = worker_id
            by_worker.setdefault(worker_id, []).append(socket)
    tallies = {worker_id: WorkerTally() for worker_id in by_worker}
    # Per worker: its queue of (done at, socket, reply frame, uncached tokens) and when it is busy until.
    queues: dict[str, collections.deque[tuple[float, zmq.Socket, bytes, int]]] = {w: collections.deque()
                                                                              for w in by_worker}
    busy_until = dict.fromkeys(by_worker, 0.0)
    pending_events: dict[str, list[list[object]]] = {w: [] for w in by_worker}  # for the next heartbeat
    queued_tokens = dict.fromkeys(by_worker, 0)
    poller = zmq.Poller()
    for socket in sockets:
        poller.register(socket, zmq.POLLIN)
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    heartbeat_s, next_heartbeat_at, next_summary_at = 0.05, 0.0, 0.0
    while not stopped.is_set():
        now = time.monotonic()
        for worker_id, queue in queues.items():
            while queue and queue[0][0] <= now:
                _, reply_socket, frame, tokens = queue.popleft()
                queued_tokens[worker_id] -= tokens
                reply_socket.send(frame)
        next_done = min((queue[0][0] for queue in queues.values() if queue), default=now + 0.01)
        for socket, _ in poller.poll(max(0, min(10, int((next_done - now) * 1000)))):
            worker_id = sockets[socket]
            while True:
                try:
                    message = rpc.decode(socket.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                if isinstance(message, rpc.AddRequest):
                    tally = tallies[worker_id]
                    prompt = message.prompt_token_ids
                    hashes = hash_block_tokens(KEY.with_tenant(message.tenant), prompt, BLOCK_SIZE)
                    cached, new = tally.serve(hashes, len(prompt), BLOCK_SIZE)
                    if new:  # every router hears the new blocks (the replicas' shared index)
                        tally.seq += 1
                        parent = hashes[len(hashes) - len(new) - 1] if len(new) < len(hashes) else \
                            KEY.with_tenant(message.tenant).root_hash
                        event = KVEvent(tally.seq, KVEventKind.STORED, tuple(new), parent, BLOCK_SIZE).to_wire()
                        if kv_events == "heartbeat":
                            pending_events[worker_id].append(event)
                        else:
                            frame = rpc.encode(rpc.KVEvents(worker_id, (event,)))
                            for peer in by_worker[worker_id]:
                                peer.send(frame)
                    delta = TokenDelta(message.request_id, REPLY_TOKEN_IDS, REPLY_TEXT, True, "length", len(prompt),
                                       cached, worker_id=worker_id)
                    frame = rpc.encode(rpc.TokenDeltas(worker_id, (delta,)))
                    if service_us_per_token <= 0:
                        socket.send(frame)
                        continue
                    uncached = len(prompt) - cached
                    start_at = max(time.monotonic(), busy_until[worker_id])
                    busy_until[worker_id] = start_at + uncached * service_us_per_token / 1e6
                    queues[worker_id].append((busy_until[worker_id], socket, frame, uncached))
                    queued_tokens[worker_id] += uncached
                elif isinstance(message, rpc.RegisterAck):
                    heartbeat_s = message.heartbeat_interval_s
                elif isinstance(message, rpc.SnapshotRequest):
                    socket.send(rpc.encode(rpc.SnapshotResponse(worker_id, tallies[worker_id].seq, ())))
                elif isinstance(message, rpc.Shutdown):
                    socket.send(rpc.encode(rpc.Goodbye(worker_id, "shutdown")))
        now = time.monotonic()
        if now >= next_heartbeat_at:
            next_heartbeat_at = now + heartbeat_s
            frames: dict[str, bytes] = {}
            for worker_id, events in pending_events.items():
                stats = rpc.Stats(worker_id, len(queues[worker_id]), 0, queued_tokens[worker_id], 0, 100_000,
                                  len(tallies[worker_id].cached), 0, 0, 0, tallies[worker_id].num_requests, now)
                # The new KV events travel in the heartbeat's frame (rpc.Heartbeat), as kvbaton worker sends them.
                frames[worker_id] = rpc.encode(rpc.Heartbeat(rpc.KVEvents(worker_id, tuple(events)), stats)
                                               if events else stats)
                events.clear()
            for socket, worker_id in sockets.items():
                socket.send(frames[worker_id])
        if now >= next_summary_at:
            next_summary_at = now + 0.2
            _write_summary(summary_path, tallies)
    _write_summary(summary_path, tallies)
    for socket in sockets:
        socket.close()
    context.term()


def run_cached_http_workers(ports: list[int], summary_path: str) -> None:
    """OpenAI-style fake workers (overhead_backends.py's `serve_http_worker`) that keep a cache of 64-character text
    blocks: each completion's prompt is tallied against its worker's cache before it is answered."""
    tallies = {f"http{port}": WorkerTally() for port in ports}

    def tally_completion(tally: WorkerTally) -> Callable[[bytes], None]:
        def on_completion(body: bytes) -> None:
            prompt = str(json.loads(body).get("prompt", ""))
            hashes, parent = [], 0
            for i in range(0, len(prompt) - TEXT_BLOCK_CHARS + 1, TEXT_BLOCK_CHARS):
                parent = hash((parent, prompt[i:i + TEXT_BLOCK_CHARS]))
                hashes.append(parent)
            tally.serve(hashes, len(prompt), TEXT_BLOCK_CHARS)

        return on_completion

    async def main() -> None:
        servers = [await serve_http_worker(port, MODEL, tally_completion(tallies[f"http{port}"])) for port in ports]
        stopped = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopped.set)
        while not stopped.is_set():
            _write_summary(summary_path, tallies)
            try:
                await asyncio.wait_for(stopped.wait(), 0.2)
            except TimeoutError:
                pass
        _write_summary(summary_path, tallies)
        for server in servers:
            server.close()

    asyncio.run(main())


def _read_summary(path: str) -> dict[str, dict[str, int]]:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def _run_clients(script: str, urls: list[str], bodies_path: str, num_requests: int, concurrency: int,
                 first_body: int, timeout_s: float, rate_per_s: float = 0.0) -> tuple[list[dict[str, object]], float]:
    """One closed-loop client per URL at once (its share of requests and connections; each paced to `rate_per_s`
    when given); their results and the CPU seconds the clients used."""
    share, connections = num_requests // len(urls), max(1, concurrency // len(urls))
    processes = [subprocess.Popen([sys.executable, script, "--role", "load", "--url", f"{url}/v1/completions",
                                   "--bodies", bodies_path, "--num-requests", str(share),
                                   "--first-body", str(first_body + i * share), "--concurrency", str(connections),
                                   "--rate", str(rate_per_s)],
                                  stdout=subprocess.PIPE, text=True)
                 for i, url in enumerate(urls)]
    results = []
    for process in processes:
        output, _ = process.communicate(timeout=timeout_s + 60.0)
        if process.returncode != 0:
            raise RuntimeError(f"load client exited with {process.returncode}")
        results.append(json.loads(output.strip().splitlines()[-1]))
    return results, sum(float(r["cpu_s"]) for r in results)  # type: ignore[arg-type]


def _cores(pid: int) -> int:
    try:
        return len(os.sched_getaffinity(pid))
    except OSError:
        return 0


def measure(system: str, args: argparse.Namespace, script: str, bodies_path: str, tmp: str) -> dict[str, object]:
    kind, variant, *rest = system.split(":")
    # ":half": one router with the load one of two replicas gets (half the requests and connections), so that what
    # a replica adds over it is the sync alone, not the smaller batches a half-loaded event loop handles per wakeup.
    # ":one": two routers, all the load on the first: the second does nothing but keep up with the workers (their
    # heartbeats and the KV events of the first router's requests), so its CPU is the sync's cost alone.
    # ":paced": as ":half", and its client is paced to the per-router rate of this round's kvbaton:2 (each replica's
    # requests per second): a lone router at a replica's rate, concurrency and number of requests, so that what a
    # replica costs more per request is the sync (and sharing the machine with the other router), not the load.
    share = 0.5 if rest in (["half"], ["paced"]) else 1.0
    rate_per_s = 0.0
    if rest == ["paced"]:
        rate_per_s = float(getattr(args, "replica_rps", 0.0))
        if rate_per_s <= 0:
            raise SystemExit(f"{system} needs kvbaton:2 earlier in --systems (its replicas' rate)")
    loaded_routers = 1 if rest == ["one"] else int(variant) if kind == "kvbaton" else 1
    num_requests, concurrency = int(args.num_requests * share), int(args.concurrency * share)
    summary_path = os.path.join(tmp, f"{kind}-{variant}-{share}.summary.json")
    routers: list[subprocess.Popen[bytes]] = []
    urls: list[str] = []
    if kind == "kvbaton":
        rpc_ports = [free_port() for _ in range(int(variant))]
        workers = _spawn([script, "--role", "cached-rpc-workers", "--rpc-ports", ",".join(map(str, rpc_ports)),
                          "--num-workers", str(args.num_workers), "--summary", summary_path,
                          "--service-us-per-token", str(args.service_us_per_token), "--kv-events", args.kv_events])
        for rpc_port in rpc_ports:
            http_port = free_port()
            routers.append(_spawn([str(Path(script).with_name("router_overhead.py")), "--role", "kvbaton-router",
                                   "--policy", args.policy, "--http-port", str(http_port), "--rpc-port",
                                   str(rpc_port), "--num-workers", str(args.num_workers)]))
            urls.append(f"http://127.0.0.1:{http_port}")
    else:
        ports = [free_port() for _ in range(args.num_workers)]
        workers = _spawn([script, "--role", "cached-http-workers", "--ports", ",".join(map(str, ports)),
                          "--summary", summary_path])
        time.sleep(0.5)
        http_port = free_port()
        routers.append(subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                                         "--port", str(http_port), "--policy", variant, "--log-level", "warn",
                                         "--worker-urls", *(f"http://127.0.0.1:{p}" for p in ports)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        urls.append(f"http://127.0.0.1:{http_port}")
    processes = [*routers, workers]
    try:
        first = json.loads(Path(bodies_path).read_text())[0].encode()
        for url in urls:
            _wait_ready(url, first, processes, args.startup_timeout_s)
        _run_clients(script, urls[:loaded_routers], bodies_path, args.num_warmup, concurrency, 0,
                     args.load_timeout_s)
        # What each router burns with no request (heartbeats of every worker, pings, its monitor), over IDLE_S.
        idle_before = [process_tree_cpu_s(r.pid) for r in routers]
        time.sleep(IDLE_S)
        idle_cpu_s_per_s = [(process_tree_cpu_s(r.pid) - b) / IDLE_S for r, b in zip(routers, idle_before)]
        before, cpu_before = _read_summary(summary_path), [process_tree_cpu_s(r.pid) for r in routers]
        results, client_cpu_s = _run_clients(script, urls[:loaded_routers], bodies_path, num_requests, concurrency,
                                             args.num_warmup, args.load_timeout_s, rate_per_s)
        cpu_after = [process_tree_cpu_s(r.pid) for r in routers]
        time.sleep(0.5)  # the summary is written every 0.2 s
        after = _read_summary(summary_path)
        cores = {"routers": [_cores(r.pid) for r in routers], "workers": _cores(workers.pid),
                 "machine": os.cpu_count()}
    finally:
        _stop(processes)
    num_ok = [int(r["num_ok"]) for r in results]  # type: ignore[call-overload]
    elapsed_s = max(float(r["elapsed_s"]) for r in results)  # type: ignore[arg-type]
    served = {w: after[w]["num_requests"] - before.get(w, {}).get("num_requests", 0) for w in after}
    prompt = sum(after[w]["prompt_units"] - before.get(w, {}).get("prompt_units", 0) for w in after)
    cached = sum(after[w]["cached_units"] - before.get(w, {}).get("cached_units", 0) for w in after)
    figures: dict[str, object] = {
        "rps": round(sum(num_ok) / elapsed_s, 1),
        "rps_per_router": [round(int(r["num_ok"]) / float(r["elapsed_s"]), 1) for r in results],  # type: ignore[call-overload,arg-type]
        "paced_to_rps": rate_per_s or None,
        "router_cpu_us_per_request": [round(1e6 * (a - b) / max(n, 1), 1)
                                      for a, b, n in zip(cpu_after, cpu_before, num_ok)],
        # The same less what the router burns idle over the run's length: the per-request work alone.
        "router_cpu_us_per_request_above_idle": [round(1e6 * (a - b - idle * elapsed_s) / max(n, 1), 1)
                                                 for a, b, idle, n in zip(cpu_after, cpu_before, idle_cpu_s_per_s,
                                                                          num_ok)],
        "router_idle_cpu_ms_per_s": [round(1e3 * idle, 1) for idle in idle_cpu_s_per_s],
        # Routers given no load: their CPU over every request of the run (the sync's cost per cluster request).
        "unloaded_router_cpu_us_per_cluster_request": [
            round(1e6 * (a - b) / max(sum(num_ok), 1), 1) for a, b in
            zip(cpu_after[len(num_ok):], cpu_before[len(num_ok):])],
        "unloaded_router_cpu_us_per_cluster_request_above_idle": [
            round(1e6 * (a - b - idle * elapsed_s) / max(sum(num_ok), 1), 1) for a, b, idle in
            zip(cpu_after[len(num_ok):], cpu_before[len(num_ok):], idle_cpu_s_per_s[len(num_ok):])],
        "elapsed_s": round(elapsed_s, 3),
        "client_cpu_us_per_request": round(1e6 * client_cpu_s / max(sum(num_ok), 1), 1),
        "hit_ratio": round(cached / max(prompt, 1), 4),
        "busiest_over_mean": round(max(served.values()) / statistics.mean(served.values()), 3) if served else None,
        "requests_per_worker": [served[w] for w in sorted(served)],
        "num_ok": sum(num_ok), "statuses": [r["statuses"] for r in results], "cores": cores,
    }
    print(f"{system}: {json.dumps(figures)}", file=sys.stderr, flush=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", default="main", choices=("main", "cached-rpc-workers", "cached-http-workers",
                                                           "load"))
    parser.add_argument("--systems",
                        default="kvbaton:1,kvbaton:1:half,kvbaton:2,kvbaton:1:paced,kvbaton:2:one,sglang:cache_aware",
                        help="kvbaton:<number of routers>[:half|:paced|:one] | sglang:<policy>, comma-separated "
                             "(kvbaton:1:paced after kvbaton:2)")
    parser.add_argument("--policy", default="preble", help="the kvbaton routers' policy")
    parser.add_argument("--num-workers", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=2000, help="measured, over all routers")
    parser.add_argument("--num-warmup", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=64, help="in flight over all routers")
    parser.add_argument("--prompt-chars", type=int, default=2000)
    parser.add_argument("--shared-fraction", type=float, default=0.8)
    parser.add_argument("--num-groups", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--service-us-per-token", type=float, default=0.0,
                        help="kvbaton's fake workers take this long per uncached prompt token, one request at a time, "
                             "and report their queue in heartbeats (0: instant, as router_overhead.py's)")
    parser.add_argument("--kv-events", default="heartbeat", choices=("heartbeat", "immediate"),
                        help="when kvbaton's fake workers send new KV events: in each heartbeat's frame, as kvbaton "
                             "worker does, or one frame per request at once")
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds over every system, interleaved (each round runs each system once); medians and "
                             "the spread (min, max) over the rounds are reported")
    parser.add_argument("--profile-dir", default="",
                        help="run each kvbaton router under cProfile and write <dir>/router-<rpc port>.prof when it "
                             "stops (its CPU figures then include the profiler's own)")
    parser.add_argument("--startup-timeout-s", type=float, default=120.0)
    parser.add_argument("--load-timeout-s", type=float, default=120.0)
    # Internal roles.
    parser.add_argument("--rpc-ports", default="")
    parser.add_argument("--ports", default="")
    parser.add_argument("--summary", default="")
    parser.add_argument("--url", default="")
    parser.add_argument("--bodies", default="")
    parser.add_argument("--first-body", type=int, default=0)
    parser.add_argument("--rate", type=float, default=0.0)
    args = parser.parse_args()
    script = os.path.abspath(__file__)
    if args.role == "cached-rpc-workers":
        run_cached_rpc_workers([f"tcp://127.0.0.1:{p}" for p in args.rpc_ports.split(",")], args.num_workers,
                               args.summary, args.service_us_per_token, args.kv_events)
        return
    if args.role == "cached-http-workers":
        run_cached_http_workers([int(p) for p in args.ports.split(",")], args.summary)
        return
    if args.role == "load":
        from overhead_backends import run_load

        bodies = [b.encode() for b in json.loads(Path(args.bodies).read_text())]
        cpu_before_s = time.process_time()  # the load alone: not this process's start-up
        result = run_load(args.url, bodies, args.num_requests, args.concurrency, args.load_timeout_s, args.first_body,
                          rate_per_s=args.rate)
        print(json.dumps({**result, "cpu_s": time.process_time() - cpu_before_s}))
        return
    if args.profile_dir:
        os.makedirs(args.profile_dir, exist_ok=True)
        os.environ[PROFILE_ENV] = os.path.abspath(args.profile_dir)  # the routers (children) read it
    os.environ.setdefault(SECRET_ENV, ClusterSecret.generate().to_hex())  # the routers' and workers' (children)
    num_prompts = args.num_warmup + args.num_requests
    prompts = make_prompts(num_prompts, args.prompt_chars, args.shared_fraction, args.num_groups, args.seed)
    systems = [s for s in args.systems.split(",") if s]
    runs: dict[str, list[dict[str, object]]] = {system: [] for system in systems}
    results: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        bodies_path = os.path.join(tmp, "text.json")
        Path(bodies_path).write_text(json.dumps([_body(p) for p in prompts]))
        for system in systems:
            if system.startswith("sglang:"):
                try:
                    import sglang_router  # noqa: F401 - only whether it is installed
                except ImportError:
                    results[system] = "not installed (pip install sglang-router)"
        for _ in range(args.repeats):  # interleaved: a drift in the machine's load spreads over every system
            for system in systems:
                if system not in results:
                    runs[system].append(measure(system, args, script, bodies_path, tmp))
                    if system == "kvbaton:2":  # the pace of this round's kvbaton:1:paced: a replica's own rate
                        args.replica_rps = statistics.median(runs[system][-1]["rps_per_router"])  # type: ignore[arg-type]
    for system, measured in runs.items():
        if measured:
            results[system] = summarize(measured)
    out: dict[str, object] = {
        "setup": {"num_workers": args.num_workers, "concurrency": args.concurrency,
                  "num_requests": args.num_requests, "num_warmup": args.num_warmup, "prompt_chars": args.prompt_chars,
                  "shared_fraction": args.shared_fraction, "num_groups": args.num_groups, "policy": args.policy,
                  "max_tokens": 4, "service_us_per_token": args.service_us_per_token, "kv_events": args.kv_events,
                  "repeats": args.repeats},
        "systems": results}
    # Each ratio is taken within one round (same machine load), then its median and spread over the rounds.
    ones, halves, twos = runs.get("kvbaton:1", []), runs.get("kvbaton:1:half", []), runs.get("kvbaton:2", [])
    paced = runs.get("kvbaton:1:paced", [])
    if paced and twos:  # like with like: the lone router at a replica's rate, concurrency and number of requests
        out["replica_cpu_over_lone_at_the_replicas_rate"] = _ratio_summary([
            [c / p["router_cpu_us_per_request"][0] for c in t["router_cpu_us_per_request"]]  # type: ignore[index,attr-defined]
            for p, t in zip(paced, twos)])
        out["replica_cpu_above_idle_over_lone_at_the_replicas_rate"] = _ratio_summary([
            [c / p["router_cpu_us_per_request_above_idle"][0]  # type: ignore[index]
             for c in t["router_cpu_us_per_request_above_idle"]] for p, t in zip(paced, twos)])  # type: ignore[attr-defined]
    if halves and twos:
        out["replica_cpu_above_idle_over_lone_at_a_replicas_share"] = _ratio_summary([
            [c / h["router_cpu_us_per_request_above_idle"][0]  # type: ignore[index]
             for c in t["router_cpu_us_per_request_above_idle"]] for h, t in zip(halves, twos)])  # type: ignore[attr-defined]
    if ones and twos:
        out["targets"] = {
            # The figure as first measured: the lone router at full load, twice a replica's requests per
            # second (its fixed per-second costs spread over twice the requests); see
            # replica_cpu_over_lone_at_the_replicas_rate for the like-with-like one.
            "replica_cpu_over_lone_basis": "lone router at full load (2x a replica's request rate)",
            "replica_cpu_over_lone": _ratio_summary([
                [c / o["router_cpu_us_per_request"][0] for c in t["router_cpu_us_per_request"]]  # type: ignore[index,attr-defined]
                for o, t in zip(ones, twos)]),
            "replica_cpu_above_idle_over_lone": _ratio_summary([
                [c / o["router_cpu_us_per_request_above_idle"][0]  # type: ignore[index]
                 for c in t["router_cpu_us_per_request_above_idle"]] for o, t in zip(ones, twos)]),  # type: ignore[attr-defined]
            "replica_cpu_target": 1.1,
            "hit_ratio_two_over_one": _ratio_summary([
                [float(t["hit_ratio"]) / max(float(o["hit_ratio"]), 1e-9)] for o, t in zip(ones, twos)]),  # type: ignore[arg-type]
            "hit_ratio_target": 0.95,
            "busiest_over_mean_two": _ratio_summary([[float(t["busiest_over_mean"] or 0)] for t in twos]),  # type: ignore[arg-type]
            "busiest_over_mean_target": 1.15}
    print(json.dumps(out))


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def summarize(measured: list[dict[str, object]]) -> dict[str, object]:
    """One system's rounds: the median of each figure (of each element, for a list of figures), with its spread
    [min, max] as `<figure>_spread`; other values (statuses, cores) as the last round had them."""
    out: dict[str, object] = {}
    for key, last in measured[-1].items():
        values = [run[key] for run in measured]
        if all(_is_number(v) for v in values):
            out[key] = round(statistics.median(values), 4)  # type: ignore[arg-type]
            out[f"{key}_spread"] = [min(values), max(values)]  # type: ignore[type-var]
        elif (isinstance(last, list) and last and all(isinstance(v, list) and len(v) == len(last) for v in values)
              and all(_is_number(x) for v in values for x in v)):  # type: ignore[union-attr]
            columns = list(zip(*values))  # type: ignore[misc]
            out[key] = [round(statistics.median(c), 4) for c in columns]
            out[f"{key}_spread"] = [[min(c), max(c)] for c in columns]
        else:
            out[key] = last
    out["num_rounds"] = len(measured)
    return out


def _ratio_summary(per_round: list[list[float]]) -> dict[str, object]:
    """Per-round ratios (one per router): each round's, their median and spread per router."""
    columns = list(zip(*per_round))
    return {"median": [round(statistics.median(c), 3) for c in columns],
            "spread": [[round(min(c), 3), round(max(c), 3)] for c in columns],
            "rounds": [[round(x, 3) for x in r] for r in per_round]}


if __name__ == "__main__":
    main()
