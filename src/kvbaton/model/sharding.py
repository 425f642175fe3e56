"""Which part of a Llama model one rank holds: Megatron tensor-parallel slices and a pipeline stage's layers.

Tensor parallelism (Megatron-LM): q/k/v are split by head and gate/up by intermediate row (column-parallel), o_proj
and down_proj by input column (row-parallel), so each rank computes a partial sum that one all-reduce completes;
a row-parallel bias is kept on rank 0 only, so the sum adds it once. Embeddings, norms and the LM head are
replicated. KV heads are never replicated: a degree that does not divide the KV heads (and so the query heads)
is refused. Pipeline parallelism gives each stage a contiguous run of layers; the first embeds, the last norms
and projects to the vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from torch import Tensor

from kvbaton.core.errors import InvalidRequestError
from kvbaton.model.config import ModelConfig


@dataclass(frozen=True, slots=True)
class ModelShard:
    """One rank's part: tensor rank `tp_rank` of `tp_size`, pipeline stage `pp_rank` of `pp_size`."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def layer_range(self, num_layers: int) -> range:
        """This stage's layers: an even split, the first `num_layers % pp_size` stages one layer longer."""
        base, extra = divmod(num_layers, self.pp_size)
        start = self.pp_rank * base + min(self.pp_rank, extra)
        return range(start, start + base + (1 if self.pp_rank < extra else 0))

    def kv_head_range(self, num_kv_heads: int) -> range:
        per_rank = num_kv_heads // self.tp_size
        return range(self.tp_rank * per_rank, (self.tp_rank + 1) * per_rank)


def parallelism_problem(config: ModelConfig, tp_size: int, pp_size: int) -> str | None:
    """Why `config` cannot run at these degrees (one line, for the user), or None."""
    if tp_size < 1 or pp_size < 1:
        return f"tensor and pipeline parallel sizes must be >= 1, got {tp_size} and {pp_size}"
    if config.num_kv_heads % tp_size:
        return (f"tensor_parallel_size={tp_size} does not divide the model's {config.num_kv_heads} KV heads "
                f"(kvbaton splits KV heads and does not replicate them): use a divisor of {config.num_kv_heads}")
    if config.num_heads % tp_size:
        return f"tensor_parallel_size={tp_size} does not divide the model's {config.num_heads} attention heads"
    if config.intermediate_size % tp_size:
        return f"tensor_parallel_size={tp_size} does not divide the MLP's {config.intermediate_size} rows"
    if pp_size > config.num_layers:
        return f"pipeline_parallel_size={pp_size} exceeds the model's {config.num_layers} layers"
    return None


def check_parallelism(config: ModelConfig, tp_size: int, pp_size: int) -> None:
    problem = parallelism_problem(config, tp_size, pp_size)
    if problem is not None:
        raise InvalidRequestError(problem)


def shard_state_dict(config: ModelConfig, state_dict: Mapping[str, Tensor], shard: ModelShard) -> dict[str, Tensor]:
    """The tensors of `shard`, Hugging Face-named, its layers renumbered from 0; the rest is not copied."""
    check_parallelism(config, shard.tp_size, shard.pp_size)
    t, n = shard.tp_rank, shard.tp_size
    head_dim = config.head_dim
    q_rows = slice(t * config.num_heads // n * head_dim, (t + 1) * config.num_heads // n * head_dim)
    kv_rows = slice(t * config.num_kv_heads // n * head_dim, (t + 1) * config.num_kv_heads // n * head_dim)
    ffn = config.intermediate_size // n
    ffn_rows = slice(t * ffn, (t + 1) * ffn)
    column_parallel = {"self_attn.q_proj": q_rows, "self_attn.k_proj": kv_rows, "self_attn.v_proj": kv_rows,
                       "mlp.gate_proj": ffn_rows, "mlp.up_proj": ffn_rows}
    row_parallel = {"self_attn.o_proj": q_rows, "mlp.down_proj": ffn_rows}
    out: dict[str, Tensor] = {}
    for local, layer in enumerate(shard.layer_range(config.num_layers)):
        prefix = f"model.layers.{layer}."
        for name, tensor in state_dict.items():
            if not name.startswith(prefix):
                continue
            part = name[len(prefix):]
            module, _, kind = part.rpartition(".")
            if module in column_parallel:
                tensor = tensor[column_parallel[module]]
            elif module in row_parallel and kind == "weight":
                tensor = tensor[:, row_parallel[module]]
            elif module in row_parallel and t != 0:
                tensor = tensor.new_zeros(tensor.shape)  # the all-reduce adds rank 0's bias once
            out[f"model.layers.{local}.{part}"] = tensor
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        if name in state_dict:
            out[name] = state_dict[name]
    return out


def shard_config(config: ModelConfig, shard: ModelShard) -> ModelConfig:
    """The shapes one rank's modules have: its heads, its MLP rows, its layers."""
    return replace(config, num_layers=len(shard.layer_range(config.num_layers)),
                   num_heads=config.num_heads // shard.tp_size, num_kv_heads=config.num_kv_heads // shard.tp_size,
                   intermediate_size=config.intermediate_size // shard.tp_size)
