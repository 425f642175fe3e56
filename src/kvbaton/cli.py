"""`kvbaton` command line: generate | serve | worker | bench (sim, plan, profile arrive with their issues).

Every user-facing error is a KvbatonError printed as one line on stderr with exit status 2,
never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from kvbaton.core.errors import KvbatonError


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt with an in-process engine")
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m | tiny-random | path to .gguf or HF dir")
    p.add_argument("--prompt", required=True, help="prompt text (raw, no chat template unless --chat)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--dtype", default="auto", help="auto | bfloat16 | float32")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _run_generate(args: argparse.Namespace) -> int:
    from kvbaton.core.sampling import SamplingParams
    from kvbaton.engine.llm import LLM

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop))
    llm = LLM(args.model, dtype=args.dtype, block_size=args.block_size, enable_prefix_cache=not args.no_prefix_cache)
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    result = llm.generate(prompt, params)[0]
    out = result.outputs[0]
    if out.error:
        raise KvbatonError(out.error)
    if args.json:
        print(json.dumps({
            "text": out.text,
            "token_ids": out.token_ids,
            "prompt_token_ids": result.prompt_token_ids,
            "cached_tokens": result.num_cached_tokens,
            "finish_reason": out.finish_reason.value if out.finish_reason else None,
            "ttft_s": round(result.ttft_s, 6),
            "tpot_s": round(result.tpot_s, 6),
        }))
    else:
        print(out.text)
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run a local cluster: N worker processes and the OpenAI-compatible router")
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m | tiny-random | path to .gguf or HF dir")
    p.add_argument("--workers", type=int, default=2, help="number of mixed (prefill+decode) worker processes")
    p.add_argument("--policy", default="preble", help="round_robin | least_load | longest_prefix | preble")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0 = any free port)")
    p.add_argument("--rpc-address", default="tcp://127.0.0.1:*", help="zmq address workers connect to")
    p.add_argument("--dtype", default="auto", help="auto | bfloat16 | float32")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=2048, help="KV blocks per worker")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-waiting", type=int, default=256, help="queued requests above which the router answers 429")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get after Ctrl-C")
    p.add_argument("--seed", type=int, default=0)


def _run_serve(args: argparse.Namespace) -> int:
    from kvbaton.server.launcher import ServeConfig, serve

    if args.workers < 1:
        raise KvbatonError(f"--workers must be at least 1, got {args.workers}")
    return serve(ServeConfig(
        model=args.model, num_workers=args.workers, policy=args.policy, host=args.host, port=args.port,
        rpc_address=args.rpc_address, dtype=args.dtype, block_size=args.block_size, num_blocks=args.num_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_waiting=args.max_num_waiting, seed=args.seed,
        drain_timeout_s=args.drain_timeout))


def _add_worker(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="run one worker process that registers with a router")
    p.add_argument("--role", default="mixed", choices=("mixed", "prefill", "decode"))
    p.add_argument("--router", required=True, help="the router's zmq address, e.g. tcp://127.0.0.1:5557")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--worker-id", default="", help="unique id in the cluster (default: host-pid)")
    p.add_argument("--policy", default="", help="local queue policy fcfs | lpm | preble (default: the router's)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--router-timeout", type=float, default=15.0, help="exit after this long without a word from the router")


def _run_worker(args: argparse.Namespace) -> int:
    import os
    import signal
    import socket

    from kvbaton.server.worker import Worker, WorkerConfig

    # SIGTERM exits through the KeyboardInterrupt path (status 130) instead of dying mid-frame.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    worker_id = args.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    worker = Worker(WorkerConfig(
        router_address=args.router, worker_id=worker_id, role=args.role, model=args.model, dtype=args.dtype,
        device=args.device, block_size=args.block_size, num_blocks=args.num_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed, queue_policy=args.policy,
        router_timeout_s=args.router_timeout))
    print(f"kvbaton worker {worker_id}: {args.model} loaded, registering with {args.router}", file=sys.stderr,
          flush=True)
    reason = worker.run()
    print(f"kvbaton worker {worker_id}: stopped ({reason})", file=sys.stderr, flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvbaton", description="distributed LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_serve(sub)
    _add_worker(sub)
    from kvbaton.bench.cli import add_bench_arguments

    add_bench_arguments(sub.add_parser("bench", help="workloads: describe them, or drive a live server"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return _run_generate(args)
        if args.command == "serve":
            return _run_serve(args)
        if args.command == "worker":
            return _run_worker(args)
        if args.command == "bench":
            from kvbaton.bench.cli import run_bench

            return run_bench(args)
        parser.error(f"unknown command {args.command}")
    except KvbatonError as exc:
        print(f"kvbaton: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
