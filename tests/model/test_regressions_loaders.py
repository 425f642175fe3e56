"""Regressions: a damaged Hugging Face model directory must give an UnsupportedModelError with a message (a
KvbatonError), at load time, never an AttributeError or a torch RuntimeError at the first forward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvbaton.core.errors import KvbatonError
from kvbaton.model.registry import load_model
from kvbaton.model.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)


@pytest.fixture()
def model_dir(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).save_pretrained(str(tmp_path))
    Tokenizer.byte_level().save_pretrained(tmp_path)
    return tmp_path


def _edit_config(directory: Path, **changes: object) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def _loads_and_runs_or_refuses(directory: Path) -> None:
    try:
        loaded = load_model(str(directory), dtype="float32")
    except KvbatonError:
        return
    from kvbaton.core.sampling import SamplingParams
    from kvbaton.llm import LLM

    LLM(str(directory), dtype="float32").generate("hi", SamplingParams(max_tokens=2, temperature=0))
    assert loaded.config.num_heads > 0


def test_tokenizer_config_that_is_not_an_object(model_dir: Path) -> None:
    # Bug: Tokenizer.from_hf_dir does `config.get(...)` on whatever tokenizer_config.json holds -> AttributeError.
    (model_dir / "tokenizer_config.json").write_text("[1, 2]")
    _loads_and_runs_or_refuses(model_dir)


def test_index_whose_weight_map_is_not_an_object(model_dir: Path) -> None:
    # Bug: safetensors_files does `weight_map.values()` on a list -> AttributeError.
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    _loads_and_runs_or_refuses(model_dir)


@pytest.mark.parametrize("changes", [{"num_key_value_heads": 3}, {"num_attention_heads": 0}])
def test_head_counts_that_do_not_fit_the_weights(model_dir: Path, changes: dict) -> None:
    # Bug: config_from_hf/ModelConfig accept head counts that do not divide the weights (3 KV heads of 4, 0 heads
    # with config.json's head_dim), the weights load, and the first forward dies in torch's split_with_sizes.
    _edit_config(model_dir, **changes)
    _loads_and_runs_or_refuses(model_dir)
