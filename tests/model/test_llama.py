"""LlamaModel with a paged KV cache against Hugging Face transformers (fp32, eager attention)."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import pytest
import torch

from kvbaton.core.errors import UnsupportedModelError
from kvbaton.model.attention import AttentionMetadata, SequenceSlice
from kvbaton.model.config import ModelConfig, RopeScaling
from kvbaton.model.llama import LlamaModel, Linear
from kvbaton.model.tiny import TINY_CONFIG, create_tiny_random_model

transformers = pytest.importorskip("transformers")

NUM_NEW_TOKENS = 32
LOGIT_ATOL = 2e-4


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def hf_model(config: ModelConfig, state: dict[str, torch.Tensor], qwen2: bool = False) -> torch.nn.Module:
    rope: dict[str, object] = {"rope_type": config.rope_scaling.rope_type, "rope_theta": config.rope_theta}
    if config.rope_scaling.rope_type != "default":
        rope["factor"] = config.rope_scaling.factor
    if config.rope_scaling.rope_type == "llama3":
        rope["low_freq_factor"] = config.rope_scaling.low_freq_factor
        rope["high_freq_factor"] = config.rope_scaling.high_freq_factor
        rope["original_max_position_embeddings"] = config.rope_scaling.original_max_position_embeddings
    common = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        rope_parameters=rope,
    )
    if qwen2:
        hf_config = transformers.Qwen2Config(**common)
        model_cls = transformers.Qwen2ForCausalLM
    else:
        hf_config = transformers.LlamaConfig(**common, head_dim=config.head_dim, attention_bias=config.attention_bias)
        model_cls = transformers.LlamaForCausalLM
    hf_config._attn_implementation = "eager"
    model = model_cls(hf_config).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert unexpected == []
    assert missing == (["lm_head.weight"] if config.tie_word_embeddings else [])
    return model


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompt: list[int], num_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation (HF's own KV cache), and the logits that chose each token from one full pass."""
    out = model(torch.tensor([prompt]), use_cache=True)
    ids = list(prompt)
    for _ in range(num_new_tokens):
        ids.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([ids[-1:]]), cache=out.past_key_values, use_cache=True)
    logits = model(torch.tensor([ids])).logits[0, len(prompt) - 1 : -1].float()
    return ids[len(prompt) :], logits


@dataclass
class PagedSeq:
    tokens: list[int]
    prompt_len: int
    block_ids: list[int]
    num_computed: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)


class PagedGreedy:
    """A minimal runner: chunked prefill under a token budget, shuffled block ids, mixed batches."""

    def __init__(self, model: LlamaModel, block_size: int, num_blocks: int = 128, seed: int = 0) -> None:
        config = model.config
        self.model = model
        self.block_size = block_size
        self.rng = random.Random(seed)
        self.free_blocks = list(range(num_blocks))
        self.rng.shuffle(self.free_blocks)  # non-contiguous tables catch indexing bugs
        self.kv_cache = torch.zeros(
            config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim
        )

    def new_seq(self, prompt: list[int], shared: PagedSeq | None = None, num_shared_blocks: int = 0) -> PagedSeq:
        """A sequence, optionally starting with the first blocks of `shared` already computed (a prefix hit)."""
        seq = PagedSeq(tokens=list(prompt), prompt_len=len(prompt), block_ids=[])
        if shared is not None:
            seq.block_ids = shared.block_ids[:num_shared_blocks]
            seq.num_computed = num_shared_blocks * self.block_size
            assert seq.tokens[: seq.num_computed] == shared.tokens[: seq.num_computed]
        return seq

    @torch.inference_mode()
    def run(
        self, seqs: list[PagedSeq], num_new_tokens: int, token_budget: int, shuffle_order: bool = False
    ) -> list[list[int]]:
        while any(len(s.tokens) - s.prompt_len < num_new_tokens for s in seqs):
            active = [s for s in seqs if len(s.tokens) - s.prompt_len < num_new_tokens]
            decodes = [s for s in active if s.num_computed == len(s.tokens) - 1]
            prefills = [s for s in active if s.num_computed < len(s.tokens) - 1]
            plan: list[tuple[PagedSeq, int]] = [(s, 1) for s in decodes]
            budget = token_budget - len(decodes)
            for s in prefills:
                if budget <= 0:
                    break
                n = min(budget, len(s.tokens) - s.num_computed)
                plan.append((s, n))
                budget -= n
            if shuffle_order:
                self.rng.shuffle(plan)
            self.step(plan)
        return [s.tokens[s.prompt_len :] for s in seqs]

    def step(self, plan: list[tuple[PagedSeq, int]]) -> None:
        slices, ids, positions, last_rows = [], [], [], []
        for seq, n in plan:
            end = seq.num_computed + n
            while len(seq.block_ids) * self.block_size < end:
                seq.block_ids.append(self.free_blocks.pop())
            slices.append(SequenceSlice(seq.num_computed, n, tuple(seq.block_ids)))
            ids += seq.tokens[seq.num_computed : end]
            positions += range(seq.num_computed, end)
            last_rows.append(len(ids) - 1)
        meta = AttentionMetadata.build(slices, self.block_size)
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), meta, self.kv_cache)
        logits = self.model.compute_logits(hidden[last_rows])
        for (seq, n), row_logits in zip(plan, logits, strict=True):
            seq.num_computed += n
            if seq.num_computed == len(seq.tokens):
                seq.logits.append(row_logits)
                seq.tokens.append(int(row_logits.argmax()))


def prompts(seed: int, lengths: list[int], vocab_size: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def tiny() -> tuple[LlamaModel, torch.nn.Module]:
    config, state = create_tiny_random_model(seed=0)
    return LlamaModel.from_hf_state_dict(config, state, torch.float32), hf_model(config, state)


@pytest.fixture(scope="module")
def tiny_expected(tiny: tuple[LlamaModel, torch.nn.Module]) -> dict[tuple[int, ...], tuple[list[int], torch.Tensor]]:
    _, reference = tiny
    return {tuple(p): hf_greedy(reference, p, NUM_NEW_TOKENS) for p in PROMPTS}


PROMPTS = prompts(seed=1, lengths=[1, 7, 16, 33, 70, 130], vocab_size=TINY_CONFIG.vocab_size)


def assert_matches(seqs: list[PagedSeq], outputs: list[list[int]], expected: dict) -> None:
    for seq, output in zip(seqs, outputs, strict=True):
        want_ids, want_logits = expected[tuple(seq.tokens[: seq.prompt_len])]
        assert output == want_ids
        torch.testing.assert_close(torch.stack(seq.logits), want_logits, atol=LOGIT_ATOL, rtol=0)


@pytest.mark.parametrize("block_size", [16, 32])
def test_each_prompt_alone_matches_transformers(tiny, tiny_expected, block_size: int) -> None:
    model, _ = tiny
    for prompt in PROMPTS:
        runner = PagedGreedy(model, block_size)
        seqs = [runner.new_seq(prompt)]
        assert_matches(seqs, runner.run(seqs, NUM_NEW_TOKENS, token_budget=4096), tiny_expected)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("token_budget", [16, 64, 512])
def test_batched_chunked_prefill_matches_transformers(tiny, tiny_expected, block_size: int, token_budget: int) -> None:
    """All prompts at once: decodes batched with prefill chunks, in shuffled order within each step."""
    model, _ = tiny
    runner = PagedGreedy(model, block_size, seed=token_budget)
    seqs = [runner.new_seq(p) for p in PROMPTS]
    outputs = runner.run(seqs, NUM_NEW_TOKENS, token_budget=token_budget, shuffle_order=block_size == 32)
    assert_matches(seqs, outputs, tiny_expected)


@pytest.mark.parametrize("block_size", [16, 32])
def test_prefix_already_cached_matches_transformers(tiny, block_size: int) -> None:
    """Later sequences reuse the first blocks of an earlier one: a multi-token chunk with start_pos > 0."""
    model, reference = tiny
    base = prompts(seed=2, lengths=[100], vocab_size=TINY_CONFIG.vocab_size)[0]
    runner = PagedGreedy(model, block_size)
    first = runner.new_seq(base)
    runner.run([first], 4, token_budget=4096)
    tails = prompts(seed=3, lengths=[5, 40, 1], vocab_size=TINY_CONFIG.vocab_size)
    hits = [runner.new_seq(base[:64] + tails[0], first, 64 // block_size)]
    hits.append(runner.new_seq(base[:96] + tails[1], first, 96 // block_size))
    hits.append(runner.new_seq(base[:64] + tails[2], first, 64 // block_size))  # one token: a decode-shaped hit
    outputs = runner.run(hits, NUM_NEW_TOKENS, token_budget=24)
    expected = {tuple(s.tokens[: s.prompt_len]): hf_greedy(reference, s.tokens[: s.prompt_len], 32) for s in hits}
    assert_matches(hits, outputs, expected)


VARIANTS = {
    "llama3_rope": dataclasses.replace(
        TINY_CONFIG,
        rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=64),
    ),
    "linear_rope": dataclasses.replace(TINY_CONFIG, rope_scaling=RopeScaling("linear", factor=4.0)),
    "untied_head": dataclasses.replace(TINY_CONFIG, tie_word_embeddings=False),
    "qwen2_bias": dataclasses.replace(TINY_CONFIG, attention_bias=True, rope_theta=1000000.0),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_config_variants_match_transformers(variant: str) -> None:
    config, state = create_tiny_random_model(seed=5, config=VARIANTS[variant])
    model = LlamaModel.from_hf_state_dict(config, state, torch.float32)
    reference = hf_model(config, state, qwen2=variant == "qwen2_bias")
    runner = PagedGreedy(model, block_size=16)
    seqs = [runner.new_seq(p) for p in prompts(seed=6, lengths=[90, 3, 20], vocab_size=config.vocab_size)]
    outputs = runner.run(seqs, 24, token_budget=48)
    expected = {tuple(s.tokens[: s.prompt_len]): hf_greedy(reference, s.tokens[: s.prompt_len], 24) for s in seqs}
    assert_matches(seqs, outputs, expected)


def test_greedy_output_depends_on_the_prompt(tiny, tiny_expected) -> None:
    """The tiny model is not degenerate: continuations differ and are not a repeated token."""
    continuations = [ids for ids, _ in tiny_expected.values()]
    assert len({tuple(c) for c in continuations}) == len(continuations)
    assert all(len(set(c)) >= 4 for c in continuations)


def test_tiny_model_is_seeded() -> None:
    _, a = create_tiny_random_model(seed=3)
    _, b = create_tiny_random_model(seed=3)
    _, c = create_tiny_random_model(seed=4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_bf16_model_agrees_with_fp32_on_greedy_prefix(tiny) -> None:
    config, state = create_tiny_random_model(seed=0)
    model16 = LlamaModel.from_hf_state_dict(config, state, torch.bfloat16)
    fp32_model, _ = tiny
    prompt = PROMPTS[3]
    reference_runner = PagedGreedy(fp32_model, 16)
    want = reference_runner.run([reference_runner.new_seq(prompt)], 8, 4096)
    runner = PagedGreedy(model16, 16)
    runner.kv_cache = runner.kv_cache.to(torch.bfloat16)
    got = runner.run([runner.new_seq(prompt)], 8, 4096)
    assert got[0][:4] == want[0][:4]  # bf16 rounding may flip a later near-tie, not the first tokens


def test_mismatched_state_dict_is_refused() -> None:
    config, state = create_tiny_random_model()
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(UnsupportedModelError, match="up_proj"):
        LlamaModel.from_hf_state_dict(config, state, torch.float32)
    _, state = create_tiny_random_model()
    state["model.layers.2.mlp.up_proj.weight"] = torch.zeros(1)
    with pytest.raises(UnsupportedModelError, match="layers.2"):
        LlamaModel.from_hf_state_dict(config, state, torch.float32)


def test_position_beyond_rope_table_is_refused(tiny) -> None:
    model, _ = tiny
    meta = AttentionMetadata.build([SequenceSlice(2047, 1, list(range(128)))], 16)
    kv = torch.zeros(2, 2, 128, 16, 2, 16)
    with torch.inference_mode(), pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.tensor([5]), torch.tensor([2048]), meta, kv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_f_linear(dtype: torch.dtype) -> None:
    """The prepacked CPU bf16 path (when torch offers it) computes the same product as F.linear."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(5, 64, generator=gen).to(dtype)
    with torch.inference_mode():
        got = Linear(weight, bias)(x)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), torch.nn.functional.linear(x, weight, bias).float(), rtol=2e-2, atol=5e-2)


def test_between_layers_hook_runs_after_every_layer_and_changes_nothing(tiny) -> None:
    """The serving loop's mid-step hook (`LlamaModel.forward(between_layers=...)`): once per layer, same output."""
    model, _ = tiny
    calls: list[int] = []

    def forward(hook):  # noqa: ANN001, ANN202 - a test helper
        runner = PagedGreedy(model, 16)
        prompt = PROMPTS[3]
        meta = AttentionMetadata.build([SequenceSlice(0, len(prompt), tuple(range(3)))], 16)
        with torch.inference_mode():
            return model(torch.tensor(prompt), torch.tensor(range(len(prompt))), meta, runner.kv_cache, hook)

    plain = forward(None)
    hooked = forward(lambda: calls.append(1))
    assert len(calls) == model.config.num_layers
    torch.testing.assert_close(hooked, plain, atol=0, rtol=0)
