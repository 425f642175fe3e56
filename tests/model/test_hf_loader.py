"""read_hf_dir: tiny transformers checkpoints written to tmp_path load back tensor for tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvbaton.core.errors import ModelNotFoundError, UnsupportedModelError
from kvbaton.model.config import RopeScaling
from kvbaton.model.hf_loader import config_from_hf, read_hf_dir
from kvbaton.model.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TINY = dict(
    vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
)


def write_hf_dir(directory: Path, model_cls: type, config: object, max_shard_size: str | None = None) -> dict:
    torch.manual_seed(0)
    model = model_cls(config)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(directory), **kwargs)
    Tokenizer.byte_level().save_pretrained(directory)
    return {k: v.float() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("tied", [True, False])
def test_llama_dir_round_trips(tmp_path: Path, tied: bool) -> None:
    hf_config = transformers.LlamaConfig(**TINY, tie_word_embeddings=tied, rope_theta=50000.0)
    expected = write_hf_dir(tmp_path, transformers.LlamaForCausalLM, hf_config)
    config, state, tokenizer, raw = read_hf_dir(tmp_path)
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) == (
        2, 64, 4, 2, 16,
    )
    assert (config.vocab_size, config.rope_theta, config.tie_word_embeddings, config.attention_bias) == (
        384, 50000.0, tied, False,
    )
    assert (config.bos_token_id, config.eos_token_id, config.max_position_embeddings) == (1, 2, 512)
    if tied:
        expected.pop("lm_head.weight")
    assert sorted(state) == sorted(expected)
    for name, tensor in expected.items():
        assert state[name].dtype == torch.float32
        assert torch.equal(state[name], tensor), name
    assert tokenizer.encode("hi") == [ord("h") + 3, ord("i") + 3]
    assert raw["model_type"] == "llama"


def test_qwen2_sharded_dir_with_biases(tmp_path: Path) -> None:
    hf_config = transformers.Qwen2Config(**TINY, tie_word_embeddings=False)
    expected = write_hf_dir(tmp_path, transformers.Qwen2ForCausalLM, hf_config, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    config, state, _, _ = read_hf_dir(tmp_path)
    assert config.attention_bias and config.architecture == "llama"
    assert sorted(state) == sorted(expected)
    assert torch.equal(state["model.layers.1.self_attn.q_proj.bias"], expected["model.layers.1.self_attn.q_proj.bias"])


def test_bf16_weights_are_returned_as_fp32(tmp_path: Path) -> None:
    hf_config = transformers.LlamaConfig(**TINY)
    model = transformers.LlamaForCausalLM(hf_config).to(torch.bfloat16)
    model.save_pretrained(str(tmp_path))
    Tokenizer.byte_level().save_pretrained(tmp_path)
    _, state, _, _ = read_hf_dir(tmp_path)
    weight = model.state_dict()["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(state["model.layers.0.mlp.up_proj.weight"], weight.float())


def test_config_parsing_rope_and_sliding_window() -> None:
    base = {**TINY, "model_type": "llama", "num_key_value_heads": None}
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    config = config_from_hf({**base, "rope_parameters": llama3}, Path("x"))
    assert config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192) and config.rope_theta == 500000.0
    assert config.num_kv_heads == 4  # absent -> multi-head attention
    mistral = config_from_hf({**base, "model_type": "mistral", "sliding_window": 128}, Path("x"))
    assert mistral.max_position_embeddings == 128
    assert config_from_hf({**base, "eos_token_id": [7, 8]}, Path("x")).eos_token_id == 7
    with pytest.raises(UnsupportedModelError, match="yarn"):
        config_from_hf({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, Path("x"))
    with pytest.raises(UnsupportedModelError, match="hidden_size"):
        config_from_hf({k: v for k, v in base.items() if k != "hidden_size"}, Path("x"))


def test_bad_directories_raise_kvbaton_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError):
        read_hf_dir(tmp_path / "absent")
    with pytest.raises(ModelNotFoundError, match="config.json"):
        read_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(UnsupportedModelError, match="model_type 'gpt2' is not supported"):
        read_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UnsupportedModelError, match="config.json"):
        read_hf_dir(tmp_path)


def test_missing_or_corrupt_weights_and_tokenizer(tmp_path: Path) -> None:
    write_hf_dir(tmp_path, transformers.LlamaForCausalLM, transformers.LlamaConfig(**TINY))
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{broken")
    with pytest.raises(UnsupportedModelError, match="model.safetensors"):
        read_hf_dir(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(UnsupportedModelError, match="no \\*.safetensors"):
        read_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(UnsupportedModelError, match="tokenizer.json"):
        read_hf_dir(tmp_path)
