"""A seeded, randomly initialised tiny Llama (`tiny-random`) for fast tests of everything above the model."""

from __future__ import annotations

import torch
from torch import Tensor

from kvbaton.model.config import ModelConfig

TINY_CONFIG = ModelConfig(
    architecture="llama",
    num_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    vocab_size=384,  # 256 byte tokens + specials of the byte-level test tokenizer, with room to spare
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


def create_tiny_random_model(
    seed: int = 0, dtype: torch.dtype = torch.float32, config: ModelConfig = TINY_CONFIG
) -> tuple[ModelConfig, dict[str, Tensor]]:
    """(config, Hugging Face-named state dict) with weights drawn from a private generator seeded by `seed`.

    With a tied head the logit of the current token is its embedding's squared norm, so a model whose
    residual stream is dominated by the embedding just echoes its input (and would hide KV-cache bugs).
    Hence the residual branches (o_proj, down_proj) are scaled up 8x over a unit-gain init and q/k 2x
    for sharper attention: greedy continuations then depend on the whole context and top-2 logit gaps
    stay far above float32 error. Embeddings use std 1, so logits are spread out.
    `config` may be a variant of TINY_CONFIG (bias, rope scaling, untied head) for tests.
    """
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> Tensor:
        return (torch.randn(*shape, generator=generator) * std).to(dtype)

    def norm_weight(size: int) -> Tensor:
        return (1.0 + 0.1 * torch.randn(size, generator=generator)).to(dtype)

    residual_gain, qk_gain = 8.0, 2.0
    hidden, ffn, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_size, kv_size = config.num_heads * head_dim, config.num_kv_heads * head_dim
    state: dict[str, Tensor] = {"model.embed_tokens.weight": normal(config.vocab_size, hidden, std=1.0)}
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        state[prefix + "input_layernorm.weight"] = norm_weight(hidden)
        state[prefix + "self_attn.q_proj.weight"] = normal(q_size, hidden, std=qk_gain * hidden**-0.5)
        state[prefix + "self_attn.k_proj.weight"] = normal(kv_size, hidden, std=qk_gain * hidden**-0.5)
        state[prefix + "self_attn.v_proj.weight"] = normal(kv_size, hidden, std=hidden**-0.5)
        state[prefix + "self_attn.o_proj.weight"] = normal(hidden, q_size, std=residual_gain * q_size**-0.5)
        if config.attention_bias:
            state[prefix + "self_attn.q_proj.bias"] = normal(q_size, std=0.1)
            state[prefix + "self_attn.k_proj.bias"] = normal(kv_size, std=0.1)
            state[prefix + "self_attn.v_proj.bias"] = normal(kv_size, std=0.1)
        state[prefix + "post_attention_layernorm.weight"] = norm_weight(hidden)
        state[prefix + "mlp.gate_proj.weight"] = normal(ffn, hidden, std=hidden**-0.5)
        state[prefix + "mlp.up_proj.weight"] = normal(ffn, hidden, std=hidden**-0.5)
        state[prefix + "mlp.down_proj.weight"] = normal(hidden, ffn, std=residual_gain * ffn**-0.5)
    state["model.norm.weight"] = norm_weight(hidden)
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = normal(config.vocab_size, hidden, std=1.0)
    return config, state
