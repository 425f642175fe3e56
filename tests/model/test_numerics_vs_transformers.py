"""Model numerics against transformers (bug hunt): tiny random checkpoints, float32.

Each test names a config transformers runs and kvbaton either ran with other logits or refused for no reason
(or accepted where it must refuse).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvbaton.core.errors import UnsupportedModelError
from kvbaton.core.sampling import SamplingParams
from kvbaton.llm import LLM
from kvbaton.model.attention import AttentionMetadata, SequenceSlice
from kvbaton.model.config import RopeScaling
from kvbaton.model.gguf_loader import read_gguf, read_gguf_header
from kvbaton.model.hf_loader import config_from_hf, read_hf_dir
from kvbaton.model.llama import LlamaModel
from kvbaton.model.tiny import create_tiny_random_model
from kvbaton.model.tokenizer import Tokenizer
from tests.model.test_gguf_loader import write_gguf

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TINY = dict(
    vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
)
PROMPT = [(7 * i * i + 3 * i + 5) % 380 + 3 for i in range(37)]  # 37 tokens: two full 16-token blocks and a bit


def save_checkpoint(directory: Path, config_cls: type, model_cls: type, **overrides: object) -> torch.nn.Module:
    """A random checkpoint in `directory` (weights larger than transformers' init, so that every term counts)."""
    torch.manual_seed(0)
    model = model_cls(config_cls(**TINY, **overrides)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.2)
    model.save_pretrained(str(directory))
    Tokenizer.byte_level().save_pretrained(directory)
    return model


def kvbaton_logits(model: LlamaModel, ids: list[int], block_size: int = 16) -> torch.Tensor:
    """[len(ids), vocab] logits of one prefill through the paged KV cache."""
    config = model.config
    num_blocks = -(-len(ids) // block_size)
    kv_cache = torch.zeros(config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
    meta = AttentionMetadata.build([SequenceSlice(0, len(ids), list(range(num_blocks)))], block_size)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), meta, kv_cache))


def reference_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


LLAMA_BIASES = {"attention_bias": dict(attention_bias=True), "mlp_bias": dict(mlp_bias=True)}


@pytest.mark.parametrize("variant", sorted(LLAMA_BIASES))
def test_llama_checkpoint_with_biases_matches_transformers(tmp_path: Path, variant: str) -> None:
    """Llama's `attention_bias` also puts a bias on o_proj (qwen2's q/k/v-only biases do not), and `mlp_bias` on
    gate/up/down: both used to be refused as unexpected tensors."""
    reference = save_checkpoint(tmp_path, transformers.LlamaConfig, transformers.LlamaForCausalLM,
                                **LLAMA_BIASES[variant])
    config, state, _, _ = read_hf_dir(tmp_path)
    model = LlamaModel.from_hf_state_dict(config, state, torch.float32)
    torch.testing.assert_close(kvbaton_logits(model, PROMPT), reference_logits(reference, PROMPT), atol=1e-4, rtol=0)


def test_llama_biases_greedy_through_the_engine(tmp_path: Path) -> None:
    """Both biases, chunked prefill and paged decode: the greedy continuation is transformers' token for token."""
    reference = save_checkpoint(tmp_path, transformers.LlamaConfig, transformers.LlamaForCausalLM,
                                attention_bias=True, mlp_bias=True)
    with torch.inference_mode():
        want = reference.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, len(PROMPT):].tolist()
    llm = LLM(str(tmp_path), dtype="float32", block_size=16, num_blocks=16, max_num_batched_tokens=16)
    (result,) = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert result.outputs[0].token_ids == want


def test_llama_biases_round_trip_through_gguf(tmp_path: Path) -> None:
    """llama.cpp's llama architecture takes optional attn_output and ffn biases too."""
    reference = save_checkpoint(tmp_path, transformers.LlamaConfig, transformers.LlamaForCausalLM,
                                attention_bias=True, mlp_bias=True)
    config, state, _, _ = read_hf_dir(tmp_path)
    write_gguf(tmp_path / "bias.gguf", config, state)
    got_config, got_state, _, _ = read_gguf(tmp_path / "bias.gguf")
    assert got_config == config
    model = LlamaModel.from_hf_state_dict(got_config, got_state, torch.float32)
    torch.testing.assert_close(kvbaton_logits(model, PROMPT), reference_logits(reference, PROMPT), atol=1e-4, rtol=0)


BASE_RAW = {**TINY, "model_type": "llama"}


@pytest.mark.parametrize(("model_type", "act"), [("llama", "gelu"), ("qwen2", "gelu_pytorch_tanh"),
                                                 ("mistral", "relu")])
def test_activation_other_than_silu_is_refused(model_type: str, act: str) -> None:
    """transformers honours `hidden_act`; kvbaton's MLP is SwiGLU only, and used to run any act as SiLU."""
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        config_from_hf({**BASE_RAW, "model_type": model_type, "hidden_act": act}, Path("x"))


@pytest.mark.parametrize("act", ["silu", "swish"])
def test_silu_spellings_are_accepted(act: str) -> None:
    assert config_from_hf({**BASE_RAW, "hidden_act": act}, Path("x")).num_layers == 2


def test_mistral_slides_whatever_use_sliding_window_says() -> None:
    """MistralConfig has no `use_sliding_window` (Qwen2's key): transformers slides whenever `sliding_window` is
    set, so the context must be capped at the window even when a config.json carries that key as false."""
    raw = {**BASE_RAW, "model_type": "mistral", "sliding_window": 40, "use_sliding_window": False}
    assert config_from_hf(raw, Path("x")).max_position_embeddings == 40
    qwen2 = {**raw, "model_type": "qwen2"}
    assert config_from_hf(qwen2, Path("x")).max_position_embeddings == TINY["max_position_embeddings"]


def test_gguf_partial_rotary_or_experts_are_refused(tmp_path: Path) -> None:
    """A rope dimension other than the head dim (llama.cpp refuses it for this architecture) used to be ignored,
    as were Mixtral-style experts (GGUF architecture `llama` with an expert count) until a tensor failed."""
    config, state = create_tiny_random_model(seed=0)
    write_gguf(tmp_path / "ok.gguf", config, state, metadata={"llama.rope.dimension_count": config.head_dim})
    assert read_gguf_header(tmp_path / "ok.gguf")[0] == config
    write_gguf(tmp_path / "partial.gguf", config, state, metadata={"llama.rope.dimension_count": config.head_dim // 2})
    with pytest.raises(UnsupportedModelError, match="rope.dimension_count"):
        read_gguf_header(tmp_path / "partial.gguf")
    write_gguf(tmp_path / "moe.gguf", config, state, metadata={"llama.expert_count": 8})
    with pytest.raises(UnsupportedModelError, match="expert"):
        read_gguf_header(tmp_path / "moe.gguf")


def test_gguf_linear_rope_factor_under_its_old_key_or_without_a_type(tmp_path: Path) -> None:
    """llama.cpp reads a bare factor as linear scaling, and the factor from `rope.scale_linear` in files converted
    before `rope.scaling.factor` existed: both used to be ignored (unscaled rope), or a KeyError."""
    config, state = create_tiny_random_model(seed=0)
    cases = {"old.gguf": {"llama.rope.scale_linear": 4.0}, "bare.gguf": {"llama.rope.scaling.factor": 4.0},
             "nofactor.gguf": {"llama.rope.scaling.type": "linear"}}
    for name, metadata in cases.items():
        write_gguf(tmp_path / name, config, state, metadata=metadata)
    assert read_gguf_header(tmp_path / "old.gguf")[0].rope_scaling == RopeScaling("linear", 4.0)
    assert read_gguf_header(tmp_path / "bare.gguf")[0].rope_scaling == RopeScaling("linear", 4.0)
    assert read_gguf_header(tmp_path / "nofactor.gguf")[0].rope_scaling == RopeScaling()
