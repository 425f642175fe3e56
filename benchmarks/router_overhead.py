"""Router overhead: routed requests/s and router CPU per request, kvbaton's HTTP router vs sglang-router, one run.

Setup, identical for every system: N fake workers that answer at once, 2,000-character prompts
(80 % of each a prefix shared within one of 8 groups, the rest unique), a closed-loop client in its
own process keeping `--concurrency` (64) requests in flight over keep-alive connections
(non-streaming `POST /v1/completions`, 4 output tokens).

- kvbaton (`round_robin`, `preble`): the real router process — FastAPI + uvicorn app from
  `kvbaton.server.api` over the `ClusterManager` — started in a subprocess; it tokenizes each
  prompt with SmolLM2's tokenizer, hashes its blocks, routes, and talks to N in-process fake
  workers (one process) over the real zmq + msgpack worker RPC.
  Every request carries a prompt the router has not seen whole (so its tokenization cache helps
  only through shared prefixes); `:ids` sends pre-tokenized prompts instead.
- fastapi:floor: FastAPI + uvicorn as the router runs them, with an endpoint that parses the body
  and answers a fixed completion: the least CPU per request of any router on that stack.
- relay:floor: a bare ASGI app on uvicorn that relays each pre-tokenized request to the same fake
  workers over kvbaton's zmq + msgpack RPC and answers a fixed completion: the transports alone
  (HTTP server, event loop, RPC socket, its I/O thread), without any of a router's own work.
- sglang-router (`cache_aware`, `pip install sglang-router`, Rust): `python -m
  sglang_router.launch_router` in front of N fake HTTP workers (one process). It does not tokenize.

Router CPU is utime+stime from /proc/<pid>/stat of the router process (and any children) across
the measured requests, divided by the requests completed. Each system gets a warm-up, then
`--repeats` measured runs; medians are reported with their ratio to sglang-router. Prints one JSON
line (progress on stderr). The 2-core machine is shared: compare within one run, quote ratios.

    .venv/bin/python benchmarks/router_overhead.py [--num-workers 8 --num-requests 3000 --repeats 3]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvbaton.core.cluster_secret import SECRET_ENV, ClusterSecret
from overhead_backends import (
    cluster_secret,
    run_fake_http_workers,
    run_fake_rpc_workers,
    run_load,
    serve_fastapi_floor,
    serve_relay_floor,
)

MODEL = "smollm2-135m"
# "kvbaton:<policy>:ids" sends the same prompts pre-tokenized (token-id lists, as `kvbaton bench` does), which
# separates the router's own overhead from tokenizing 2,000 characters at ingress.
# "fastapi:floor" is the HTTP stack alone (`serve_fastapi_floor`): what any router on FastAPI + uvicorn pays.
# "relay:floor:ids" is uvicorn + kvbaton's worker RPC relaying token ids with no router logic (`serve_relay_floor`).
SYSTEMS = ("kvbaton:round_robin", "kvbaton:preble", "kvbaton:preble:ids", "fastapi:floor", "relay:floor:ids",
           "sglang:cache_aware")
SGLANG_REFERENCE = {"cache_aware_rps": 2300.0, "cache_aware_cpu_us_per_request": 170.0}  # this machine class
_CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
_WORDS = ("the", "router", "prefix", "cache", "worker", "token", "block", "queue", "load", "model", "serve",
          "batch", "decode", "prefill", "latency", "policy", "index", "hash", "group", "system")


def make_prompts(num_prompts: int, num_chars: int, shared_fraction: float, num_groups: int, seed: int) -> list[str]:
    """Prompts of exactly `num_chars` characters; the first `shared_fraction` of each is its group's prefix."""
    rng = random.Random(seed)

    def text(num: int) -> str:
        words: list[str] = []
        size = 0
        while size < num:
            word = rng.choice(_WORDS) + str(rng.randrange(1000))
            words.append(word)
            size += len(word) + 1
        return " ".join(words)[:num]

    num_shared = int(num_chars * shared_fraction)
    prefixes = [text(num_shared) for _ in range(num_groups)]
    return [prefixes[i % num_groups] + text(num_chars - num_shared) for i in range(num_prompts)]


def _body(prompt: str | list[int]) -> str:
    return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0.0})


def tokenize(prompts: list[str]) -> list[list[int]]:
    """The token ids kvbaton's router would compute for each prompt (SmolLM2's tokenizer)."""
    from kvbaton.model.registry import read_model_header, resolve_model_source

    _, tokenizer = read_model_header(resolve_model_source(MODEL))
    return [tokenizer.encode(p) for p in prompts]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def process_tree_cpu_s(pid: int) -> float:
    """utime + stime of `pid` and its live descendants, in seconds."""
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2:].split()  # after "pid (comm) "
        stats[int(entry)] = fields
        children.setdefault(int(fields[1]), []).append(int(entry))
    total_ticks = 0
    stack = [pid]
    while stack:
        current = stack.pop()
        fields = stats.get(current)
        if fields is not None:
            total_ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
        stack.extend(children.get(current, ()))
    return total_ticks / _CLOCK_TICKS_PER_S


@functools.cache
def _log_dir() -> str:
    """Where the stderr of every process started goes (kept after the run, for diagnostics)."""
    return tempfile.mkdtemp(prefix="router_overhead_")


def _spawn(args: list[str]) -> subprocess.Popen[bytes]:
    with open(os.path.join(_log_dir(), f"{len(os.listdir(_log_dir()))}.log"), "wb") as log:
        return subprocess.Popen([sys.executable, *args], stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)


def _log_tail() -> str:
    """The ends of the newest process logs."""
    logs = [Path(_log_dir(), n).read_text(errors="replace")[-1500:] for n in sorted(os.listdir(_log_dir()))]
    return "\n---\n".join(logs[-3:])


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each process we started, by pid; SIGKILL what is still there after a grace period."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5.0)


def _wait_ready(url: str, body: bytes, processes: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    """Until one real completion through the router answers 200."""
    deadline_s = time.monotonic() + timeout_s
    last_error = ""
    while time.monotonic() < deadline_s:
        for process in processes:
            if process.poll() is not None:
                raise RuntimeError(f"{process.args} exited with {process.returncode}; logs in {_log_dir()}:\n"
                                   f"{_log_tail()}")
        request = urllib.request.Request(f"{url}/v1/completions", data=body,
                                         headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=5.0) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError) as exc:
            last_error = str(exc)
        time.sleep(0.3)
    raise RuntimeError(f"{url} not serving within {timeout_s:g} s ({last_error})")


def start_system(system: str, args: argparse.Namespace, script: str, bodies_path: str
                 ) -> tuple[str, subprocess.Popen[bytes], list[subprocess.Popen[bytes]]]:
    """Start the router and its fake workers; returns (url, router process, all processes)."""
    kind, policy = system.split(":")[:2]
    http_port = free_port()
    if kind == "fastapi":
        router = _spawn([script, "--role", "fastapi-floor", "--http-port", str(http_port)])
        workers = None
    elif kind == "kvbaton":
        rpc_port = free_port()
        router = _spawn([script, "--role", "kvbaton-router", "--policy", policy, "--http-port", str(http_port),
                         "--rpc-port", str(rpc_port), "--num-workers", str(args.num_workers)])
        workers = _spawn([script, "--role", "fake-rpc-workers", "--rpc-port", str(rpc_port),
                          "--num-workers", str(args.num_workers)])
    elif kind == "relay":
        rpc_port = free_port()
        router = _spawn([script, "--role", "relay-floor", "--http-port", str(http_port), "--rpc-port", str(rpc_port)])
        workers = _spawn([script, "--role", "fake-rpc-workers", "--rpc-port", str(rpc_port),
                          "--num-workers", str(args.num_workers)])
    else:
        ports = [free_port() for _ in range(args.num_workers)]
        workers = _spawn([script, "--role", "fake-http-workers", "--ports", ",".join(map(str, ports))])
        time.sleep(0.5)
        router = _spawn(["-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(http_port),
                         "--policy", policy, "--log-level", "warn", "--worker-urls",
                         *(f"http://127.0.0.1:{p}" for p in ports)])
    processes = [router, workers] if workers is not None else [router]
    url = f"http://127.0.0.1:{http_port}"
    try:
        _wait_ready(url, json.loads(Path(bodies_path).read_text())[0].encode(), processes, args.startup_timeout_s)
    except BaseException:
        _stop(processes)
        raise
    return url, router, processes


def load_once(script: str, url: str, bodies_path: str, num_requests: int, args: argparse.Namespace,
              first_body: int) -> dict[str, object]:
    output = subprocess.run([sys.executable, script, "--role", "load", "--url", f"{url}/v1/completions",
                             "--bodies", bodies_path, "--num-requests", str(num_requests),
                             "--first-body", str(first_body), "--api-key", args.api_key,
                             "--concurrency", str(args.concurrency)],
                            capture_output=True, text=True, timeout=args.load_timeout_s + 30.0, check=True)
    return json.loads(output.stdout.strip().splitlines()[-1])


def measure(system: str, args: argparse.Namespace, script: str, bodies_path: str) -> dict[str, object]:
    url, router, processes = start_system(system, args, script, bodies_path)
    try:
        # Every request of a system carries a prompt it has not seen before (bodies are consumed in
        # order), so no run is helped by exact repeats; shared prefixes are the workload's own.
        load_once(script, url, bodies_path, args.num_warmup, args, first_body=0)
        runs = []
        for repeat in range(args.repeats):
            cpu_before_s = process_tree_cpu_s(router.pid)
            result = load_once(script, url, bodies_path, args.num_requests, args,
                               first_body=args.num_warmup + repeat * args.num_requests)
            cpu_s = process_tree_cpu_s(router.pid) - cpu_before_s
            num_ok = int(result["num_ok"])  # type: ignore[arg-type]
            runs.append({"rps": num_ok / float(result["elapsed_s"]),  # type: ignore[arg-type]
                         "cpu_us_per_request": 1e6 * cpu_s / max(num_ok, 1), "num_ok": num_ok,
                         "statuses": result["statuses"], "errors": result["errors"]})
            print(f"{system}: {runs[-1]['rps']:.0f} req/s, {runs[-1]['cpu_us_per_request']:.0f} us CPU/request "
                  f"({result['statuses']})", file=sys.stderr, flush=True)
    finally:
        _stop(processes)
    return {"rps": round(statistics.median(r["rps"] for r in runs), 1),
            "cpu_us_per_request": round(statistics.median(r["cpu_us_per_request"] for r in runs), 1),
            "runs": [{k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()} for r in runs]}


PROFILE_ENV = "KVBATON_BENCH_ROUTER_PROFILE"  # a directory: the kvbaton-router role runs under cProfile


def serve_kvbaton_router(args: argparse.Namespace) -> None:
    """The real router process: ClusterManager + the OpenAI app under uvicorn, until SIGTERM."""
    import uvicorn

    from kvbaton.model.registry import read_model_header, resolve_model_source
    from kvbaton.server.api import create_app
    from kvbaton.server.auth import ADMIN, ApiAuth, ApiKeys, Principal
    from kvbaton.server.cluster import ClusterConfig, ClusterManager
    from kvbaton.server.launcher import freeze_startup_heap, run_router_loop

    model_config, tokenizer = read_model_header(resolve_model_source(MODEL))
    auth = ApiAuth(ApiKeys([(args.api_key, Principal("", ADMIN))] if args.api_key else []))

    profile_dir = os.environ.get(PROFILE_ENV, "")  # see router_replicas.py --profile-dir

    async def main() -> None:
        cluster = ClusterManager(ClusterConfig(bind_address=f"tcp://127.0.0.1:{args.rpc_port}", model_name=MODEL,
                                               policy=args.policy, max_num_waiting=4096,
                                               cluster_secret=cluster_secret()))
        await cluster.start()
        try:
            await cluster.wait_for_workers(args.num_workers, timeout_s=60.0)
            app = create_app(cluster, tokenizer, MODEL, max_model_len=model_config.max_position_embeddings, auth=auth)
            freeze_startup_heap()  # as `kvbaton serve` does
            config = uvicorn.Config(app, host="127.0.0.1", port=args.http_port, log_level="warning",
                                    access_log=False, backlog=1024)
            if profile_dir:  # the whole serving life, start-up excluded, into <dir>/router-<rpc port>.prof
                import cProfile

                profiler = cProfile.Profile(time.process_time)  # CPU, not the wall time of a shared machine

                def dump(*_: object) -> None:  # uvicorn re-raises the SIGTERM it caught once it has stopped
                    profiler.disable()
                    profiler.dump_stats(os.path.join(profile_dir, f"router-{args.rpc_port}.prof"))

                signal.signal(signal.SIGTERM, dump)
                profiler.enable()
            await uvicorn.Server(config).serve()  # returns on SIGTERM
        finally:
            await cluster.shutdown(timeout_s=2.0)

    run_router_loop(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", default="main",
                        choices=("main", "kvbaton-router", "fake-rpc-workers", "fake-http-workers", "fastapi-floor",
                                 "relay-floor", "load"))
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="kvbaton:<policy> | sglang:<policy>, comma-separated")
    parser.add_argument("--num-workers", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=3000, help="per measured run")
    parser.add_argument("--num-warmup", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="distinct prompts (default: one per request sent, warm-up included)")
    parser.add_argument("--prompt-chars", type=int, default=2000)
    parser.add_argument("--shared-fraction", type=float, default=0.8)
    parser.add_argument("--num-groups", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout-s", type=float, default=120.0)
    parser.add_argument("--load-timeout-s", type=float, default=120.0)
    parser.add_argument("--api-key", default="", help="the kvbaton router checks this key on every request; the "
                        "client sends it (default: no key, as on loopback)")
    # Internal roles.
    parser.add_argument("--policy", default="preble")
    parser.add_argument("--http-port", type=int, default=0)
    parser.add_argument("--rpc-port", type=int, default=0)
    parser.add_argument("--ports", default="")
    parser.add_argument("--url", default="")
    parser.add_argument("--bodies", default="")
    parser.add_argument("--first-body", type=int, default=0)
    args = parser.parse_args()
    script = os.path.abspath(__file__)

    if args.role == "kvbaton-router":
        serve_kvbaton_router(args)
    elif args.role == "fake-rpc-workers":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        run_fake_rpc_workers(f"tcp://127.0.0.1:{args.rpc_port}", args.num_workers, MODEL)
    elif args.role == "fastapi-floor":
        serve_fastapi_floor(args.http_port)
    elif args.role == "relay-floor":
        serve_relay_floor(args.http_port, f"tcp://127.0.0.1:{args.rpc_port}", MODEL)
    elif args.role == "fake-http-workers":
        run_fake_http_workers([int(p) for p in args.ports.split(",")], MODEL)
    elif args.role == "load":
        bodies = [b.encode() for b in json.loads(Path(args.bodies).read_text())]
        print(json.dumps(run_load(args.url, bodies, args.num_requests, args.concurrency, args.load_timeout_s,
                                  args.first_body, args.api_key)))
    else:
        os.environ.setdefault(SECRET_ENV, ClusterSecret.generate().to_hex())  # the routers' and workers' (children)
        num_prompts = args.num_prompts or args.num_warmup + args.repeats * args.num_requests
        prompts = make_prompts(num_prompts, args.prompt_chars, args.shared_fraction, args.num_groups, args.seed)
        systems = [s for s in args.systems.split(",") if s]
        results: dict[str, object] = {}
        with tempfile.TemporaryDirectory() as tmp:
            text_path, ids_path = os.path.join(tmp, "text.json"), os.path.join(tmp, "ids.json")
            Path(text_path).write_text(json.dumps([_body(p) for p in prompts]))
            if any(s.endswith(":ids") for s in systems):
                Path(ids_path).write_text(json.dumps([_body(ids) for ids in tokenize(prompts)]))
            for system in systems:
                results[system] = measure(system, args, script, ids_path if system.endswith(":ids") else text_path)
        out: dict[str, object] = {
            "setup": {"num_workers": args.num_workers, "concurrency": args.concurrency,
                      "num_requests_per_run": args.num_requests, "repeats": args.repeats,
                      "prompt_chars": args.prompt_chars, "shared_fraction": args.shared_fraction,
                      "num_groups": args.num_groups, "num_prompts": num_prompts, "max_tokens": 4},
            "systems": results, "sglang_reference_this_machine_class": SGLANG_REFERENCE}
        reference = results.get("sglang:cache_aware")
        floor = results.get("fastapi:floor")
        for system, figures in results.items():
            if not system.startswith("kvbaton:") or not isinstance(figures, dict):
                continue
            if isinstance(reference, dict):
                figures["rps_over_sglang"] = round(figures["rps"] / reference["rps"], 3)
                figures["cpu_per_request_over_sglang"] = round(
                    figures["cpu_us_per_request"] / reference["cpu_us_per_request"], 3)
            relay = results.get("relay:floor:ids")
            if isinstance(relay, dict):  # what kvbaton's own work adds on top of its transports
                figures["cpu_us_above_relay_floor"] = round(figures["cpu_us_per_request"] - relay["cpu_us_per_request"], 1)
            if isinstance(floor, dict):  # what kvbaton adds on top of the HTTP stack it must run on
                figures["cpu_us_above_fastapi_floor"] = round(
                    figures["cpu_us_per_request"] - floor["cpu_us_per_request"], 1)
                figures["cpu_per_request_over_fastapi_floor"] = round(
                    figures["cpu_us_per_request"] / floor["cpu_us_per_request"], 3)
        print(json.dumps(out))


if __name__ == "__main__":
    main()
