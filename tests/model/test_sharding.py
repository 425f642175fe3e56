"""Megatron shards of a Llama state dict: column-parallel rows and row-parallel columns put back together give the
full tensors, a row-parallel bias is counted once (rank 0), pipeline stages renumber their layers, and degrees the
heads do not divide are refused."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvbaton.core.errors import InvalidRequestError
from kvbaton.model.config import ModelConfig
from kvbaton.model.sharding import ModelShard, parallelism_problem, shard_config, shard_state_dict
from kvbaton.model.tiny import TINY_CONFIG, create_tiny_random_model

BIASED = replace(TINY_CONFIG, num_layers=3, attention_bias=True, attention_out_bias=True, mlp_bias=True)


def _biased_model() -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The tiny model with every bias a checkpoint may carry (the generator draws q/k/v's only)."""
    config, state = create_tiny_random_model(config=BIASED)
    generator = torch.Generator().manual_seed(1)
    for name, shape in config.tensor_shapes().items():
        if name not in state:
            state[name] = torch.randn(shape, generator=generator)
    return config, state


def test_tensor_shards_put_back_together_are_the_full_tensors() -> None:
    config, state = _biased_model()
    shards = [shard_state_dict(config, state, ModelShard(t, 2)) for t in range(2)]
    layer = "model.layers.1."
    for name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.bias", "mlp.up_proj.weight"):
        assert torch.equal(torch.cat([s[layer + name] for s in shards], dim=0), state[layer + name])
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        assert torch.equal(torch.cat([s[layer + name] for s in shards], dim=1), state[layer + name])
    for name in ("self_attn.o_proj.bias", "mlp.down_proj.bias"):
        assert torch.equal(shards[0][layer + name], state[layer + name])
        assert not shards[1][layer + name].any()
    assert torch.equal(shards[1]["model.embed_tokens.weight"], state["model.embed_tokens.weight"])  # replicated
    local = shard_config(config, ModelShard(1, 2))
    assert set(shards[1]) == set(local.tensor_shapes())
    assert all(tuple(shards[1][n].shape) == shape for n, shape in local.tensor_shapes().items())


def test_pipeline_stages_take_runs_of_layers_renumbered_from_zero() -> None:
    config, state = _biased_model()
    first, last = (shard_state_dict(config, state, ModelShard(pp_rank=s, pp_size=2)) for s in range(2))
    assert torch.equal(first["model.layers.1.mlp.up_proj.weight"], state["model.layers.1.mlp.up_proj.weight"])
    assert torch.equal(last["model.layers.0.mlp.up_proj.weight"], state["model.layers.2.mlp.up_proj.weight"])
    assert "model.layers.1.mlp.up_proj.weight" not in last


def test_degrees_the_model_cannot_be_split_by_are_refused() -> None:
    assert parallelism_problem(TINY_CONFIG, 2, 2) is None
    assert "does not divide the model's 2 KV heads" in parallelism_problem(TINY_CONFIG, 4, 1)
    with pytest.raises(InvalidRequestError, match="exceeds the model's 2 layers"):
        shard_state_dict(TINY_CONFIG, create_tiny_random_model()[1], ModelShard(pp_rank=0, pp_size=3))
