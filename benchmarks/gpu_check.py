"""The accelerator path, checked in one run on one GPU (issue 22, item 6): parity, speed beside transformers, a handoff.

Made for one H200 with that machine's own Python 3.12 and torch 2.11 and no network: it imports kvbaton from
`src/` and needs only torch, numpy and gguf (carried as a wheel, `benchmarks/gpu_check.sh`); transformers, when
the machine has it, is the baseline, and when it has not the report says so. Sections, each timed, each one's
failure recorded in the report without stopping the others:

1. `parity`: greedy tokens of the engine on the GPU in float32 against the same engine on the CPU in float32, on
   SmolLM2-135M (its GGUF, `--smollm2-gguf`) and on a random-weight Llama-3-8B-shaped model (weights drawn on the
   GPU from a seed, copied to the host for the CPU run): the first divergence, if any.
2. `speed`: the 8B-shaped model in bfloat16: decode tok/s at batch 1 / 16 / 64 and prefill tok/s of one 8k-token
   prompt, kvbaton's engine and transformers' `generate()` / forward on the same GPU in the same run, each with
   its fraction of the HBM roofline (bytes a step must read / step time / peak bandwidth) and its MFU (matmul and
   attention FLOPs / time / peak bf16 FLOP/s), peaks from `kvbaton.sim.catalog` for the GPU torch names.
3. `pair`: a prefill engine and a decode engine on the one GPU, linked by the real KV transports, shared memory
   and TCP in turn (their authenticated links, the pinned host staging of `engine/kv_staging.py`): greedy tokens after the handoff
   against one engine's, the bytes moved, the time, and no block left held.

`--small` runs the same sections on the CPU with tiny models (tiny-random, or SmolLM2 where `--smollm2-gguf` is
given, and a small Llama-shaped random model) in well under two minutes: `tests/bench/test_gpu_check_script.py`
runs it so the script cannot rot (and `test_gpu_check_carry.py` through gpu_check.sh's two calls). Prints one
JSON line; `--out FILE` writes it too.

    python3 benchmarks/gpu_check.py --smollm2-gguf PATH --out gpu_check.json     # on the GPU machine
    .venv/bin/python benchmarks/gpu_check.py --small                              # here, on the CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # kvbaton from this tree, never installed

import torch  # noqa: E402

from kvbaton.core.cluster_secret import ClusterSecret  # noqa: E402
from kvbaton.core.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from kvbaton.core.sampling import SamplingParams  # noqa: E402
from kvbaton.engine.engine import Engine  # noqa: E402
from kvbaton.engine.handoff import kv_layout_for  # noqa: E402
from kvbaton.engine.handoff_decode import DecodeHandoffs  # noqa: E402
from kvbaton.engine.handoff_prefill import PrefillHandoffs  # noqa: E402
from kvbaton.engine.kv_staging import KVStaging  # noqa: E402
from kvbaton.model.config import ModelConfig  # noqa: E402
from kvbaton.model.llama import LlamaModel  # noqa: E402
from kvbaton.model.registry import LoadedModel, ModelSource, read_model_source, resolve_model_source  # noqa: E402
from kvbaton.model.tiny import create_tiny_random_model  # noqa: E402
from kvbaton.server.worker_kv import DecodeKV, PrefillLinks  # noqa: E402
from kvbaton.sim.catalog import GPUS  # noqa: E402

BLOCK_SIZE = 16
LLAMA3_8B = ModelConfig(architecture="llama", num_layers=32, hidden_size=4096, intermediate_size=14336, num_heads=32,
                        num_kv_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
                        max_position_embeddings=16384, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
SMALL_LLAMA = ModelConfig(architecture="llama", num_layers=4, hidden_size=128, intermediate_size=256, num_heads=8,
                          num_kv_heads=2, head_dim=16, vocab_size=1024, rope_theta=500000.0, rms_norm_eps=1e-5,
                          max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
SMOLLM2_SHAPE = ModelConfig(architecture="llama", num_layers=30, hidden_size=576, intermediate_size=1536, num_heads=9,
                            num_kv_heads=3, head_dim=64, vocab_size=49152, rope_theta=100000.0, rms_norm_eps=1e-5,
                            max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


class Shapes:
    """What one mode measures: the models and the sizes of each section."""

    def __init__(self, small: bool) -> None:
        self.small = small
        self.big_config = SMALL_LLAMA if small else LLAMA3_8B
        self.big_name = "small-llama-random" if small else "llama-3-8b-shaped-random"
        self.parity_tokens = 8 if small else 24
        self.decode_batches = (1, 4, 8) if small else (1, 16, 64)
        self.decode_prompt_tokens = 32 if small else 128
        self.decode_new_tokens = 8 if small else 64
        self.prefill_tokens = 256 if small else 8192
        self.pair_prompt_tokens = 64 if small else 400  # three prompts in 112 blocks: a 41 MB region on SmolLM2
        self.pair_new_tokens = 8 if small else 32


def log(message: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- models ---------------------------------------------------------------------------------------------------------


def random_state_dict(config: ModelConfig, seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    """tiny-random's initialisation (`kvbaton.model.tiny`: sharp attention, a strong residual, spread logits, so
    greedy top-2 gaps stay far above float32 error) at `config`'s shape, drawn on `device` (fast on a GPU)."""
    if device.type == "cpu":
        return create_tiny_random_model(seed, torch.float32, config)[1]
    generator = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=device).mul_(std)

    def norm_weight(size: int) -> torch.Tensor:
        return torch.randn(size, generator=generator, device=device).mul_(0.1).add_(1.0)

    hidden, ffn, q_size = config.hidden_size, config.intermediate_size, config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    state = {"model.embed_tokens.weight": normal(config.vocab_size, hidden, std=1.0)}
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        state[prefix + "input_layernorm.weight"] = norm_weight(hidden)
        state[prefix + "self_attn.q_proj.weight"] = normal(q_size, hidden, std=2.0 * hidden**-0.5)
        state[prefix + "self_attn.k_proj.weight"] = normal(kv_size, hidden, std=2.0 * hidden**-0.5)
        state[prefix + "self_attn.v_proj.weight"] = normal(kv_size, hidden, std=hidden**-0.5)
        state[prefix + "self_attn.o_proj.weight"] = normal(hidden, q_size, std=8.0 * q_size**-0.5)
        state[prefix + "post_attention_layernorm.weight"] = norm_weight(hidden)
        state[prefix + "mlp.gate_proj.weight"] = normal(ffn, hidden, std=hidden**-0.5)
        state[prefix + "mlp.up_proj.weight"] = normal(ffn, hidden, std=hidden**-0.5)
        state[prefix + "mlp.down_proj.weight"] = normal(hidden, ffn, std=8.0 * ffn**-0.5)
    state["model.norm.weight"] = norm_weight(hidden)
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = normal(config.vocab_size, hidden, std=1.0)
    return state


def loaded_model(name: str, config: ModelConfig, state: dict[str, torch.Tensor], tokenizer: Any, revision: str,
                 dtype: torch.dtype, device: torch.device) -> LoadedModel:
    model = LlamaModel.from_hf_state_dict(config, state, dtype, device)
    return LoadedModel(name, config, model, tokenizer, revision, dtype)


def make_engine(loaded: LoadedModel, device: torch.device, num_blocks: int, max_batched_tokens: int = 512,
                max_num_seqs: int = 128, kv_cache: torch.Tensor | None = None) -> Engine:
    config = EngineConfig(model=loaded.name, device=str(device), seed=0,
                          cache=CacheConfig(BLOCK_SIZE, num_blocks, True),
                          scheduler=SchedulerConfig(max_num_batched_tokens=max_batched_tokens,
                                                    max_num_seqs=max_num_seqs))
    return Engine(config, loaded=loaded, kv_cache=kv_cache)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_to_end(engine: Engine, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[int]]:
    ids = [engine.add_request(list(p), params) for p in prompts]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    engine.check_invariants()
    return [tokens[rid] for rid in ids]


def prompt_ids(vocab_size: int, lengths: Sequence[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


# -- 1. parity ------------------------------------------------------------------------------------------------------


def compare(cpu_tokens: list[list[int]], device_tokens: list[list[int]]) -> dict[str, Any]:
    first_divergence = []
    for a, b in zip(cpu_tokens, device_tokens):
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))
        first_divergence.append(at)
    return {"equal": cpu_tokens == device_tokens, "first_divergence": first_divergence,
            "num_prompts": len(cpu_tokens), "tokens_per_prompt": len(cpu_tokens[0]) if cpu_tokens else 0,
            "cpu_tokens_head": [t[:8] for t in cpu_tokens], "device_tokens_head": [t[:8] for t in device_tokens]}


def parity_smollm2(shapes: Shapes, device: torch.device, gguf: str) -> dict[str, Any]:
    if gguf and Path(gguf).is_file():  # --small with a GGUF given: the one gpu_check.sh joined, read on the CPU
        source: ModelSource = ModelSource("smollm2-135m", "gguf", Path(gguf))
    elif shapes.small:
        source = resolve_model_source("tiny-random")
    else:
        return {"skipped": f"no SmolLM2 GGUF at {gguf!r} (benchmarks/gpu_check.sh carries it)"}
    config, state, tokenizer = read_model_source(source)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    prompts = [tokenizer.encode(t) for t in texts]
    results = {}
    for name, dev in (("cpu", torch.device("cpu")), ("device", device)):
        started = time.perf_counter()
        loaded = loaded_model(source.name, config, state, tokenizer, "parity", torch.float32, dev)
        results[name] = run_to_end(make_engine(loaded, dev, 256), prompts, greedy(shapes.parity_tokens))
        results[name + "_s"] = round(time.perf_counter() - started, 2)
        del loaded
    return {"model": source.name, **compare(results["cpu"], results["device"]),
            "cpu_s": results["cpu_s"], "device_s": results["device_s"],
            "device_text_head": [tokenizer.decode(t) for t in results["device"]]}


def parity_big(shapes: Shapes, device: torch.device, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    config = shapes.big_config
    tokenizer = read_model_source(resolve_model_source("tiny-random"))[2]  # ids past its vocabulary decode to ''
    prompts = prompt_ids(config.vocab_size, (17, 40, 64), seed=1)
    started = time.perf_counter()
    on_device = loaded_model(shapes.big_name, config, state, tokenizer, "parity", torch.float32, device)
    device_tokens = run_to_end(make_engine(on_device, device, 64), prompts, greedy(shapes.parity_tokens))
    device_s = time.perf_counter() - started
    del on_device
    gc.collect()
    started = time.perf_counter()
    cpu_state = {name: tensor.cpu() for name, tensor in state.items()} if device.type != "cpu" else state
    on_cpu = loaded_model(shapes.big_name, config, cpu_state, tokenizer, "parity", torch.float32, torch.device("cpu"))
    del cpu_state
    cpu_tokens = run_to_end(make_engine(on_cpu, torch.device("cpu"), 64), prompts, greedy(shapes.parity_tokens))
    cpu_s = time.perf_counter() - started
    del on_cpu
    gc.collect()
    return {"model": shapes.big_name, **compare(cpu_tokens, device_tokens), "cpu_s": round(cpu_s, 2),
            "device_s": round(device_s, 2)}


# -- 2. speed -------------------------------------------------------------------------------------------------------


def peaks(device: torch.device) -> tuple[str, float, float] | None:
    """(catalog name, bf16 FLOP/s, HBM bytes/s) of the GPU torch names, or None (a CPU, an unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    for key in ("h200", "h100", "a100", "l40s", "a6000"):
        if key in name:
            gpu = GPUS[key]
            return key, gpu.flops_per_s, gpu.mem_bytes_per_s
    return None


def matmul_params(config: ModelConfig) -> tuple[int, int]:
    """(parameters of one token's matmuls through the layers, of the LM head)."""
    hidden, q_size = config.hidden_size, config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    per_layer = hidden * (q_size + 2 * kv_size) + q_size * hidden + 3 * hidden * config.intermediate_size
    return config.num_layers * per_layer, config.vocab_size * hidden


def decode_fractions(config: ModelConfig, batch: int, context_tokens: float, tok_s: float,
                     peak: tuple[str, float, float] | None) -> dict[str, float | None]:
    """One decode step of `batch` sequences at a mean context: bytes it must read (weights once, each sequence's KV)
    and FLOPs (matmuls and attention), over the step time `batch / tok_s`."""
    if peak is None or tok_s <= 0:
        return {"hbm_roofline_fraction": None, "mfu": None}
    layer_params, head_params = matmul_params(config)
    kv_token_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2
    step_bytes = 2 * (layer_params + head_params) + batch * context_tokens * kv_token_bytes
    step_flops = batch * (2 * (layer_params + head_params)
                          + 4 * config.num_layers * context_tokens * config.num_heads * config.head_dim)
    step_s = batch / tok_s
    return {"hbm_roofline_fraction": round(step_bytes / step_s / peak[2], 4),
            "mfu": round(step_flops / step_s / peak[1], 4)}


def prefill_mfu(config: ModelConfig, num_tokens: int, seconds: float,
                peak: tuple[str, float, float] | None) -> float | None:
    if peak is None or seconds <= 0:
        return None
    layer_params, head_params = matmul_params(config)
    flops = (2 * layer_params * num_tokens + 2 * head_params
             + 2 * config.num_layers * num_tokens**2 * config.num_heads * config.head_dim)  # causal QK^T and PV
    return round(flops / seconds / peak[1], 4)


def kvbaton_decode_tok_s(engine: Engine, prompts: list[list[int]], new_tokens: int,
                         device: torch.device) -> float:
    """Tokens per second of the decode steps alone: from every request's first token to the last one's end."""
    ids = [engine.add_request(p, greedy(new_tokens)) for p in prompts]
    have_first: set[str] = set()
    while len(have_first) < len(ids):
        have_first.update(out.request_id for out in engine.step() if out.new_token_ids)
    synchronize(device)
    started, num_tokens = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        num_tokens += sum(len(out.new_token_ids) for out in engine.step())
    synchronize(device)
    return num_tokens / (time.perf_counter() - started)


def kvbaton_prefill_s(engine: Engine, prompt: list[int], device: torch.device) -> float:
    synchronize(device)
    started = time.perf_counter()
    engine.add_request(prompt, greedy(1))
    while engine.has_unfinished_requests():
        engine.step()
    synchronize(device)
    return time.perf_counter() - started


def speed_kvbaton(shapes: Shapes, device: torch.device, loaded: LoadedModel) -> dict[str, Any]:
    config, peak = shapes.big_config, peaks(device)
    max_batch = max(shapes.decode_batches)
    blocks_per_seq = -(-(shapes.decode_prompt_tokens + shapes.decode_new_tokens) // BLOCK_SIZE)
    num_blocks = max(max_batch * blocks_per_seq, -(-shapes.prefill_tokens // BLOCK_SIZE)) + 8
    engine = make_engine(loaded, device, num_blocks, max_batched_tokens=max(shapes.prefill_tokens, 512),
                         max_num_seqs=max_batch)
    out: dict[str, Any] = {"decode": {}, "prefill": {}}
    warm = prompt_ids(config.vocab_size, [shapes.decode_prompt_tokens], seed=99)
    kvbaton_decode_tok_s(engine, warm, 4, device)  # first launches, allocator warm-up
    for batch in shapes.decode_batches:
        engine.reset_prefix_cache()
        prompts = prompt_ids(config.vocab_size, [shapes.decode_prompt_tokens] * batch, seed=batch)
        tok_s = kvbaton_decode_tok_s(engine, prompts, shapes.decode_new_tokens, device)
        context = shapes.decode_prompt_tokens + shapes.decode_new_tokens / 2
        out["decode"][str(batch)] = {"tok_s": round(tok_s, 1), **decode_fractions(config, batch, context, tok_s, peak)}
        log(f"kvbaton decode batch {batch}: {tok_s:.1f} tok/s")
    prompt = prompt_ids(config.vocab_size, [shapes.prefill_tokens], seed=7)[0]
    times = []
    for _ in range(3):
        engine.reset_prefix_cache()  # each run a miss: the whole prompt is computed
        times.append(kvbaton_prefill_s(engine, prompt, device))
    seconds = statistics.median(times[1:])  # the first run warms up the 8k shapes
    out["prefill"] = {"tokens": shapes.prefill_tokens, "tok_s": round(shapes.prefill_tokens / seconds, 1),
                      "mfu": prefill_mfu(config, shapes.prefill_tokens, seconds, peak)}
    log(f"kvbaton prefill {shapes.prefill_tokens}: {out['prefill']['tok_s']} tok/s")
    engine.check_invariants()
    return out


def hf_generate_s(model: Any, shapes: Shapes, batch: int, new_tokens: int, device: torch.device) -> float:
    """Seconds of transformers' greedy `generate()` of `new_tokens` for `batch` prompts of the decode length."""
    ids = torch.tensor(prompt_ids(shapes.big_config.vocab_size, [shapes.decode_prompt_tokens] * batch, seed=batch),
                       device=device)
    synchronize(device)
    started = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    synchronize(device)
    return time.perf_counter() - started


def speed_transformers(shapes: Shapes, device: torch.device, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    try:
        import transformers
    except ImportError:
        return {"skipped": "transformers is not installed on this machine: no baseline"}
    from kvbaton.model.hf_reference import hf_llama_config

    config, peak = shapes.big_config, peaks(device)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):  # initialised where it runs: an 8B model's init on the CPU takes minutes
            model = transformers.LlamaForCausalLM(hf_llama_config(config))
    finally:
        torch.set_default_dtype(previous)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.eval()  # built in bfloat16 already; a .to() would cast the float32 rotary buffers too
    out: dict[str, Any] = {"transformers": transformers.__version__, "decode": {}, "prefill": {}}
    hf_generate_s(model, shapes, 1, 4, device)  # warm-up
    for batch in shapes.decode_batches:
        first_s = hf_generate_s(model, shapes, batch, 1, device)
        full_s = hf_generate_s(model, shapes, batch, shapes.decode_new_tokens, device)
        tok_s = batch * (shapes.decode_new_tokens - 1) / max(full_s - first_s, 1e-9)
        context = shapes.decode_prompt_tokens + shapes.decode_new_tokens / 2
        out["decode"][str(batch)] = {"tok_s": round(tok_s, 1), **decode_fractions(config, batch, context, tok_s, peak)}
        log(f"transformers decode batch {batch}: {tok_s:.1f} tok/s")
    ids = torch.tensor(prompt_ids(config.vocab_size, [shapes.prefill_tokens], seed=7), device=device)
    times = []
    for _ in range(3):
        synchronize(device)
        started = time.perf_counter()
        with torch.inference_mode():
            try:
                model(ids, use_cache=False, logits_to_keep=1)
            except TypeError:  # an older transformers: every position's logits
                model(ids, use_cache=False)
        synchronize(device)
        times.append(time.perf_counter() - started)
    seconds = statistics.median(times[1:])
    out["prefill"] = {"tokens": shapes.prefill_tokens, "tok_s": round(shapes.prefill_tokens / seconds, 1),
                      "mfu": prefill_mfu(config, shapes.prefill_tokens, seconds, peak)}
    log(f"transformers prefill {shapes.prefill_tokens}: {out['prefill']['tok_s']} tok/s")
    del model
    return out


def ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float]:
    """kvbaton over transformers, per figure (above 1: kvbaton faster)."""
    if "decode" not in theirs:
        return {}
    out = {f"decode_b{b}": round(ours["decode"][b]["tok_s"] / theirs["decode"][b]["tok_s"], 3)
           for b in ours["decode"] if theirs["decode"].get(b, {}).get("tok_s")}
    if theirs["prefill"].get("tok_s"):
        out["prefill"] = round(ours["prefill"]["tok_s"] / theirs["prefill"]["tok_s"], 3)
    return out


# -- 3. a 1P1D pair on the one device --------------------------------------------------------------------------------


def pair_check(shapes: Shapes, device: torch.device, loaded: LoadedModel, transport: str) -> dict[str, Any]:
    """Prefill engine -> decode engine over the `transport` (shm | tcp) KV link, as `kvbaton serve --prefill 1
    --decode 1` wires them (server/worker.py), both on `device`."""
    secret = ClusterSecret.generate()
    layout = kv_layout_for(loaded, BLOCK_SIZE)
    num_blocks = 112  # small: a container's /dev/shm may be 64 MB
    decode_kv = DecodeKV("d0", layout, num_blocks, transport, secret=secret, pin_memory=device.type == "cuda")
    links = PrefillLinks("p0", layout, secret=secret)
    try:
        # A GPU engine keeps its own storage and adopts through the landing memory (engine/kv_staging.py); the small
        # mode does the same on the CPU, so its run goes through that path too (a CPU worker computes in place).
        on_host = device.type == "cpu" and not shapes.small
        prefill = make_engine(loaded, device, num_blocks)
        decode = make_engine(loaded, device, num_blocks, kv_cache=decode_kv.kv_cache if on_host else None)
        staging = None if on_host else KVStaging(decode.storage.kv_cache, host_kv=decode_kv.kv_cache)
        p = PrefillHandoffs(prefill, layout, links, links.connect, 30.0, time.monotonic)
        d = DecodeHandoffs(decode, layout, decode_kv.receiver, 30.0, time.monotonic, staging)
        prompts = prompt_ids(loaded.config.vocab_size, [shapes.pair_prompt_tokens, shapes.pair_prompt_tokens // 2 + 5,
                                                        shapes.pair_prompt_tokens + 33], seed=5)
        params = greedy(shapes.pair_new_tokens)
        started = time.perf_counter()
        tokens: dict[str, list[int]] = {}
        for i, prompt in enumerate(prompts):
            d.expect(f"r{i}", prompt, params, "p0", "fail")
            p.submit(f"r{i}", prompt, params, "d0", decode_kv.address)
            tokens[f"r{i}"] = []
        deadline = time.monotonic() + 120.0
        while p.num_live or d.num_live or prefill.has_unfinished_requests() or decode.has_unfinished_requests():
            if time.monotonic() > deadline:
                raise TimeoutError("the pair did not finish within 120 s")
            p.poll(0.001)
            if prefill.has_unfinished_requests():
                leaked = p.on_outputs(prefill.step())
                assert not leaked, f"the prefill engine let outputs through: {leaked}"
            p.poll()
            got = d.poll(0.001)
            if decode.has_unfinished_requests():
                got += decode.step()
            for out in got:
                assert not out.error, out.error
                tokens[out.request_id].extend(out.new_token_ids)
        elapsed_s = time.perf_counter() - started
        reports = p.take_reports()
        colocated = run_to_end(make_engine(loaded, device, num_blocks), prompts, params)
        held = []
        for name, engine in (("prefill", prefill), ("decode", decode)):
            engine.check_invariants()
            cached = engine.prefix_cache.num_cached_blocks if engine.prefix_cache is not None else 0
            if engine.pool.num_used_blocks != cached:
                held.append(f"{name}: {engine.pool.num_used_blocks - cached} blocks beyond its prefix cache")
        if p.source.num_held_blocks or d.destination.num_reserved_blocks:
            held.append("the handoff legs still hold blocks")
        return {"model": loaded.name, "dtype": str(loaded.dtype).removeprefix("torch."), "transport": transport,
                "equal_to_colocated": [tokens[f"r{i}"] for i in range(len(prompts))] == colocated,
                "num_completed": p.counters.num_completed, "num_recomputed": d.counters.num_recomputed,
                "reports": [f"{r.request_id}: {r.outcome} {r.reason}" for r in reports],
                "kv_bytes": p.counters.num_bytes, "transfer_time_s": round(p.counters.transfer_time_s, 4),
                "prefill_staged_bytes": p.staging.num_staged_bytes,
                "decode_staged_bytes": staging.num_staged_bytes if staging is not None else 0,
                "elapsed_s": round(elapsed_s, 3), "blocks_held": held}
    finally:
        links.close()
        decode_kv.close()


# -- the run --------------------------------------------------------------------------------------------------------


def section(report: dict[str, Any], name: str, run: Callable[..., Any], *args: Any) -> Any:
    """`run(*args)` as report[name], timed; the arguments are passed, not captured in a closure, so that the caller
    can `del` a model or its weights as soon as the sections that need them are done."""
    started = time.perf_counter()
    log(f"{name} ...")
    try:
        report[name] = run(*args)
    except Exception as exc:  # one section's failure is a finding; the others still run
        report[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
    if isinstance(report[name], dict):
        report[name]["section_s"] = round(time.perf_counter() - started, 2)
    log(f"{name} done in {time.perf_counter() - started:.1f} s")
    return report[name]


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "torch_cuda": torch.version.cuda, "device": str(device)}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
        peak = peaks(device)
        env["peaks"] = None if peak is None else {"catalog": peak[0], "bf16_flops": peak[1], "hbm_bytes_s": peak[2]}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    return env


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny models on the CPU (the test's mode)")
    parser.add_argument("--device", default=None, help="default: cuda (cpu with --small)")
    parser.add_argument("--smollm2-gguf", default="", metavar="PATH", help="SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--out", default="", metavar="FILE")
    args = parser.parse_args(argv)
    from kvbaton.core.errors import KvbatonError
    from kvbaton.model.device import resolve_device

    try:
        device = resolve_device(args.device or ("cpu" if args.small else "cuda"))
    except KvbatonError as exc:
        print(f"gpu_check: {exc} (--small runs on the CPU)", file=sys.stderr)
        return 2
    # float32 parity means float32 matmuls: no TF32 (torch's default already, said here so no setting changes it).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if args.small:
        torch.set_num_threads(1)
    shapes = Shapes(args.small)
    started = time.perf_counter()
    report: dict[str, Any] = {"check": "gpu_check", "mode": "small" if args.small else "full",
                              "env": environment(device)}
    if not args.smollm2_gguf and not args.small:
        try:
            args.smollm2_gguf = str(resolve_model_source("smollm2-135m").path)
        except Exception:  # noqa: BLE001 - the package is absent: the section says so
            pass
    section(report, "parity_smollm2", parity_smollm2, shapes, device, args.smollm2_gguf)
    state = random_state_dict(shapes.big_config, seed=0, device=device)
    section(report, "parity_big", parity_big, shapes, device, state)
    state_bf16 = {name: tensor.to(torch.bfloat16) for name, tensor in state.items()}
    del state
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    tokenizer = read_model_source(resolve_model_source("tiny-random"))[2]
    big = loaded_model(shapes.big_name, shapes.big_config, state_bf16, tokenizer, "speed", torch.bfloat16, device)
    ours = section(report, "speed_kvbaton", speed_kvbaton, shapes, device, big)
    del big
    gc.collect()
    theirs = section(report, "speed_transformers", speed_transformers, shapes, device, state_bf16)
    if "error" not in ours and "error" not in theirs:
        report["speed_ratio_kvbaton_over_transformers"] = ratios(ours, theirs)
    del state_bf16
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    def pair() -> dict[str, Any]:
        if args.small:
            config, pair_state, pair_tokenizer = read_model_source(resolve_model_source("tiny-random"))
            name = "tiny-random"
        elif args.smollm2_gguf and Path(args.smollm2_gguf).is_file():
            config, pair_state, pair_tokenizer = read_model_source(ModelSource("smollm2-135m", "gguf",
                                                                               Path(args.smollm2_gguf)))
            name = "smollm2-135m"
        else:
            config, pair_state, pair_tokenizer = SMOLLM2_SHAPE, random_state_dict(SMOLLM2_SHAPE, 1, device), tokenizer
            name = "smollm2-shaped-random"
        loaded = loaded_model(name, config, pair_state, pair_tokenizer, "pair", torch.bfloat16, device)
        return {transport: section({}, transport, pair_check, shapes, device, loaded, transport)
                for transport in ("shm", "tcp")}

    section(report, "pair", pair)
    report["total_s"] = round(time.perf_counter() - started, 1)
    parity = [report[k].get("equal") for k in ("parity_smollm2", "parity_big") if "skipped" not in report[k]]
    pairs = [report["pair"].get(transport, {}) for transport in ("shm", "tcp")]
    report["ok"] = (bool(parity) and all(parity)
                    and all(pair.get("equal_to_colocated") is True and not pair.get("blocks_held") for pair in pairs))
    line = json.dumps(report)
    print(line, flush=True)
    if args.out:
        Path(args.out).write_text(line + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
