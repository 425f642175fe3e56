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
    attention_bias: bool = False  # qwen2 has q/k/v biases
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """2 (K and V) x layers x KV heads x head dim x bytes (seed 000 section 2)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def kv_layout_id(self, dtype_name: str, block_size: int) -> str:
        """Identity of the KV layout: KV is only ever shared or transferred between equal ids."""
        return (
            f"{self.architecture}-L{self.num_layers}-kvh{self.num_kv_heads}-hd{self.head_dim}"
            f"-{dtype_name}-bs{block_size}"
        )
