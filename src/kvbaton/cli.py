"""`kvbaton` command line: generate | serve | worker | bench (sim, plan, profile arrive with their issues).

Every user-facing error is a KvbatonError printed as one line on stderr with exit status 2,
never a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvbaton.core.errors import KvbatonError
from kvbaton.router.admission import ADMISSION_POLICIES
from kvbaton.model.token_cache import DEFAULT_MAX_CACHED_CHARS

from kvbaton.core.cluster_secret import API_KEY_ENV

DEVICE_HELP = "where the weights, the KV pool and the forward live: cpu | cuda | cuda:N"

if TYPE_CHECKING:
    from kvbaton.core.cluster_secret import ClusterSecret
    from kvbaton.server.launcher import ServeConfig
    from kvbaton.server.auth import ApiKeys


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
    constraint = p.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", metavar="SCHEMA", help="constrain the output to this JSON schema "
                            "(JSON text, or @FILE)")
    constraint.add_argument("--regex", help="constrain the output to match this regex in full")
    constraint.add_argument("--choice", action="append", help="the output is one of these (repeatable)")
    p.add_argument("--dtype", default="auto", help="auto | bfloat16 | float32")
    p.add_argument("--device", default="cpu", help=DEVICE_HELP)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--speculative-tokens", type=int, default=0, metavar="K", help="draft tokens per decode by prompt lookup (speculative decoding; greedy output unchanged); 0 = off")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _add_parallel(p)


def _add_parallel(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="tensor parallel ranks per worker: attention heads and MLP rows split over N rank processes "
                        "(N must divide the model's KV heads)")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, metavar="N",
                   help="pipeline parallel stages per worker: layers split over N rank processes")


def _run_generate(args: argparse.Namespace) -> int:
    from kvbaton.core.sampling import SamplingParams
    from kvbaton.llm import LLM

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), grammar=_grammar_of(args))
    llm = LLM(args.model, dtype=args.dtype, block_size=args.block_size, enable_prefix_cache=not args.no_prefix_cache,
              num_speculative_tokens=args.speculative_tokens, device=args.device,
              tensor_parallel_size=args.tensor_parallel_size,
              pipeline_parallel_size=args.pipeline_parallel_size)
    try:
        return _generate_with(llm, args, params)
    finally:
        llm.close()


def _generate_with(llm, args: argparse.Namespace, params) -> int:  # noqa: ANN001 - LLM, SamplingParams
    prompt = args.prompt
    if args.chat:
        text = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        prompt = llm.tokenizer.encode(text, add_bos=False)  # the template writes its own BOS
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


def _grammar_of(args: argparse.Namespace) -> str:
    """The structured-output grammar `generate` was asked for ("" for none)."""
    from kvbaton.engine.structured import grammar_for

    if args.json_schema is not None:
        schema = args.json_schema
        if schema.startswith("@"):
            try:
                schema = Path(schema[1:]).read_text()
            except OSError as exc:
                raise KvbatonError(f"--json-schema: cannot read {schema[1:]}: {exc.strerror}") from None
        return grammar_for("json_schema", schema)
    if args.regex is not None:
        return grammar_for("regex", args.regex)
    if args.choice:
        return grammar_for("choice", args.choice)
    return ""


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run a local cluster: N worker processes and the OpenAI-compatible router")
    p.add_argument("--placement", default="", metavar="FILE",
                   help="the worker pools from `kvbaton plan ... --json > FILE` (its best unit x units; instead of "
                        "--workers/--prefill/--decode); the model defaults to the plan's when kvbaton can serve it")
    p.add_argument("--placement-pick", default="best", choices=("best", "best_disaggregated", "best_colocated"),
                   help="which of the plan's answers --placement launches")
    p.add_argument("--workers", type=int, default=None,
                   help="mixed (prefill+decode) worker processes (default 2, or 0 with --prefill/--decode)")
    p.add_argument("--prefill", type=int, default=0, help="prefill worker processes (disaggregated pool)")
    p.add_argument("--decode", type=int, default=0, help="decode worker processes (disaggregated pool)")
    p.add_argument("--routers", type=int, default=1,
                   help="router processes over the same workers, on consecutive HTTP ports from --port (any free "
                        "ports with --port 0); put a load balancer in front of them")
    _add_router_options(p)


def _add_router(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="run one more router (HTTP API) for a running cluster: its workers register "
                                      "with it too; or, without --join, restart a router at its old --rpc-address")
    p.add_argument("--join", default="", metavar="ADDRESS",
                   help="the RPC address of a router of the cluster (its /cluster router_address, e.g. "
                        "tcp://127.0.0.1:5557); needs the cluster secret (--cluster-secret-file or "
                        "KVBATON_CLUSTER_SECRET). Without it, --rpc-address names the address of a router that died: "
                        "its workers, which keep registering there, come back (it serves once one has)")
    p.add_argument("--kv-store", default="", metavar="ADDRESS",
                   help="the KV store node this router reads (its events price store hits, as the first router's "
                        "do): the address `kvbaton serve --kv-store-gb` printed or its /cluster kv_store shows; "
                        "`serve --routers N` hands it to its other routers; empty = none")
    _add_router_options(p)


# Options of `kvbaton serve` that a router started with `kvbaton router --join` does not take (serve --routers N).
_SERVE_ONLY_OPTIONS = ("--routers", "--workers", "--prefill", "--decode", "--port", "--rpc-address", "--ray",
                       "--gpus-per-worker", "--placement", "--placement-pick", "--kv-store-gb", "--kv-store-disk-gb")


def _router_argv(argv: Sequence[str]) -> tuple[str, ...]:
    """`kvbaton serve` arguments as the extra routers of `--routers N` take them: the serve-only options dropped."""
    kept: list[str] = []
    skip_value = False
    for token in argv:
        if skip_value:
            skip_value = False
        elif token in _SERVE_ONLY_OPTIONS:
            skip_value = True
        elif token.split("=", 1)[0] not in _SERVE_ONLY_OPTIONS and token != "serve":
            kept.append(token)
    return tuple(kept)


def _store_gb(text: str) -> float | None:
    """--kv-store-gb: a number of GB, or auto (None: the launcher sizes it, `launcher.auto_store_gb`)."""
    if text == "auto":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of GB or auto, not {text!r}") from None


def _add_router_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="smollm2-135m (default) | tiny-random | path to .gguf or HF dir")
    p.add_argument("--kv-transport", default="shm", choices=("shm", "tcp"), help="how KV moves prefill -> decode")
    p.add_argument("--local-prefill-threshold", type=int, default=None,
                   help="prompts with fewer uncached tokens skip the handoff (default: the measured one)")
    p.add_argument("--kv-load-failure-policy", default="recompute", choices=("recompute", "fail"),
                   help="when a handoff's KV does not arrive: the decode worker prefills itself, or the request fails")
    p.add_argument("--policy", default="preble", help="round_robin | least_load | longest_prefix | preble")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0 = any free port)")
    p.add_argument("--rpc-address", default="tcp://127.0.0.1:*",
                   help="zmq address workers connect to (with --ray: this node's IP, any free port)")
    p.add_argument("--ray", default="", metavar="ADDRESS",
                   help="place the workers on a Ray cluster: 'auto' (the one running here), HOST:PORT, or 'local' "
                        "(start a single-node one on 127.0.0.1); needs pip install 'kvbaton[ray]'")
    p.add_argument("--gpus-per-worker", type=float, default=0.0,
                   help="with --ray: GPUs each worker holds, for each of its -tp x -pp rank processes (Ray narrows "
                        "CUDA_VISIBLE_DEVICES to them; the workers run on them: --device cuda)")
    p.add_argument("--device", default=None, help=DEVICE_HELP + " for every worker (default cpu, or cuda with "
                   "--gpus-per-worker); several local workers on cuda share that one device")
    p.add_argument("--dtype", default="auto", help="auto | bfloat16 | float32")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=2048, help="KV blocks per worker")
    p.add_argument("--host-num-blocks", default=None, help=argparse.SUPPRESS)  # gone: refused by name
    p.add_argument("--kv-store-gb", type=_store_gb, default=None, metavar="GB", help="this host's KV store node's shared-memory DRAM in GB: every worker writes its new full blocks through to it and loads prefix hits past its KV pool from it (Mooncake's store; SGLang's hierarchical cache and vLLM's KV offloading keep such blocks per worker); default auto: twice the workers' KV pools, at most half of /dev/shm's free space; 0 = off")
    p.add_argument("--kv-store-disk-gb", default="", metavar="DIR:GB", help="the store node's disk tier: block files under DIR, at most GB of them, each checked by a checksum when read back")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--speculative-tokens", type=int, default=0, metavar="K", help="draft tokens per decode by prompt lookup (speculative decoding; greedy output unchanged); 0 = off")
    p.add_argument("--warm-up", action="store_true", help="build every linear shape a step can use (oneDNN primitives, ~0.5 MB each) before serving: RSS stays flat under any mix of step sizes, at a few seconds of start-up")
    p.add_argument("--scheduling-policy", default="", choices=("", "fcfs", "priority"),
                   help="the workers' waiting queue: priority = vLLM's (a request's `priority` field, lower first, "
                        "orders admission and preemption); fcfs; default: the one --policy pairs with")
    p.add_argument("--tool-call-parser", default="", choices=("", "hermes", "mistral", "llama3_json", "qwen3_xml"),
                   help="read the model's own tool calls for tool_choice auto (vLLM's names): "
                        "hermes = <tool_call> JSON blocks (Hermes, Qwen2.5), mistral = [TOOL_CALLS], "
                        "llama3_json = Llama 3.x JSON calls, "
                        "qwen3_xml = Qwen3-Coder <function=...> blocks")
    p.add_argument("--max-stored-responses", type=int, default=1024,
                   help="/v1/responses kept for previous_response_id and GET (and at most 4M tokens of them); 0 = none")
    p.add_argument("--stored-response-ttl", type=float, default=3600.0, help="seconds a stored response is kept")
    p.add_argument("--max-num-waiting", type=int, default=256, help="queued requests above which the router answers 429")
    p.add_argument("--threads-per-worker", type=int, default=0, help="torch threads per worker (0 = the cores shared evenly among workers)")
    _add_parallel(p)
    for pool in ("prefill", "decode"):
        p.add_argument(f"--{pool}-tp", type=int, default=0, metavar="N",
                       help=f"tensor parallel size of the {pool} pool's workers (0 = --tensor-parallel-size)")
        p.add_argument(f"--{pool}-pp", type=int, default=0, metavar="N",
                       help=f"pipeline parallel size of the {pool} pool's workers (0 = --pipeline-parallel-size)")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get after Ctrl-C")
    p.add_argument("--router-link-timeout", type=float, default=5.0,
                   help="workers give up a router silent this long while another is heard (aborting its "
                        "requests) and register with it again until it answers")
    p.add_argument("--migration-limit", type=int, default=3,
                   help="times a request may move to another worker when its worker dies mid-request (0 = off)")
    p.add_argument("--admission", default="none", choices=ADMISSION_POLICIES,
                   help="SLO admission: answer 429 at arrival to what cannot meet --ttft-slo/--tpot-slo")
    p.add_argument("--ttft-slo", type=float, default=0.0, help="seconds, for --admission")
    p.add_argument("--tpot-slo", type=float, default=0.0, help="seconds per output token, for --admission")
    p.add_argument("--cost-profile", default="", metavar="FILE",
                   help="step times from `kvbaton profile --threads T --out FILE`, for --admission and --adaptive-pools")
    p.add_argument("--adaptive-pools", action="store_true",
                   help="lend a worker of the idle pool to mixed duty while the other pool queues (needs the SLOs "
                        "and --cost-profile)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-log-dir", default="", metavar="DIR",
                   help="each worker writes DIR/<worker id>.steps.jsonl at exit (kvbaton profile --from-step-log)")
    p.add_argument("--tokenizer-cache-chars", type=int, default=DEFAULT_MAX_CACHED_CHARS, metavar="N",
                   help="reuse ingress token ids of texts and prefixes seen before, up to N characters (0: off)")
    _add_reserve_ahead(p)
    _add_security(p)


def _add_security(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help=f"a key clients send as 'Authorization: Bearer KEY' (repeatable; also {API_KEY_ENV}); "
                        "an admin key of tenant ''")
    p.add_argument("--api-key-file", default="", metavar="FILE",
                   help='JSON list of {"key", "tenant", "role": "user"|"admin"}: each key\'s tenant (its cache '
                        "namespace) and role (admin: /cluster, /reset_prefix_cache)")
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="serve a non-loopback --host without any API key (refused otherwise)")
    p.add_argument("--trust-tenant-header", action="store_true",
                   help="honour the client's `user` field / x-tenant header (set by a gateway in front) as a tenant "
                        "within the key's")
    p.add_argument("--metrics-require-key", action="store_true", help="/metrics needs an API key too")
    p.add_argument("--cluster-secret-file", default="", metavar="FILE",
                   help="the secret the RPC and KV links authenticate with: read from FILE, or generated and "
                        "written there (0600) for workers started by hand (default: a fresh one per run)")


def _api_keys(args: argparse.Namespace) -> ApiKeys:
    from kvbaton.server.auth import ADMIN, ApiKeys, Principal, read_api_key_file

    given = [*args.api_key, *([os.environ[API_KEY_ENV]] if os.environ.get(API_KEY_ENV) else [])]
    entries = [(key, Principal("", ADMIN)) for key in given]
    if args.api_key_file:
        entries += read_api_key_file(args.api_key_file)
    return ApiKeys(entries)


def _cluster_secret(args: argparse.Namespace, create: bool) -> ClusterSecret | None:
    """The cluster secret from --cluster-secret-file (created there if `create` and absent) or the environment."""
    from kvbaton.core.cluster_secret import SECRET_ENV, ClusterSecret, load_or_create_secret

    if args.cluster_secret_file:
        return (load_or_create_secret if create else ClusterSecret.read_file)(args.cluster_secret_file)
    if os.environ.get(SECRET_ENV):
        return ClusterSecret.from_hex(os.environ[SECRET_ENV], SECRET_ENV)
    return None


def _add_reserve_ahead(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reserve-ahead-tokens", type=int, default=None, metavar="N",
                   help="prefill role: reserve a handoff's KV on the decode worker once at most N prompt tokens are "
                        "left to prefill ahead of it (default: as it arrives)")


def _run_serve(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from kvbaton.server.launcher import serve

    if args.placement:
        _apply_placement(args)
    args.model = args.model or "smollm2-135m"
    num_workers = args.workers if args.workers is not None else (0 if args.prefill or args.decode else 2)
    if min(num_workers, args.prefill, args.decode) < 0:
        raise KvbatonError("--workers, --prefill and --decode must not be negative")
    if args.prefill and not args.decode:
        raise KvbatonError("--prefill needs at least one --decode worker to hand the KV to")
    if num_workers + args.decode < 1:
        raise KvbatonError("give at least one worker: --workers N, or --prefill N --decode M")
    if args.gpus_per_worker < 0 or (args.gpus_per_worker and not args.ray):
        raise KvbatonError("--gpus-per-worker takes a non-negative number, with --ray")
    if args.routers < 1:
        raise KvbatonError(f"--routers must be at least 1, got {args.routers}")
    if args.port and args.port + args.routers - 1 > 65535:
        raise KvbatonError(f"--routers {args.routers} from --port {args.port} runs past port 65535")
    router_args = (*_router_argv(argv), "--model", args.model)  # the model --placement may have chosen
    return serve(_serve_config(args, num_workers=num_workers, num_prefill=args.prefill, num_decode=args.decode,
                               num_routers=args.routers, router_args=router_args, rpc_address=args.rpc_address,
                               ray_address=args.ray, gpus_per_worker=args.gpus_per_worker))


def _run_router(args: argparse.Namespace) -> int:
    from kvbaton.server.launcher import serve

    if args.ray:
        raise KvbatonError("kvbaton router starts no worker: --ray is for kvbaton serve")
    if args.kv_store_gb or args.kv_store_disk_gb:
        raise KvbatonError("kvbaton router starts no KV store node: the host's one comes with kvbaton serve "
                           "--kv-store-gb; give its address with --kv-store to price store hits")
    if not args.join and args.rpc_address.endswith(":*"):
        raise KvbatonError("kvbaton router needs --join ADDRESS (a router of the cluster), or --rpc-address ADDRESS "
                           "with a port: the address of a router that died, whose workers register there again")
    args.model = args.model or "smollm2-135m"
    return serve(_serve_config(args, num_workers=0, num_prefill=0, num_decode=0, join_address=args.join,
                               rpc_address=args.rpc_address, kv_store_address=args.kv_store))


def _serve_config(args: argparse.Namespace, **fields: object) -> ServeConfig:
    """The launcher's config from the options `kvbaton serve` and `kvbaton router` share, plus `fields`."""
    from kvbaton.server.auth import check_exposure
    from kvbaton.server.launcher import ServeConfig

    from kvbaton.router.pairs import DEFAULT_LOCAL_PREFILL_THRESHOLD_TOKENS

    if not 0 <= args.port <= 65535:
        raise KvbatonError(f"--port must be 0-65535, got {args.port}")
    if not args.drain_timeout >= 0:  # NaN too
        raise KvbatonError(f"--drain-timeout must be a number of seconds >= 0, got {args.drain_timeout}")
    if args.migration_limit < 0:
        raise KvbatonError(f"--migration-limit must be >= 0, got {args.migration_limit}")
    _check_kv_sizes(args)
    device = _serve_device(args)
    _check_parallel_sizes(args.model, (args.tensor_parallel_size, args.prefill_tp, args.decode_tp),
                          (args.pipeline_parallel_size, args.prefill_pp, args.decode_pp))
    api_keys = _api_keys(args)
    check_exposure(args.host, api_keys, args.allow_unauthenticated)  # before anything loads
    threshold = args.local_prefill_threshold
    return ServeConfig(
        model=args.model, kv_transport=args.kv_transport, kv_load_failure_policy=args.kv_load_failure_policy,
        local_prefill_threshold_tokens=DEFAULT_LOCAL_PREFILL_THRESHOLD_TOKENS if threshold is None else threshold,
        policy=args.policy, host=args.host, port=args.port, dtype=args.dtype, device=device, block_size=args.block_size,
        num_blocks=args.num_blocks, kv_store_gb=args.kv_store_gb, kv_store_disk=args.kv_store_disk_gb,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_waiting=args.max_num_waiting,
        num_speculative_tokens=args.speculative_tokens, warm_up=args.warm_up,
        threads_per_worker=args.threads_per_worker, seed=args.seed, drain_timeout_s=args.drain_timeout,
        migration_limit=args.migration_limit, router_link_timeout_s=args.router_link_timeout,
        admission=args.admission, ttft_slo_s=args.ttft_slo, tpot_slo_s=args.tpot_slo, cost_profile=args.cost_profile,
        adaptive_pools=args.adaptive_pools, step_log_dir=args.step_log_dir,
        tokenizer_cache_chars=args.tokenizer_cache_chars, reserve_ahead_tokens=args.reserve_ahead_tokens,
        tool_call_parser=args.tool_call_parser, scheduling_policy=args.scheduling_policy,
        max_stored_responses=args.max_stored_responses, stored_response_ttl_s=args.stored_response_ttl,
        api_keys=api_keys, allow_unauthenticated=args.allow_unauthenticated,
        trust_tenant_header=args.trust_tenant_header, metrics_require_key=args.metrics_require_key,
        cluster_secret=_cluster_secret(args, create="join_address" not in fields),
        tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
        prefill_tensor_parallel_size=args.prefill_tp, decode_tensor_parallel_size=args.decode_tp,
        prefill_pipeline_parallel_size=args.prefill_pp, decode_pipeline_parallel_size=args.decode_pp,
        **fields)  # type: ignore[arg-type]


def _apply_placement(args: argparse.Namespace) -> None:
    """--placement FILE: the pools (and, unless --model says otherwise, the model) of a `kvbaton plan --json`."""
    from kvbaton.model.registry import BUILTIN_MODELS
    from kvbaton.plan.serve_layout import read_serve_layout

    if args.workers is not None or args.prefill or args.decode:
        raise KvbatonError("--placement sets the worker pools: drop --workers, --prefill and --decode")
    if args.tensor_parallel_size != 1 or args.pipeline_parallel_size != 1 or args.prefill_tp or args.decode_tp \
            or args.prefill_pp or args.decode_pp:
        raise KvbatonError("--placement sets the workers' parallel degrees: drop -tp/-pp and --prefill-tp/--decode-tp/"
                           "--prefill-pp/--decode-pp")
    layout = read_serve_layout(args.placement, args.placement_pick, max_workers=os.cpu_count() or 1)
    if layout.mixed is not None:
        args.workers = layout.mixed.num_workers
        args.tensor_parallel_size, args.pipeline_parallel_size = layout.mixed.tp, layout.mixed.pp
    else:
        assert layout.prefill is not None and layout.decode is not None
        args.workers, args.prefill, args.decode = 0, layout.prefill.num_workers, layout.decode.num_workers
        args.prefill_tp, args.prefill_pp = layout.prefill.tp, layout.prefill.pp
        args.decode_tp, args.decode_pp = layout.decode.tp, layout.decode.pp
    if args.model is None:
        if layout.planned_model not in BUILTIN_MODELS:
            raise KvbatonError(f"--placement: the plan priced {layout.planned_model or 'an unnamed model'}, which "
                               "kvbaton cannot load by name: give --model")
        args.model = layout.planned_model
    planned = f"{layout.planned_model} on {layout.planned_gpu}" if layout.planned_gpu else layout.planned_model
    print(f"kvbaton: placement {args.placement_pick} of {args.placement} (planned for {planned}): "
          f"{' '.join(layout.serve_flags())}", file=sys.stderr, flush=True)


def _serve_device(args: argparse.Namespace) -> str:
    """The workers' device: --device, or cuda where --gpus-per-worker hands each worker GPUs. A local CUDA launch is
    checked here, before any worker starts; Ray's workers are checked on their own nodes."""
    from kvbaton.model.device import check_device_name, resolve_device

    device = check_device_name(args.device if args.device is not None else ("cuda" if args.gpus_per_worker else "cpu"))
    if args.gpus_per_worker and device == "cpu":
        raise KvbatonError("--gpus-per-worker reserves GPUs for each worker, which --device cpu would leave unused: "
                           "drop --device (cuda) or the GPUs")
    if args.gpus_per_worker and device != "cuda" and int(device.partition(":")[2]) >= math.ceil(args.gpus_per_worker):
        raise KvbatonError(f"--device {device}: Ray narrows each worker's CUDA_VISIBLE_DEVICES to its "
                           f"{args.gpus_per_worker:g} GPU(s), numbered from 0")
    parallel = (args.tensor_parallel_size, args.pipeline_parallel_size, args.prefill_tp, args.decode_tp,
                args.prefill_pp, args.decode_pp)
    if device != "cpu" and max(parallel) > 1:  # refused here, before Ray reserves GPUs for ranks that would refuse
        raise KvbatonError(f"tensor/pipeline parallel workers run on CPU only so far (their KV is host shared "
                           f"memory), not on {device!r}")
    if device != "cpu" and not args.ray:
        resolve_device(device)
    return device


def _add_store_node(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("store-node", help="run this host's KV store node for workers of a cluster on other hosts "
                                          "(`kvbaton worker --kv-store ITS_ADDRESS`); it prints its address")
    p.add_argument("--model", default="smollm2-135m", help="the workers' model: its layers and KV heads size a block")
    p.add_argument("--dtype", default="auto", help="the workers' --dtype")
    p.add_argument("--block-size", type=int, default=16, help="the workers' --block-size")
    p.add_argument("--kv-store-gb", type=float, required=True, metavar="GB", help="shared-memory DRAM of the node")
    p.add_argument("--kv-store-disk-gb", default="", metavar="DIR:GB", help="its disk tier: block files under DIR")
    p.add_argument("--host", default="127.0.0.1", help="the address it listens on (this host's, for other hosts' workers)")
    p.add_argument("--port", type=int, default=0, help="its port; 0 = any free one")
    p.add_argument("--cluster-secret-file", default="", metavar="FILE",
                   help="the router's cluster secret (or the KVBATON_CLUSTER_SECRET variable): only holders connect")


def _run_store_node(args: argparse.Namespace) -> int:
    from kvbaton.core.cluster_secret import SECRET_ENV
    from kvbaton.model.registry import read_model_header, resolve_model_source
    from kvbaton.server.launcher import store_node_args
    from kvbaton.server.store_server import main as store_main

    if args.block_size < 1 or not args.kv_store_gb > 0:
        raise KvbatonError("--block-size and --kv-store-gb must be positive")
    secret = _cluster_secret(args, create=False)
    if secret is None:
        raise KvbatonError("no cluster secret: give the router's with --cluster-secret-file FILE or the "
                           "KVBATON_CLUSTER_SECRET variable")
    model_config, _ = read_model_header(resolve_model_source(args.model))
    os.environ[SECRET_ENV] = secret.to_hex()  # the node reads it there, as when the launcher starts one
    return store_main([*store_node_args(model_config, args.dtype, args.block_size, args.kv_store_gb,
                                        args.kv_store_disk_gb), "--host", args.host, "--port", str(args.port)])


def _add_worker(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="run one worker process that registers with a router")
    p.add_argument("--role", default="mixed", choices=("mixed", "prefill", "decode"))
    p.add_argument("--router", required=True, metavar="ADDRESS[,ADDRESS...]",
                   help="the router's zmq address, e.g. tcp://127.0.0.1:5557; several, comma-separated: serve each "
                        "(routers that join later are announced by one of them)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--worker-id", default="", help="unique id in the cluster (default: host-pid)")
    p.add_argument("--policy", default="", help="local queue policy fcfs | lpm | preble | priority (default: the router's)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cpu", help=DEVICE_HELP)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=2048)
    p.add_argument("--host-num-blocks", default=None, help=argparse.SUPPRESS)  # gone: refused by name
    p.add_argument("--kv-store", default="", metavar="ADDRESS", help="this host's KV store node (tcp://host:port), as `kvbaton serve --kv-store-gb` hands it or `kvbaton store-node` prints it: new blocks are written through to it, loads read it first; empty = none")
    p.add_argument("--kv-store-nodes", default="", metavar="ADDRESS,...", help="KV store nodes of the cluster to load from over TCP for what this host's node lacks, known from the start; the routers also tell the worker every node their workers name (at registration and when one is added), so this is optional")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--speculative-tokens", type=int, default=0, metavar="K", help="draft tokens per decode by prompt lookup (speculative decoding; greedy output unchanged); 0 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warm-up", action="store_true", help="build every linear shape a step can use (oneDNN primitives, ~0.5 MB each) before serving: RSS stays flat under any mix of step sizes, at a few seconds of start-up")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = all cores)")
    p.add_argument("--router-timeout", type=float, default=15.0, help="exit after this long without a word from any router")
    p.add_argument("--router-link-timeout", type=float, default=5.0,
                   help="give up a router silent this long while another is heard: abort its requests (and keep "
                        "registering with it, so it gets this worker again if it comes back); with every router "
                        "silent nothing is given up until --router-timeout")
    _add_parallel(p)
    p.add_argument("--kv-transport", default="shm", choices=("shm", "tcp"),
                   help="decode role: how prefill workers write KV")
    p.add_argument("--kv-host", default="127.0.0.1", help="decode role: address the KV receiver listens on")
    p.add_argument("--kv-lease", type=float, default=60.0, help="seconds a handoff reservation or held block lives")
    _add_reserve_ahead(p)
    p.add_argument("--step-log", default="", metavar="FILE",
                   help="write each step's batch shape and period here at exit (kvbaton profile --from-step-log)")
    p.add_argument("--cluster-secret-file", default="", metavar="FILE",
                   help="the router's cluster secret (0600; `kvbaton serve --cluster-secret-file` writes it); "
                        "default: the KVBATON_CLUSTER_SECRET variable, as the launcher hands it")


def _check_kv_sizes(args: argparse.Namespace) -> None:
    """Refuse KV sizes no worker can start with here: each worker would, but only after loading the model (a
    zero block size as a traceback)."""
    if args.block_size < 1:
        raise KvbatonError(f"--block-size must be positive, got {args.block_size}")
    if args.num_blocks < 2:
        raise KvbatonError(f"--num-blocks must be at least 2, got {args.num_blocks}")
    if args.host_num_blocks is not None:
        raise KvbatonError("--host-num-blocks is gone: the KV store's DRAM tier took the host tier's place, its loads "
                           "and saves off the step's path (`kvbaton serve --kv-store-gb GB`, on by default; "
                           "`kvbaton worker --kv-store ADDRESS`)")
    if getattr(args, "kv_store_gb", 0.0) or getattr(args, "kv_store", ""):
        if not getattr(args, "kv_store", "") and not args.kv_store_gb > 0:
            raise KvbatonError(f"--kv-store-gb must be a positive number of GB, got {args.kv_store_gb}")
    if getattr(args, "kv_store_disk_gb", ""):
        from kvbaton.server.store_server import parse_disk

        parse_disk(args.kv_store_disk_gb)
        if args.kv_store_gb == 0:  # None: auto, which the launcher checks
            raise KvbatonError("--kv-store-disk-gb needs --kv-store-gb: disk blocks load through the store's DRAM")


def _check_parallel_sizes(model: str, tps: tuple[int, ...], pps: tuple[int, ...]) -> None:
    """Refuse, before anything starts, a degree the model cannot be split by (0: a pool's "the default")."""
    from kvbaton.model.registry import read_model_header, resolve_model_source
    from kvbaton.model.sharding import check_parallelism

    if min(tps[0], pps[0]) < 1 or min(tps + pps) < 0:
        raise KvbatonError("tensor and pipeline parallel sizes must be >= 1")
    if max(tps + pps) <= 1:
        return
    config, _ = read_model_header(resolve_model_source(model))
    for tp in {size for size in tps if size}:
        for pp in {size for size in pps if size}:
            check_parallelism(config, tp, pp)


def _run_worker(args: argparse.Namespace) -> int:
    import signal
    import socket

    from kvbaton.server.worker import Worker, WorkerConfig

    from kvbaton.model.device import check_device_name

    _check_kv_sizes(args)
    check_device_name(args.device)  # a misspelt device fails here, before the secret and the model load
    _check_parallel_sizes(args.model, (args.tensor_parallel_size,), (args.pipeline_parallel_size,))
    secret = _cluster_secret(args, create=False)
    if secret is None:
        raise KvbatonError("no cluster secret: give the router's with --cluster-secret-file FILE (written by "
                           "`kvbaton serve --cluster-secret-file FILE`) or the KVBATON_CLUSTER_SECRET variable")
    # SIGTERM exits through the KeyboardInterrupt path (status 130) instead of dying mid-frame.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    worker_id = args.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    routers = [address.strip() for address in args.router.split(",") if address.strip()]
    if not routers:
        raise KvbatonError("--router needs at least one address")
    if args.kv_store_nodes and not args.kv_store:
        raise KvbatonError("--kv-store-nodes needs --kv-store: saves go to this host's node, loads read it first")
    worker = Worker(WorkerConfig(
        router_address=routers[0], more_router_addresses=tuple(routers[1:]),
        router_link_timeout_s=args.router_link_timeout, worker_id=worker_id, role=args.role, model=args.model, dtype=args.dtype,
        device=args.device, block_size=args.block_size, num_blocks=args.num_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed, num_threads=args.threads,
        num_speculative_tokens=args.speculative_tokens, warm_up=args.warm_up,
        queue_policy=args.policy, router_timeout_s=args.router_timeout, kv_transport=args.kv_transport,
        kv_host=args.kv_host, kv_lease_s=args.kv_lease, step_log=args.step_log,
        reserve_ahead_tokens=args.reserve_ahead_tokens, kv_store_address=args.kv_store, cluster_secret=secret,
        kv_store_nodes=tuple(a for a in args.kv_store_nodes.split(",") if a),
        tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size))
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
    _add_router(sub)
    _add_worker(sub)
    _add_store_node(sub)
    from kvbaton.bench.cli import add_bench_arguments

    add_bench_arguments(sub.add_parser("bench", help="workloads: describe them, or drive a live server"))
    from kvbaton.plan.cli import add_plan_arguments

    add_plan_arguments(sub.add_parser("plan", help="goodput placement search: pools, parallelism, replicas"))
    from kvbaton.sim.cli import add_sim_arguments

    add_sim_arguments(sub.add_parser("sim", help="simulate a workload on a named cluster with the real policy code"))
    _add_profile(sub)
    return parser


def _add_profile(sub: argparse._SubParsersAction) -> None:
    # Declared here rather than in kvbaton.engine.profiler so that building the parser never imports torch.
    p = sub.add_parser("profile", help="time the live engine over batch shapes and fit the simulator's cost model")
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m | tiny-random | .gguf | HF dir")
    p.add_argument("--out", required=True, metavar="FILE", help="coefficient JSON for kvbaton sim --cost-model")
    p.add_argument("--from-step-log", nargs="+", default=None, metavar="FILE",
                   help="fit serving workers' step logs (kvbaton worker --step-log) instead of timing the engine")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quick", action="store_true", help="a small grid (seconds, for smoke tests)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads (0 = all cores); use a serving worker's count for --cost-profile")
    p.add_argument("--json", action="store_true", help="print the written file as one JSON object")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return _run_generate(args)
        if args.command == "serve":
            return _run_serve(args, list(argv) if argv is not None else sys.argv[1:])
        if args.command == "router":
            return _run_router(args)
        if args.command == "worker":
            return _run_worker(args)
        if args.command == "store-node":
            return _run_store_node(args)
        if args.command == "bench":
            from kvbaton.bench.cli import run_bench

            return run_bench(args)
        if args.command == "plan":
            from kvbaton.plan.cli import run_plan

            return run_plan(args)
        if args.command == "sim":
            from kvbaton.sim.cli import run_sim

            return run_sim(args)
        if args.command == "profile":
            from kvbaton.engine.profiler import run_profile

            return run_profile(args)
        parser.error(f"unknown command {args.command}")
    except KvbatonError as exc:
        print(f"kvbaton: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`kvbaton sim ... | head`): stop quietly, as the standard tools do. Python would
        # still try to flush stdout at exit and print a second traceback, so point it at /dev/null first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports a writer killed by it
    return 0


if __name__ == "__main__":
    sys.exit(main())
