"""Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU) whose attention reads and writes a paged KV cache.

Shapes: T = tokens of the step (all sequences' new tokens concatenated), H/KVH = query/KV heads,
Dh = head dim. The KV cache is `[num_layers, 2, num_blocks, block_size, KVH, Dh]`, owned by the caller.
Checkpoint quirks (GGUF permutations, naming) are the loaders' job: this module takes a Hugging Face-named
state dict and only fuses q/k/v and gate/up into single matmuls (prepacked for oneDNN on CPU bf16).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from kvbaton.core.errors import UnsupportedModelError
from kvbaton.model.attention import AttentionMetadata, bucket_rows, paged_attention
from kvbaton.model.config import ModelConfig, RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> Tensor:
    """[Dh/2] float32 inverse frequencies, with linear or Llama-3 scaling as in the Hugging Face reference."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.rope_type == "default":
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_freq_wavelen = old_len / scaling.low_freq_factor
        high_freq_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are stretched by `factor`, short ones kept, the band between interpolated.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise UnsupportedModelError(f"unsupported rope_scaling type {scaling.rope_type!r}")


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm computed in float32 and cast back, like the reference (matters for bf16)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [T, heads, Dh]; cos/sin: [T, 1, Dh]. Rotates halves (the Hugging Face layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Linear(torch.nn.Module):
    """y = x W^T + b. On CPU in bfloat16 the weight is kept only in oneDNN's prepacked (AMX-blocked) layout.

    That path was measured 1.4-1.9x faster than F.linear on SmolLM2's shapes at 1-16 rows (decode is
    bound by these matmuls). It uses torch's internal mkldnn ops, so it is probed once at construction
    and F.linear is the fallback (and the only path on CUDA or in float32). The model must be built on
    its device: a prepacked weight does not follow `.to()`.

    oneDNN builds (JIT-compiles) and caches one primitive per input row count, about 0.25 MB and 25 ms each,
    and eviction from its cache does not return all of it: a server whose steps take every row count from
    1 to max_num_batched_tokens grew by hundreds of MB. The rows are therefore zero-padded up to
    `bucket_rows(n)`, which bounds the distinct row counts (16 per doubling) for at most 6.25 % more rows.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        self.bias = None if bias is None else _param(bias)
        self.packed = _prepack_for_cpu(weight, self.bias)
        self.weight = None if self.packed is not None else _param(weight)

    def forward(self, x: Tensor) -> Tensor:
        if self.packed is not None:
            rows = x.shape[0]
            padded = bucket_rows(rows)
            if padded != rows:
                x = F.pad(x, (0, 0, 0, padded - rows))
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")[:rows]
        return F.linear(x, self.weight, self.bias)


def _prepack_for_cpu(weight: Tensor, bias: Tensor | None) -> Tensor | None:
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        probe = torch.randn(2, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, bias, "none", [], "")
    except (AttributeError, RuntimeError):
        return None
    want = F.linear(probe, weight, bias)
    return packed if torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2) else None


class LlamaLayer(torch.nn.Module):
    """One decoder block with fused QKV and gate/up weights."""

    def __init__(self, config: ModelConfig, weights: Mapping[str, Tensor],
                 all_reduce: Callable[[Tensor], object] | None = None) -> None:
        super().__init__()
        # Tensor parallel: o_proj and down_proj hold this rank's input columns, so their outputs are partial sums
        # that `all_reduce` (torch.distributed's, in place) completes; None on one rank.
        self.all_reduce = all_reduce
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.input_norm = _param(weights["input_layernorm.weight"])
        self.post_attention_norm = _param(weights["post_attention_layernorm.weight"])
        # `weights` holds exactly the config's tensors, so a bias is there only where the config has one.
        self.qkv_proj = Linear(*_fused(weights, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")))
        self.o_proj = Linear(weights["self_attn.o_proj.weight"], weights.get("self_attn.o_proj.bias"))
        self.gate_up_proj = Linear(*_fused(weights, ("mlp.gate_proj", "mlp.up_proj")))
        self.down_proj = Linear(weights["mlp.down_proj.weight"], weights.get("mlp.down_proj.bias"))

    def forward(self, hidden: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata, layer_cache: Tensor) -> Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(rms_norm(hidden, self.input_norm, self.eps))
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = apply_rope(q.view(num_tokens, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        attended = self.o_proj(paged_attention(q, k, v, layer_cache, meta))
        if self.all_reduce is not None:
            self.all_reduce(attended)
        hidden = hidden + attended
        gate, up = self.gate_up_proj(rms_norm(hidden, self.post_attention_norm, self.eps)).chunk(2, dim=-1)
        mlp_out = self.down_proj(F.silu(gate) * up)
        if self.all_reduce is not None:
            self.all_reduce(mlp_out)
        return hidden + mlp_out


class LlamaModel(torch.nn.Module):
    """The decoder stack plus LM head; run it under `torch.inference_mode()`.

    One rank of a parallel worker builds it from its shard (`kvbaton.model.sharding`): `config` is then the shard's
    (its heads, MLP rows and layers), `all_reduce` completes the row-parallel outputs, and a pipeline stage that is
    not the last returns its hidden states un-normed for the next stage."""

    def __init__(self, config: ModelConfig, weights: Mapping[str, Tensor],
                 all_reduce: Callable[[Tensor], object] | None = None, is_last_stage: bool = True) -> None:
        super().__init__()
        self.config = config
        self.is_last_stage = is_last_stage
        self.embed_tokens = _param(weights["model.embed_tokens.weight"])
        self.layers = torch.nn.ModuleList(
            LlamaLayer(config, _sub_dict(weights, f"model.layers.{i}."), all_reduce) for i in range(config.num_layers)
        )
        self.norm = _param(weights["model.norm.weight"])
        self.lm_head = Linear(weights["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"])
        # cos/sin for every position once, in float32 then cast to the model dtype (as the reference does).
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        angles = torch.outer(torch.arange(config.max_position_embeddings, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1).to(self.embed_tokens.device)
        dtype = self.embed_tokens.dtype
        self.register_buffer("rope_cos", angles.cos().to(dtype), persistent=False)
        self.register_buffer("rope_sin", angles.sin().to(dtype), persistent=False)

    @classmethod
    def from_hf_state_dict(
        cls,
        config: ModelConfig,
        state_dict: Mapping[str, Tensor],
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        all_reduce: Callable[[Tensor], object] | None = None,
        is_last_stage: bool = True,
    ) -> LlamaModel:
        """Build from Hugging Face names; raises UnsupportedModelError on missing or unexpected tensors."""
        expected = _expected_names(config)
        missing = sorted(expected - state_dict.keys())
        # Rotary caches are recomputed here, never read from a checkpoint; a tied checkpoint may still
        # carry a copy of the embedding as lm_head.weight.
        ignorable = {"lm_head.weight"} if config.tie_word_embeddings else set()
        unexpected = sorted(
            k for k in state_dict.keys() - expected - ignorable if not k.endswith("rotary_emb.inv_freq")
        )
        if missing or unexpected:
            raise UnsupportedModelError(
                f"state dict does not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        weights = {name: state_dict[name].to(device=device, dtype=dtype) for name in expected}
        with torch.inference_mode(False), torch.no_grad():
            return cls(config, weights, all_reduce, is_last_stage)

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata, kv_cache: Tensor,
                between_layers: Callable[[], None] | None = None, hidden_in: Tensor | None = None) -> Tensor:
        """[T] ids and positions in `meta`'s order -> final-normed hidden states [T, hidden].

        `between_layers`, when given, is called after each layer (as vLLM's layer-wise KV connector hooks are):
        the serving loop's chance to act on messages during a long forward. It must not touch this step's
        inputs or KV. A later pipeline stage passes the previous stage's output as `hidden_in` (the ids are then
        unused); a stage that is not the last returns its hidden states un-normed."""
        if positions.numel() and int(positions.max()) >= self.rope_cos.shape[0]:
            raise ValueError(f"position beyond max_position_embeddings={self.rope_cos.shape[0]}")
        hidden = F.embedding(input_ids, self.embed_tokens) if hidden_in is None else hidden_in
        cos = self.rope_cos[positions].unsqueeze(1)  # [T, 1, Dh], shared by all layers
        sin = self.rope_sin[positions].unsqueeze(1)
        for layer_index, layer in enumerate(self.layers):
            hidden = layer(hidden, cos, sin, meta, kv_cache[layer_index])
            if between_layers is not None:
                between_layers()
        if not self.is_last_stage:
            return hidden
        return rms_norm(hidden, self.norm, self.config.rms_norm_eps)

    def warm_up_linears(self, max_rows: int, max_logit_rows: int) -> int:
        """Run every distinct linear shape at every row bucket a step can use (`bucket_rows` of 1 ..= max_rows; the
        LM head up to `max_logit_rows`), so that oneDNN builds all its primitives now: a server's memory and
        step times then no longer change as new row counts arrive. Returns how many shapes ran (0 off oneDNN)."""
        layer = self.layers[0]  # every layer has the same shapes, and oneDNN caches by shape
        linears = [(linear, max_rows) for linear in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj,
                                                     layer.down_proj)]
        linears.append((self.lm_head, max_logit_rows))
        num_run = 0
        with torch.inference_mode():
            for linear, limit in linears:
                if linear.packed is None:
                    continue
                in_features = linear.packed.shape[1]
                for rows in sorted({bucket_rows(n) for n in range(1, limit + 1)}):
                    linear(torch.zeros(rows, in_features, dtype=self.embed_tokens.dtype))
                    num_run += 1
        return num_run

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[N, hidden] (rows of `forward`'s output) -> [N, vocab] float32."""
        return self.lm_head(hidden).float()


def _param(tensor: Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(tensor.contiguous(), requires_grad=False)


def _sub_dict(weights: Mapping[str, Tensor], prefix: str) -> dict[str, Tensor]:
    return {name[len(prefix) :]: t for name, t in weights.items() if name.startswith(prefix)}


def _fused(weights: Mapping[str, Tensor], names: tuple[str, ...]) -> tuple[Tensor, Tensor | None]:
    """(weights of `names` stacked by rows, their biases stacked likewise or None when they have none)."""
    weight = torch.cat([weights[f"{name}.weight"] for name in names], dim=0)
    if f"{names[0]}.bias" not in weights:
        return weight, None
    return weight, torch.cat([weights[f"{name}.bias"] for name in names], dim=0)


def _expected_names(config: ModelConfig) -> set[str]:
    return set(config.tensor_shapes())
