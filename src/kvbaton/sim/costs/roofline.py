"""Roofline cost model: a step takes max(FLOPs / achieved FLOP/s, bytes / achieved bandwidth) + overheads.

Per step, over the whole model (divided by the TP degree, each GPU holding 1/tp of it):
  FLOPs  = 2 · params_no_embed · tokens + 2 · vocab · hidden · sampled rows
           + attention 4 · layers · hidden · Σ (new · (context + new/2))      (QK^T and PV)
  bytes  = weights + KV read (Σ context over every chunk) + KV written (new tokens)
Efficiency factors turn peaks into achievable rates (prefill reaches ~60 % of peak FLOP/s,
decode ~80 % of HBM bandwidth). Tensor parallelism adds two ring all-reduces of the
activations per layer over the node's GPU link; pipeline parallelism adds pp-1 activation
hand-offs and divides the step by pp (DistServe's steady-state convention, as in linear.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbaton.sim.catalog import GpuSpec, ModelSpec
from kvbaton.sim.costs.base import BatchShape, CostModel, Parallelism
from kvbaton.sim.links import get_link


@dataclass(frozen=True, slots=True)
class Efficiency:
    flops: float = 0.6  # fraction of peak FLOP/s a large prefill reaches
    mem_bandwidth: float = 0.8  # fraction of peak bandwidth a decode reaches
    step_overhead_s: float = 1e-3  # scheduling, kernel launches, sampling per step


class RooflineCostModel(CostModel):
    def __init__(self, model: ModelSpec, gpu: GpuSpec, efficiency: Efficiency = Efficiency()) -> None:
        self.model = model
        self.gpu = gpu
        self.efficiency = efficiency
        self.name = f"roofline:{model.name}@{gpu.name}"
        self.kv_bytes_per_token = model.kv_bytes_per_token
        embed = model.vocab_size * model.hidden_size
        self._linear_params = model.num_params - embed * (1 if model.tie_word_embeddings else 2)
        self._link = get_link(gpu.intra_node_link)
        self._flops_per_token = 2 * self._linear_params
        self._flops_per_sampled_row = 2 * model.vocab_size * model.hidden_size
        self._attention_flops_per_pair = 4 * model.num_layers * model.hidden_size
        self._s_per_flop = 1.0 / (gpu.flops_per_s * efficiency.flops)
        self._s_per_byte = 1.0 / (gpu.mem_bytes_per_s * efficiency.mem_bandwidth)

    def step_s(self, shape: BatchShape, parallel: Parallelism = Parallelism()) -> float:
        num_tokens = shape.num_tokens
        if not num_tokens:
            return 0.0
        m = self.model
        num_sampled = len(shape.prefill_new_tokens) + shape.num_decodes  # upper bound: one row per chunk
        attention_pairs = shape.decode_context_tokens
        context_read = shape.decode_context_tokens
        for n, ctx in zip(shape.prefill_new_tokens, shape.prefill_context_tokens):
            attention_pairs += n * (ctx + n / 2)
            context_read += ctx
        flops = (self._flops_per_token * num_tokens + self._flops_per_sampled_row * num_sampled
                 + self._attention_flops_per_pair * attention_pairs)
        mem_bytes = m.weight_bytes + m.kv_bytes_per_token * (context_read + num_tokens)
        step_s = max(flops * self._s_per_flop, mem_bytes * self._s_per_byte) / parallel.tp
        step_s += self.efficiency.step_overhead_s
        if parallel.tp > 1 or parallel.pp > 1:
            activation_bytes = num_tokens * m.hidden_size * m.dtype_bytes
            if parallel.tp > 1:
                ring_bytes = 2 * (parallel.tp - 1) / parallel.tp * activation_bytes
                step_s += 2 * m.num_layers * self._link.transfer_s(int(ring_bytes))
            if parallel.pp > 1:
                step_s += (parallel.pp - 1) * self._link.transfer_s(activation_bytes)
        return step_s / parallel.pp
