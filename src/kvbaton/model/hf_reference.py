"""transformers' LlamaForCausalLM over exactly our dequantized weights: the reference for tests and benchmarks.

Imports transformers lazily; it is a test/benchmark dependency (the `reference` extra), never
needed to serve.
"""

from __future__ import annotations

import torch

from kvbaton.model.config import ModelConfig
from kvbaton.model.registry import read_model_source, resolve_dtype, resolve_model_source


def hf_llama_config(config: ModelConfig):  # noqa: ANN201 - transformers.LlamaConfig
    import transformers

    scaling = config.rope_scaling
    rope_scaling = None
    if scaling.rope_type != "default":
        rope_scaling = {"rope_type": scaling.rope_type, "factor": scaling.factor}
        if scaling.rope_type == "llama3":
            rope_scaling.update(low_freq_factor=scaling.low_freq_factor, high_freq_factor=scaling.high_freq_factor,
                                original_max_position_embeddings=scaling.original_max_position_embeddings)
    return transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta, rope_scaling=rope_scaling,
        max_position_embeddings=config.max_position_embeddings, tie_word_embeddings=config.tie_word_embeddings,
        attention_bias=config.attention_bias, mlp_bias=config.mlp_bias,
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
    )


def build_hf_reference(config: ModelConfig, state_dict: dict[str, torch.Tensor], dtype: torch.dtype):  # noqa: ANN201
    import transformers

    model = transformers.LlamaForCausalLM(hf_llama_config(config))
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    assert set(missing) <= allowed_missing and not unexpected, (missing, unexpected)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.to(dtype).eval()


def load_hf_reference(name: str, dtype: str | torch.dtype = "float32"):  # noqa: ANN201
    config, state_dict, _ = read_model_source(resolve_model_source(name))
    return build_hf_reference(config, state_dict, resolve_dtype(dtype))
