"""read_model_header: the config and tokenizer a router needs, equal to what the full read gives, without the
weights (reading them costs 4 bytes a parameter in a process that never runs the model)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvbaton.core.errors import UnsupportedModelError
from kvbaton.model.config import RopeScaling
from kvbaton.model.gguf_loader import read_gguf, read_gguf_header
from kvbaton.model.hf_loader import read_hf_dir, read_hf_header
from kvbaton.model.llama import rope_inv_freq
from kvbaton.model.registry import read_model_header, read_model_source, resolve_model_source
from kvbaton.model.tiny import create_tiny_random_model
from kvbaton.model.tokenizer import Tokenizer
from tests.model.test_gguf_loader import write_gguf

PROBE = "Hello, world! <|im_start|>user\nThe capital of France is"


def same_tokenizer(a: Tokenizer, b: Tokenizer) -> bool:
    return (a.encode(PROBE) == b.encode(PROBE) and a.vocab_size == b.vocab_size
            and (a.bos_token_id, a.eos_token_id) == (b.bos_token_id, b.eos_token_id))


def test_tiny_random_header_is_the_full_read() -> None:
    source = resolve_model_source("tiny-random")
    config, tokenizer = read_model_header(source)
    full_config, _, full_tokenizer = read_model_source(source)
    assert config == full_config and same_tokenizer(tokenizer, full_tokenizer)


def test_gguf_header_matches_the_full_read_with_llama3_rope_freqs(tmp_path: Path) -> None:
    config, state = create_tiny_random_model(seed=0)
    llama3 = RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    divisors = rope_inv_freq(config.head_dim, config.rope_theta, RopeScaling()) / rope_inv_freq(
        config.head_dim, config.rope_theta, llama3)
    write_gguf(tmp_path / "l3.gguf", config, state, extra_tensors={"rope_freqs.weight": divisors.numpy()},
               metadata={"llama.rope.scaling.original_context_length": 64})
    header_config, header_tokenizer = read_gguf_header(tmp_path / "l3.gguf")
    full_config, _, full_tokenizer, _ = read_gguf(tmp_path / "l3.gguf")
    assert header_config == full_config and header_config.rope_scaling == llama3
    assert same_tokenizer(header_tokenizer, full_tokenizer)
    # What the header alone can see is still refused there: rope divisors no Llama-3 parameters reproduce.
    write_gguf(tmp_path / "odd.gguf", config, state, extra_tensors={"rope_freqs.weight": divisors.numpy()[::-1].copy()},
               metadata={"llama.rope.scaling.original_context_length": 64})
    with pytest.raises(UnsupportedModelError, match="rope_freqs"):
        read_gguf_header(tmp_path / "odd.gguf")


def test_hf_header_matches_the_full_read_and_wants_the_weights_there(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(hf_config).save_pretrained(str(tmp_path))
    Tokenizer.byte_level().save_pretrained(tmp_path)
    config, tokenizer, raw = read_hf_header(tmp_path)
    full_config, _, full_tokenizer, full_raw = read_hf_dir(tmp_path)
    assert config == full_config and raw == full_raw and same_tokenizer(tokenizer, full_tokenizer)
    for file in tmp_path.glob("*.safetensors"):
        file.unlink()
    with pytest.raises(UnsupportedModelError, match="no \\*.safetensors"):
        read_hf_header(tmp_path)


@pytest.mark.smollm2
def test_smollm2_header_matches_and_costs_no_weights() -> None:
    source = resolve_model_source("smollm2-135m")
    config, tokenizer = read_model_header(source)
    full_config, _, full_tokenizer = read_model_source(source)
    assert config == full_config and same_tokenizer(tokenizer, full_tokenizer)
    # Peak memory of a process reading only the header, against one reading everything (~0.5 GB of fp32).
    # VmHWM is the process image's own peak (ru_maxrss can carry the forking parent's over exec).
    script = ("import re; from kvbaton.model.registry import {fn}, resolve_model_source; "
              "{fn}(resolve_model_source('smollm2-135m')); "
              "print(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))")
    peaks = {fn: int(subprocess.run([sys.executable, "-c", script.format(fn=fn)], capture_output=True, text=True,
                                    check=True, timeout=120).stdout.split()[-1])
             for fn in ("read_model_header", "read_model_source")}
    assert peaks["read_model_source"] - peaks["read_model_header"] > 300_000, peaks  # KiB: the weights' 0.5 GB
