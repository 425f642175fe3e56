"""Read a llama-architecture GGUF file into a ModelConfig, a Hugging Face-named fp32 state dict and a Tokenizer.

Checkpoint quirks are undone here so the model code never sees them: GGUF lists tensor shapes
innermost-first, quantized blocks need dequantizing, and llama.cpp's converter permutes the rows of
the Q and K projections for its interleaved RoPE layout (we use the Hugging Face half-split layout).
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

from kvbaton.core.errors import ModelNotFoundError, UnsupportedModelError
from kvbaton.model.config import ModelConfig, RopeScaling, head_counts_problem
from kvbaton.model.llama import rope_inv_freq
from kvbaton.model.tokenizer import Tokenizer

SUPPORTED_ARCHITECTURES = ("llama",)
SUPPORTED_TENSOR_TYPES = frozenset(
    {
        GGMLQuantizationType.F32,
        GGMLQuantizationType.F16,
        GGMLQuantizationType.BF16,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q5_1,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    }
)
# Large tokenizer arrays are consumed by the Tokenizer and left out of the returned metadata.
_TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None if llama has no such tensor."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.{match.group(3)}"


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (per head: rows [0, 2, 4, ..., 1, 3, ...] interleaved).

    llama.cpp's converter does `w.reshape(h, 2, d/2, ...).swapaxes(1, 2)`; the inverse reshapes to
    `(h, d/2, 2, ...)` and swaps back — the same as transformers' GGUF loader.
    """
    half_head_rows = weight.shape[0] // num_heads // 2
    grouped = weight.reshape(num_heads, half_head_rows, 2, *weight.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(1, 2)).reshape(weight.shape)


def _clean_float(value: float) -> float:
    # GGUF stores float32; the shortest repr gives back the value the original config wrote (1e-05, not 9.99e-06).
    return float(str(np.float32(value)))


class _PlainArrayGGUFReader(GGUFReader):
    """GGUFReader that slices a plain ndarray view of its memory map instead of the `np.memmap` itself.

    Parsing a 49k-token vocabulary takes ~800k small slices, and each `np.memmap` slice runs
    `__array_finalize__` in Python: this cuts opening SmolLM2 from ~9 s to ~2.5 s. The view keeps the
    map alive through `.base`, and tensor data stays memory-mapped (nothing is read early).
    """

    @property
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain_data = value.view(np.ndarray)


def open_gguf(path: Path) -> GGUFReader:
    """A GGUFReader over `path`; ModelNotFoundError if absent, UnsupportedModelError if unreadable."""
    if not path.is_file():
        raise ModelNotFoundError(f"GGUF file not found: {path}")
    try:
        return _PlainArrayGGUFReader(path)
    except Exception as exc:  # the reader raises ValueError, struct/numpy errors, ... on a damaged file
        raise UnsupportedModelError(f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc})") from exc


def _metadata(reader: GGUFReader, path: Path) -> tuple[dict[str, object], dict[str, object]]:
    """(plain metadata without the big tokenizer arrays, tokenizer keys) as Python values."""
    metadata: dict[str, object] = {}
    tokenizer_keys: dict[str, object] = {}
    try:
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            value = field.contents()
            if key.startswith("tokenizer."):
                tokenizer_keys[key] = value
            if key not in _TOKENIZER_ARRAYS:
                metadata[key] = value
    except Exception as exc:
        raise UnsupportedModelError(f"{path}: cannot read GGUF metadata ({type(exc).__name__}: {exc})") from exc
    return metadata, tokenizer_keys


def _require(metadata: dict[str, object], key: str, path: Path) -> object:
    if key not in metadata:
        raise UnsupportedModelError(f"{path}: GGUF metadata lacks {key!r}")
    value = metadata[key]
    if isinstance(value, list):
        raise UnsupportedModelError(f"{path}: {key!r} varies per layer, which is not supported")
    return value


def _rope_scaling(metadata: dict[str, object], rope_freqs: np.ndarray | None, config: ModelConfig) -> RopeScaling:
    """Linear scaling from metadata; Llama-3 scaling recovered from the `rope_freqs` divisors llama.cpp stores."""
    prefix = f"{config.architecture}.rope.scaling."
    kind = metadata.get(prefix + "type", "linear")  # llama.cpp's default: a bare factor scales linearly
    original_tokens = int(metadata.get(prefix + "original_context_length", 8192))  # type: ignore[call-overload]
    if rope_freqs is not None:
        # llama.cpp stores per-frequency divisors (inv_freq / scaled inv_freq) instead of the four
        # parameters; Llama 3.x always used low=1, high=4, so take those and check they reproduce the file.
        candidate = RopeScaling("llama3", float(rope_freqs.max()), 1.0, 4.0, original_tokens)
        unscaled = rope_inv_freq(config.head_dim, config.rope_theta, RopeScaling())
        expected = (unscaled / rope_inv_freq(config.head_dim, config.rope_theta, candidate)).double().numpy()
        if rope_freqs.shape != expected.shape or not np.allclose(rope_freqs, expected, rtol=1e-4):
            raise UnsupportedModelError("rope_freqs in this GGUF is not a Llama-3 scaling kvbaton can reproduce")
        return candidate
    if kind in ("none", None):
        return RopeScaling()
    if kind == "linear":
        # As llama.cpp reads it: the factor's pre-2024 key is rope.scale_linear; absent or 0 means no scaling.
        old_key = f"{config.architecture}.rope.scale_linear"
        factor = _clean_float(metadata.get(prefix + "factor", metadata.get(old_key, 0.0)))  # type: ignore[arg-type]
        return RopeScaling("linear", factor) if factor else RopeScaling()
    raise UnsupportedModelError(f"rope scaling type {kind!r} is not supported (none, linear, llama3)")


def _check_architecture(metadata: dict[str, object], path: Path) -> str:
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: GGUF architecture {arch!r} is not supported; kvbaton runs {', '.join(SUPPORTED_ARCHITECTURES)} "
            "GGUF files (Hugging Face directories may also be mistral or qwen2)"
        )
    return str(arch)


def _config(metadata: dict[str, object], num_tokens: int, tensor_names: set[str], path: Path) -> ModelConfig:
    p = f"{_check_architecture(metadata, path)}."
    hidden = int(_require(metadata, p + "embedding_length", path))  # type: ignore[call-overload]
    num_heads = int(_require(metadata, p + "attention.head_count", path))  # type: ignore[call-overload]
    num_kv_heads = int(metadata.get(p + "attention.head_count_kv", num_heads))  # type: ignore[call-overload]
    problem = head_counts_problem(num_heads, num_kv_heads, p + "attention.head_count", p + "attention.head_count_kv")
    if problem is not None:
        raise UnsupportedModelError(f"{path}: {problem}")
    head_dim = int(metadata.get(p + "attention.key_length", hidden // num_heads))  # type: ignore[call-overload]
    # llama.cpp refuses a llama-architecture file whose rope does not span the whole head; experts make it Mixtral.
    rope_dim = int(metadata.get(p + "rope.dimension_count", head_dim))  # type: ignore[call-overload]
    if rope_dim != head_dim:
        raise UnsupportedModelError(f"{path}: {p}rope.dimension_count={rope_dim} is not the head dim {head_dim}")
    if int(metadata.get(p + "expert_count", 0)):  # type: ignore[call-overload]
        raise UnsupportedModelError(f"{path}: mixture-of-experts models ({p}expert_count) are not supported")
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture="llama",
        num_layers=int(_require(metadata, p + "block_count", path)),  # type: ignore[call-overload]
        hidden_size=hidden,
        intermediate_size=int(_require(metadata, p + "feed_forward_length", path)),  # type: ignore[call-overload]
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=num_tokens,
        rope_theta=_clean_float(metadata.get(p + "rope.freq_base", 10000.0)),  # type: ignore[arg-type]
        rms_norm_eps=_clean_float(metadata.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),  # type: ignore[arg-type]
        max_position_embeddings=int(metadata.get(p + "context_length", 2048)),  # type: ignore[call-overload]
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        attention_out_bias="blk.0.attn_output.bias" in tensor_names,
        mlp_bias="blk.0.ffn_down.bias" in tensor_names,
        bos_token_id=int(bos) if bos is not None else None,  # type: ignore[call-overload]
        eos_token_id=int(eos) if eos is not None else None,  # type: ignore[call-overload]
    )


def _dequantized(tensor: ReaderTensor, path: Path) -> np.ndarray:
    """float32 array in Hugging Face orientation ([out, in]): GGUF's innermost-first shape, reversed."""
    qtype = tensor.tensor_type
    if qtype not in SUPPORTED_TENSOR_TYPES:
        raise UnsupportedModelError(
            f"{path}: tensor {tensor.name!r} has type {qtype.name}, which kvbaton cannot dequantize "
            f"(supported: {', '.join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))})"
        )
    shape = tuple(int(dim) for dim in reversed(tensor.shape))
    values = dequantize(tensor.data, qtype).reshape(shape)
    # F32 tensors come back as read-only views of the memory-mapped file; own a writable copy.
    if values.dtype != np.float32 or not values.flags.writeable or not values.flags.c_contiguous:
        values = np.array(values, dtype=np.float32, order="C")
    return values


def read_gguf_tokenizer(path: str | Path) -> Tokenizer:
    """Only the tokenizer of a GGUF file (for processes that tokenize but never run the model)."""
    path = Path(path)
    _, tokenizer_keys = _metadata(open_gguf(path), path)
    return Tokenizer.from_gguf_metadata(tokenizer_keys)


def _read_header(path: Path) -> tuple[ModelConfig, Tokenizer, dict[str, object], dict[str, ReaderTensor]]:
    """(config with its rope scaling, tokenizer, metadata, tensors by GGUF name), no weight dequantized."""
    reader = open_gguf(path)
    metadata, tokenizer_keys = _metadata(reader, path)
    _check_architecture(metadata, path)
    tokens = tokenizer_keys.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list):
        raise UnsupportedModelError(f"{path}: GGUF metadata has no tokenizer.ggml.tokens (no tokenizer)")
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    config = _config(metadata, len(tokens), set(tensors), path)
    tokenizer = Tokenizer.from_gguf_metadata(tokenizer_keys)
    rope_freqs = _dequantized(tensors[_ROPE_FREQS], path).astype(np.float64) if _ROPE_FREQS in tensors else None
    return replace(config, rope_scaling=_rope_scaling(metadata, rope_freqs, config)), tokenizer, metadata, tensors


def read_gguf_header(path: str | Path) -> tuple[ModelConfig, Tokenizer]:
    """(config, tokenizer) of a llama-architecture GGUF file without reading its weights: what the router and
    the planner need (they never run the model), at the cost of the metadata alone."""
    config, tokenizer, _, _ = _read_header(Path(path))
    return config, tokenizer


def read_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer, dict[str, object]]:
    """(config, fp32 Hugging Face-named state dict, tokenizer, metadata) of a llama-architecture GGUF file."""
    path = Path(path)
    config, tokenizer, metadata, tensors = _read_header(path)
    state_dict: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name == _ROPE_FREQS:
            continue  # read into the config's rope scaling
        hf_name = hf_tensor_name(name)
        if hf_name is None:
            raise UnsupportedModelError(f"{path}: tensor {name!r} has no place in a llama model")
        values = _dequantized(tensor, path)
        if ".attn_q." in name:
            values = unpermute_rows(values, config.num_heads)
        elif ".attn_k." in name:
            values = unpermute_rows(values, config.num_kv_heads)
        state_dict[hf_name] = torch.from_numpy(values)
    _check_complete(config, state_dict, path)
    return config, state_dict, tokenizer, metadata


def _check_complete(config: ModelConfig, state_dict: dict[str, torch.Tensor], path: Path) -> None:
    """Every tensor a llama model needs is present with the shape the config implies."""
    expected = config.tensor_shapes()
    for name, shape in expected.items():
        if name not in state_dict:
            raise UnsupportedModelError(f"{path}: missing tensor for {name}")
        if tuple(state_dict[name].shape) != shape:
            raise UnsupportedModelError(
                f"{path}: {name} has shape {tuple(state_dict[name].shape)}, the config implies {shape}"
            )
