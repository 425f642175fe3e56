"""Named GPUs and model architectures the simulator can price (the `--gpu` and `--model` CLI names).

Figures are public datasheet values (dense 16-bit tensor FLOPs, HBM bandwidth, memory, the
GPU-to-GPU link inside a node, the PCIe generation of the link to host memory, the board power (TDP) of
the SXM/PCIe part named) and the architectures of the published checkpoints. Each GPU also carries a
default price per GPU-hour: public on-demand list prices, see `kvbaton.sim.hardware` for the sources and
for a file that overrides them, and for how a power cap scales a GPU. The sim layer cannot import `kvbaton.model`, so
architectures are restated here as plain values.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbaton.core.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    flops_per_s: float  # dense bf16/fp16 tensor-core peak
    mem_bytes_per_s: float  # HBM/GDDR bandwidth
    mem_bytes: int  # device memory
    intra_node_link: str  # link preset between GPUs of one node (kvbaton.sim.links)
    host_link: str  # link preset between one GPU and host memory (the KV store's loads: `run.store_settings`)
    tdp_w: float = 0.0  # board power at full load (watts)
    price_per_hour: float = 0.0  # USD per GPU-hour, default table (kvbaton.sim.hardware.DEFAULT_PRICE_SOURCES)
    # Fraction of TDP the GPU is held to (kvbaton.sim.hardware.capped): flops_per_s and mem_bytes_per_s above are
    # already the capped ones. 1.0: uncapped.
    power_cap: float = 1.0

    @property
    def power_w(self) -> float:
        """The power provisioned for it: TDP under its cap."""
        return self.tdp_w * self.power_cap


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    max_context_tokens: int
    gated_mlp: bool = True  # Llama/Mistral/Qwen SwiGLU (3 matrices); OPT has 2
    tie_word_embeddings: bool = False
    dtype_bytes: int = 2  # fp16 / bf16 weights and KV

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_params(self) -> int:
        h, kv_dim = self.hidden_size, self.num_kv_heads * self.head_dim
        attention = 2 * h * h + 2 * h * kv_dim  # q, o: h x h; k, v: h x kv_dim
        mlp = (3 if self.gated_mlp else 2) * h * self.intermediate_size
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attention + mlp) + embeddings

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """2 (K and V) x layers x KV heads x head dim x bytes (seed 000 section 2)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


GPUS: dict[str, GpuSpec] = {g.name: g for g in (
    GpuSpec("a100", 312e12, 2.039e12, 80 * 2**30, "nvlink-a100", "host-pcie4", 400.0, 2.21),
    GpuSpec("a100-40gb", 312e12, 1.555e12, 40 * 2**30, "nvlink-a100", "host-pcie4", 400.0, 2.06),
    GpuSpec("h100", 989e12, 3.35e12, 80 * 2**30, "nvlink", "host-pcie5", 700.0, 4.76),
    GpuSpec("h200", 989e12, 4.8e12, 141 * 2**30, "nvlink", "host-pcie5", 700.0, 6.31),
    GpuSpec("l40s", 362e12, 0.864e12, 48 * 2**30, "pcie", "host-pcie4", 350.0, 2.25),
    GpuSpec("a6000", 155e12, 0.768e12, 48 * 2**30, "pcie", "host-pcie4", 300.0, 1.28),
)}

MODELS: dict[str, ModelSpec] = {m.name: m for m in (
    ModelSpec("llama-2-7b", 32, 4096, 11008, 32, 32, 32000, 4096),
    ModelSpec("llama-2-13b", 40, 5120, 13824, 40, 40, 32000, 4096),
    ModelSpec("llama-2-70b", 80, 8192, 28672, 64, 8, 32000, 4096),
    ModelSpec("llama-3-8b", 32, 4096, 14336, 32, 8, 128256, 8192),
    ModelSpec("llama-3-70b", 80, 8192, 28672, 64, 8, 128256, 8192),
    ModelSpec("mistral-7b", 32, 4096, 14336, 32, 8, 32000, 32768),
    ModelSpec("opt-13b", 40, 5120, 20480, 40, 40, 50272, 2048, gated_mlp=False, tie_word_embeddings=True),
    ModelSpec("opt-66b", 64, 9216, 36864, 72, 72, 50272, 2048, gated_mlp=False, tie_word_embeddings=True),
    ModelSpec("opt-175b", 96, 12288, 49152, 96, 96, 50272, 2048, gated_mlp=False, tie_word_embeddings=True),
    ModelSpec("qwen2-7b", 28, 3584, 18944, 28, 4, 152064, 32768),
    ModelSpec("smollm2-135m", 30, 576, 1536, 9, 3, 49152, 8192, tie_word_embeddings=True),
)}


def get_gpu(name: str) -> GpuSpec:
    gpu = GPUS.get(name)
    if gpu is None:
        raise InvalidRequestError(f"unknown GPU {name!r}; choose from {', '.join(GPUS)}")
    return gpu


def get_model(name: str) -> ModelSpec:
    model = MODELS.get(name)
    if model is None:
        raise InvalidRequestError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    return model
