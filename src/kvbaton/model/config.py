"""Architecture of a Llama-family decoder, as read from a checkpoint (a frozen value)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama-3-style frequency scaling; `rope_type == "default"` means none."""

    rope_type: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str  # "llama" (also used for mistral/qwen2-shaped checkpoints)
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q/k/v (qwen2; llama's `attention_bias`)
    attention_out_bias: bool = False  # a bias on o_proj too (llama's `attention_bias`; qwen2 has none)
    mlp_bias: bool = False  # biases on gate/up/down (llama's `mlp_bias`)
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Hugging Face name -> shape of every tensor this architecture needs (a tied model has no lm_head)."""
        hidden, q_rows, kv_rows = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (self.vocab_size, hidden),
            "model.norm.weight": (hidden,),
        }
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, hidden)
        per_layer: dict[str, tuple[int, ...]] = {
            "input_layernorm.weight": (hidden,),
            "post_attention_layernorm.weight": (hidden,),
            "self_attn.q_proj.weight": (q_rows, hidden),
            "self_attn.k_proj.weight": (kv_rows, hidden),
            "self_attn.v_proj.weight": (kv_rows, hidden),
            "self_attn.o_proj.weight": (hidden, q_rows),
            "mlp.gate_proj.weight": (self.intermediate_size, hidden),
            "mlp.up_proj.weight": (self.intermediate_size, hidden),
            "mlp.down_proj.weight": (hidden, self.intermediate_size),
        }
        if self.attention_bias:
            per_layer |= {"self_attn.q_proj.bias": (q_rows,), "self_attn.k_proj.bias": (kv_rows,),
                          "self_attn.v_proj.bias": (kv_rows,)}
        if self.attention_out_bias:
            per_layer["self_attn.o_proj.bias"] = (hidden,)
        if self.mlp_bias:
            ffn = self.intermediate_size
            per_layer |= {"mlp.gate_proj.bias": (ffn,), "mlp.up_proj.bias": (ffn,), "mlp.down_proj.bias": (hidden,)}
        for i in range(self.num_layers):
            shapes.update({f"model.layers.{i}.{name}": shape for name, shape in per_layer.items()})
        return shapes

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """2 (K and V) x layers x KV heads x head dim x bytes (seed 000 section 2)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def kv_layout_id(self, dtype_name: str, block_size: int) -> str:
        """Identity of the KV layout: KV is only ever shared or transferred between equal ids."""
        return (
            f"{self.architecture}-L{self.num_layers}-kvh{self.num_kv_heads}-hd{self.head_dim}"
            f"-{dtype_name}-bs{block_size}"
        )


def head_counts_problem(num_heads: int, num_kv_heads: int, heads_key: str, kv_heads_key: str) -> str | None:
    """Why a checkpoint's attention head counts (named by its own keys) cannot describe a model, or None.

    Each KV head serves a whole group of query heads, so the KV head count must divide the query head count."""
    if num_heads <= 0:
        return f"{heads_key} must be positive, got {num_heads}"
    if num_kv_heads <= 0:
        return f"{kv_heads_key} must be positive, got {num_kv_heads}"
    if num_heads % num_kv_heads:
        return f"{kv_heads_key}={num_kv_heads} does not divide {heads_key}={num_heads}"
    return None
