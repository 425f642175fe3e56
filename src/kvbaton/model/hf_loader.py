"""Read a local Hugging Face model directory (config.json, safetensors, tokenizer) of a Llama-family model."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from kvbaton.core.errors import ModelNotFoundError, UnsupportedModelError
from kvbaton.model.config import ModelConfig, RopeScaling, head_counts_problem
from kvbaton.model.tokenizer import Tokenizer

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_INDEX_FILE = "model.safetensors.index.json"


def is_hf_model_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def _read_json(file: Path) -> dict:
    try:
        value = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UnsupportedModelError(f"cannot read {file}: {exc}") from exc
    if not isinstance(value, dict):
        raise UnsupportedModelError(f"{file} does not hold a JSON object")
    return value


def _rope(raw: dict) -> tuple[float, RopeScaling]:
    """(rope_theta, scaling) from either the classic keys or transformers 5's `rope_parameters`."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(raw.get("rope_theta", params.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, RopeScaling()
    if kind == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    if kind == "llama3":
        return theta, RopeScaling(
            "llama3",
            float(params["factor"]),
            float(params["low_freq_factor"]),
            float(params["high_freq_factor"]),
            int(params["original_max_position_embeddings"]),
        )
    raise UnsupportedModelError(f"rope scaling type {kind!r} is not supported (default, linear, llama3)")


def _first_id(value: object) -> int | None:
    # Some configs list several EOS ids; the first is the model's own end-of-sequence token.
    if isinstance(value, list):
        return int(value[0]) if value else None
    return int(value) if value is not None else None  # type: ignore[call-overload]


def config_from_hf(raw: dict, source: Path) -> ModelConfig:
    """ModelConfig from a config.json dict; UnsupportedModelError for other architectures or missing keys."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{source}: model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    try:
        hidden = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        problem = head_counts_problem(num_heads, num_kv_heads, "num_attention_heads", "num_key_value_heads")
        if problem is not None:
            raise UnsupportedModelError(f"{source}: config.json: {problem}")
        theta, scaling = _rope(raw)
        llama_attention_bias = model_type == "llama" and bool(raw.get("attention_bias", False))
        max_positions = int(raw.get("max_position_embeddings", 2048))
        # Sliding-window attention is not implemented: cap the context at the window so that every
        # sequence we accept attends exactly as the reference would. Mistral slides whenever a window is set
        # (`use_sliding_window` is Qwen2's switch, which Mistral ignores); Llama never does.
        window = raw.get("sliding_window")
        slides = model_type == "mistral" or (model_type == "qwen2" and raw.get("use_sliding_window", False))
        if window and slides:
            max_positions = min(max_positions, int(window))
        # The MLP is SwiGLU; transformers applies whatever `hidden_act` names ("swish" is SiLU too).
        act = raw.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(f"{source}: config.json: hidden_act {act!r} is not supported (silu)")
        return ModelConfig(
            architecture="llama",
            num_layers=int(raw["num_hidden_layers"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            vocab_size=int(raw["vocab_size"]),
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases (none on o_proj); Llama's `attention_bias` puts one on q/k/v and
            # o_proj, its `mlp_bias` on gate/up/down; Mistral has none.
            attention_bias=model_type == "qwen2" or llama_attention_bias,
            attention_out_bias=llama_attention_bias,
            mlp_bias=model_type == "llama" and bool(raw.get("mlp_bias", False)),
            bos_token_id=_first_id(raw.get("bos_token_id")),
            eos_token_id=_first_id(raw.get("eos_token_id")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise UnsupportedModelError(f"{source}: config.json is missing or has a bad value for {exc}") from exc


def safetensors_files(directory: Path) -> list[Path]:
    """The weight shards: those named by the index json if there is one, else every *.safetensors file."""
    index = directory / _INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index).get("weight_map", {})
        if not isinstance(weight_map, dict) or not all(isinstance(name, str) for name in weight_map.values()):
            raise UnsupportedModelError(f"{index}: weight_map must be an object mapping tensor names to file names")
        files = sorted({directory / name for name in weight_map.values()})
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"{directory} has no *.safetensors weights (other formats are not supported)")
    missing = [file.name for file in files if not file.is_file()]
    if missing:
        raise UnsupportedModelError(f"{directory}: weight shards named in {_INDEX_FILE} are missing: {missing}")
    return files


def _load_state_dict(files: list[Path], config: ModelConfig) -> dict[str, torch.Tensor]:
    state_dict: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as shard:
                for name in shard.keys():
                    # Rotary caches are recomputed; a tied checkpoint's lm_head is the embedding again.
                    if name.endswith("rotary_emb.inv_freq"):
                        continue
                    if name == "lm_head.weight" and config.tie_word_embeddings:
                        continue
                    state_dict[name] = shard.get_tensor(name).to(torch.float32)
        except Exception as exc:  # safetensors raises its own SafetensorError on a damaged file
            raise UnsupportedModelError(f"cannot read weights {file}: {exc}") from exc
    return state_dict


def read_hf_header(path: str | Path) -> tuple[ModelConfig, Tokenizer, dict[str, object]]:
    """(config, tokenizer, raw config.json) of a local model directory, without reading its weights (it checks
    that the weight shards are there)."""
    directory = Path(path)
    if not directory.is_dir():
        raise ModelNotFoundError(f"model directory not found: {directory}")
    if not (directory / "config.json").is_file():
        raise ModelNotFoundError(f"{directory} is not a Hugging Face model directory (no config.json)")
    raw = _read_json(directory / "config.json")
    config = config_from_hf(raw, directory)
    tokenizer = Tokenizer.from_hf_dir(directory)
    if tokenizer.eos_token_id is None and config.eos_token_id is not None:
        tokenizer.eos_token_id = config.eos_token_id
    if tokenizer.bos_token_id is None and config.bos_token_id is not None:
        tokenizer.bos_token_id = config.bos_token_id
    safetensors_files(directory)
    return config, tokenizer, raw


def read_hf_dir(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer, dict[str, object]]:
    """(config, fp32 Hugging Face-named state dict, tokenizer, raw config.json) of a local model directory."""
    directory = Path(path)
    config, tokenizer, raw = read_hf_header(directory)
    state_dict = _load_state_dict(safetensors_files(directory), config)
    _check_shapes(config, state_dict, directory)
    return config, state_dict, tokenizer, raw


def _check_shapes(config: ModelConfig, state_dict: dict[str, torch.Tensor], directory: Path) -> None:
    """Every tensor config.json implies has that shape (missing or extra names are LlamaModel's to report)."""
    for name, shape in config.tensor_shapes().items():
        if name in state_dict and tuple(state_dict[name].shape) != shape:
            raise UnsupportedModelError(
                f"{directory}: {name} has shape {tuple(state_dict[name].shape)}, config.json implies {shape}"
            )
