"""What the trust boundary costs: RPC round trip, router CPU per request and KV handoff bandwidth, before vs after.

One run, three comparisons, each side measured in turn (interleaved, repeats, medians), on the same cores, and
the gate's own cost:

- check: `ApiAuth.authorize` of one request (an API key to look up, as every request of a keyed server carries),
  CPU time per call (`time.process_time`, so a shared core's waits do not count), median of --repeats.
- rpc: a router's zmq ROUTER and a worker's DEALER on 127.0.0.1 exchanging what a request costs the RPC (an
  `AddRequest` of `--prompt-tokens` token ids out, a finished `TokenDeltas` back), plain zmq vs CurveZMQ
  with the ZAP handler exactly as `server/rpc_auth.py` sets them up: round-trip time per request.
- router: `benchmarks/router_overhead.py --systems kvbaton:preble:ids` (the real router process over the real
  RPC, 8 instant fake workers) from the source tree before (`--before-ref`, extracted with `git archive`, its
  own script and code) and from this checkout with `--api-key` (every request authenticated, the RPC under
  CurveZMQ): router CPU per request.
- kv: `benchmarks/transfer.py` (64 MB handoffs over shm and tcp) from both trees: bandwidth; after, each link
  opens with the HMAC handshake (`transfer/link_auth.py`), whose time is reported too.

Prints one JSON line with the medians and the after/before ratios (progress on stderr). The machine is
shared: quote the ratios.

    .venv/bin/python benchmarks/auth_overhead.py --before-ref <commit before the trust boundary> \\
        [--router-requests 400 --repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import zmq

from kvbaton.core.cluster_secret import ClusterSecret
from kvbaton.core.sampling import SamplingParams
from kvbaton.server import rpc
from kvbaton.server.base import TokenDelta
from kvbaton.server.rpc_auth import secure_dealer, secure_router

ROOT = Path(__file__).resolve().parents[1]


def rpc_round_trips_us(curve: bool, prompt_tokens: int, num_round_trips: int) -> tuple[list[float], float]:
    """Round-trip times (µs) of `num_round_trips` request/answer exchanges over one ROUTER/DEALER pair, and the
    CPU time (µs) each took in this process (both ends, zmq's I/O threads included)."""
    context = zmq.Context()
    router, dealer = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
    authenticator = None
    if curve:
        secret = ClusterSecret.generate()
        authenticator = secure_router(router, context, secret)
        secure_dealer(dealer, secret)
    try:
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer.setsockopt(zmq.IDENTITY, b"w0")
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(b"hello")
        identity, _ = router.recv_multipart()  # connected (and, with CURVE, authenticated)
        add = rpc.encode(rpc.AddRequest("r", tuple(range(prompt_tokens)), SamplingParams(max_tokens=4)))
        done = rpc.encode(rpc.TokenDeltas("w0", (TokenDelta("r", (1, 2, 3, 4), " ok ok", True, "length",
                                                            prompt_tokens, 0, worker_id="w0"),)))
        times_us = []
        cpu_started = time.process_time()
        for _ in range(num_round_trips):
            started = time.perf_counter()
            router.send_multipart([identity, add])
            rpc.decode(dealer.recv())
            dealer.send(done)
            rpc.decode(router.recv_multipart()[1])
            times_us.append((time.perf_counter() - started) * 1e6)
        return times_us, (time.process_time() - cpu_started) / num_round_trips * 1e6
    finally:
        router.close(linger=0)
        dealer.close(linger=0)
        if authenticator is not None:
            authenticator.stop()
        context.term()


def authorize_cpu_us(num_calls: int = 100_000) -> float:
    """CPU time (µs) of one `ApiAuth.authorize` on a generation route's scope, the loop's own cost subtracted."""
    from kvbaton.server.auth import ADMIN, ApiAuth, ApiKeys, Principal

    auth = ApiAuth(ApiKeys([("kvbaton-benchmark-key", Principal("", ADMIN))]))
    scope = {"type": "http", "path": "/v1/completions", "root_path": "",
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                         (b"authorization", b"Bearer kvbaton-benchmark-key"), (b"content-length", b"4000")]}
    started = time.process_time()
    for _ in range(num_calls):
        auth.authorize(scope)
    checked_s = time.process_time() - started
    started = time.process_time()
    for _ in range(num_calls):
        pass
    return (checked_s - (time.process_time() - started)) / num_calls * 1e6


def extract(ref: str, directory: str) -> Path:
    """The `src` and `benchmarks` folders of commit `ref` under `directory`."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", ref, "src", "benchmarks"],
                             capture_output=True, check=True).stdout
    with tempfile.NamedTemporaryFile(suffix=".tar") as tar_file:
        tar_file.write(archive)
        tar_file.flush()
        with tarfile.open(tar_file.name) as tar:
            tar.extractall(directory, filter="data")
    return Path(directory)


def run_json(tree: Path, script: str, args: list[str], timeout_s: float) -> dict[str, object]:
    """Run `tree`'s benchmark `script` with `tree`'s code first on the path; its last stdout line, parsed."""
    environment = {**os.environ, "PYTHONPATH": str(tree / "src")}
    output = subprocess.run([sys.executable, str(tree / "benchmarks" / script), *args], capture_output=True,
                            text=True, timeout=timeout_s, env=environment, cwd=str(tree))
    if output.returncode != 0:
        raise RuntimeError(f"{tree / 'benchmarks' / script} failed: {output.stderr[-2000:]}")
    return json.loads(output.stdout.strip().splitlines()[-1])


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before-ref", required=True, help="a commit without the trust boundary")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--router-requests", type=int, default=400, help="measured requests per router run")
    parser.add_argument("--rpc-round-trips", type=int, default=2000, help="per rpc run")
    parser.add_argument("--prompt-tokens", type=int, default=500, help="token ids an rpc AddRequest carries")
    parser.add_argument("--kv-size-mb", type=float, default=64.0)
    parser.add_argument("--skip", default="", help="comma-separated: check, rpc, router, kv")
    args = parser.parse_args()
    skip = set(args.skip.split(",")) - {""}
    rpc_us: dict[str, list[float]] = {"plain": [], "curve": []}
    rpc_cpu_us: dict[str, list[float]] = {"plain": [], "curve": []}
    router_cpu: dict[str, list[float]] = {"before": [], "after": []}
    kv: dict[str, dict[str, list[float]]] = {side: {"shm": [], "tcp": []} for side in ("before", "after")}
    link_setup_ms: list[float] = []
    check_us = [authorize_cpu_us() for _ in range(args.repeats)] if "check" not in skip else []
    router_args = ["--systems", "kvbaton:preble:ids", "--num-requests", str(args.router_requests),
                   "--num-warmup", str(max(50, args.router_requests // 4)), "--repeats", "1"]
    kv_args = ["--size-mb", str(args.kv_size_mb), "--repeats", "3"]
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"before": extract(args.before_ref, tmp), "after": ROOT}
        for repeat in range(args.repeats):
            if "rpc" not in skip:
                for kind in ("plain", "curve") if repeat % 2 == 0 else ("curve", "plain"):
                    times, cpu_us = rpc_round_trips_us(kind == "curve", args.prompt_tokens, args.rpc_round_trips)
                    rpc_us[kind].append(statistics.median(times[len(times) // 10:]))
                    rpc_cpu_us[kind].append(cpu_us)
            sides = ("before", "after") if repeat % 2 == 0 else ("after", "before")
            for side in sides:
                if "router" not in skip:
                    extra = ["--api-key", "kvbaton-benchmark-key"] if side == "after" else []
                    result = run_json(trees[side], "router_overhead.py", router_args + extra, 900.0)
                    figures = result["systems"]["kvbaton:preble:ids"]  # type: ignore[index]
                    router_cpu[side].append(float(figures["cpu_us_per_request"]))
                if "kv" not in skip:
                    result = run_json(trees[side], "transfer.py", kv_args, 600.0)
                    kv[side]["shm"].append(float(result["shm_gb_s"]))  # type: ignore[arg-type]
                    kv[side]["tcp"].append(float(result["tcp_gb_s"]))  # type: ignore[arg-type]
                    if side == "after":
                        link_setup_ms += [float(result["shm_link_setup_ms"]),  # type: ignore[arg-type]
                                          float(result["tcp_link_setup_ms"])]  # type: ignore[arg-type]
            print(f"repeat {repeat + 1}/{args.repeats}: rpc {rpc_us}, router {router_cpu}, kv {kv}", file=sys.stderr,
                  flush=True)
    out: dict[str, object] = {"before_ref": args.before_ref, "repeats": args.repeats}
    if check_us:
        out["authorize_cpu_us_per_request"] = _median(check_us)
    if rpc_us["plain"]:
        out["rpc_round_trip_us"] = {"plain": _median(rpc_us["plain"]), "curve": _median(rpc_us["curve"]),
                                    "curve_over_plain": round(statistics.median(rpc_us["curve"])
                                                              / statistics.median(rpc_us["plain"]), 3),
                                    "cpu_plain": _median(rpc_cpu_us["plain"]),
                                    "cpu_curve": _median(rpc_cpu_us["curve"]), "prompt_tokens": args.prompt_tokens}
    if router_cpu["before"]:
        out["router_cpu_us_per_request"] = {
            "before": _median(router_cpu["before"]), "after_with_api_key": _median(router_cpu["after"]),
            "after_over_before": round(statistics.median(router_cpu["after"]) / statistics.median(router_cpu["before"]),
                                       3), "requests_per_run": args.router_requests}
    if kv["before"]["shm"]:
        out["kv_gb_s"] = {kind: {"before": _median(kv["before"][kind]), "after": _median(kv["after"][kind]),
                                 "after_over_before": round(statistics.median(kv["after"][kind])
                                                            / statistics.median(kv["before"][kind]), 3)}
                          for kind in ("shm", "tcp")}
        out["kv_link_setup_ms_after"] = _median(link_setup_ms)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
