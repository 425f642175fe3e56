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

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from kvbaton.core.step import StepPlan
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
        cap = f" cap {gpu.power_cap:g}" if gpu.power_cap < 1 else ""
        self.name = f"roofline:{model.name}@{gpu.name}{cap}"
        self.gpu_name = gpu.name
        self.model_name = model.name
        self.kv_bytes_per_token = model.kv_bytes_per_token
        embed = model.vocab_size * model.hidden_size
        self._linear_params = model.num_params - embed * (1 if model.tie_word_embeddings else 2)
        self._link = get_link(gpu.intra_node_link)
        self._flops_per_token = 2 * self._linear_params
        self._flops_per_sampled_row = 2 * model.vocab_size * model.hidden_size
        self._attention_flops_per_pair = 4 * model.num_layers * model.hidden_size
        self._s_per_flop = 1.0 / (gpu.flops_per_s * efficiency.flops)
        self._s_per_byte = 1.0 / (gpu.mem_bytes_per_s * efficiency.mem_bandwidth)
        # The simulator prices every step of every worker: the catalog's derived figures (properties
        # that recount the parameters) are read once here, not per step.
        self._weight_bytes = model.weight_bytes
        self._activation_bytes_per_token = model.hidden_size * model.dtype_bytes
        self._step_overhead_s = efficiency.step_overhead_s
        # FLOPs per decoded sequence (its token and its sampled row) for `decode_s`: the catalog's figures are
        # ints, so the grouped sum is the same exact number as the two products added; None keeps the two
        # products for non-integer figures, where grouping could round differently.
        per_seq = (self._flops_per_token, self._flops_per_sampled_row)
        self._flops_per_seq = sum(per_seq) if all(type(x) is int for x in per_seq) else None
        # decode_s on one GPU with those integer figures, as a closure over the constants: decode_s calls it and
        # `decode_pricer` hands it out (the simulator prices every steady decode step with it).
        self._one_gpu_decode_s = self._one_gpu_decode_pricer() if self._flops_per_seq is not None else None

    def step_s(self, shape: BatchShape, parallel: Parallelism = Parallelism()) -> float:
        prefill_new_tokens = shape.prefill_new_tokens
        num_decodes = shape.num_decodes
        num_tokens = sum(prefill_new_tokens) + num_decodes if prefill_new_tokens else num_decodes
        if not num_tokens:
            return 0.0
        # an int while only decodes add to it: integer figures stay exact until the one rounding in _price
        attention_pairs: int | float = shape.decode_context_tokens
        context_read = shape.decode_context_tokens
        for n, ctx in zip(prefill_new_tokens, shape.prefill_context_tokens):
            attention_pairs += n * (ctx + n / 2)
            context_read += ctx
        # upper bound on sampled rows: one per chunk
        return self._price(num_tokens, len(prefill_new_tokens) + num_decodes, attention_pairs, context_read, parallel)

    def plan_s(self, plan: StepPlan, parallel: Parallelism = Parallelism()) -> float:
        """`step_s(BatchShape.of_plan(plan))` without building the shape: same sums in the same order."""
        num_tokens = num_chunks = decode_ctx = 0
        prefill_pairs: list[float] = []
        prefill_ctx = 0
        for chunk in plan.chunks:
            start_pos = chunk.start_pos
            n = len(chunk.token_ids)
            num_tokens += n
            num_chunks += 1
            if n == 1 and start_pos > 0 and chunk.samples:  # a decode (BatchShape.of_plan's rule)
                decode_ctx += start_pos + 1
            else:
                prefill_pairs.append(n * (start_pos + n / 2))
                prefill_ctx += start_pos
        if not num_tokens:
            return 0.0
        attention_pairs: int | float = decode_ctx  # as in step_s
        for pairs in prefill_pairs:  # added after the decodes' sum, in chunk order, as step_s does
            attention_pairs += pairs
        return self._price(num_tokens, num_chunks, attention_pairs, decode_ctx + prefill_ctx, parallel)

    def decode_s(self, num_seqs: int, context_tokens: int, parallel: Parallelism = Parallelism()) -> float:
        """The base class's decode_s (step_s of an all-decode shape) without building the shape."""
        if num_seqs <= 0:
            return 0.0
        if parallel.tp > 1 or parallel.pp > 1:
            return self._price(num_seqs, num_seqs, context_tokens, context_tokens, parallel)
        # _price's first lines for one GPU, the same floats (`test_roofline_decode_s_is_price` holds the two
        # equal): the FLOPs are an exact int either way, and the divisions by tp = pp = 1 are exact, so they are
        # left out.
        one_gpu_decode_s = self._one_gpu_decode_s
        if one_gpu_decode_s is not None:
            return one_gpu_decode_s(num_seqs, context_tokens)
        flops = (self._flops_per_token * num_seqs + self._flops_per_sampled_row * num_seqs
                 + self._attention_flops_per_pair * context_tokens)
        mem_bytes = self._weight_bytes + self.kv_bytes_per_token * (context_tokens + num_seqs)
        compute_s = flops * self._s_per_flop
        memory_s = mem_bytes * self._s_per_byte
        return (compute_s if compute_s >= memory_s else memory_s) + self._step_overhead_s

    def decode_pricer(self, parallel: Parallelism = Parallelism()) -> Callable[[int, int], float]:
        """`decode_s` bound to `parallel`: on one GPU with integer FLOP figures, the closure decode_s itself calls
        (`test_roofline_decode_pricer`)."""
        if parallel.tp > 1 or parallel.pp > 1 or self._one_gpu_decode_s is None:
            return partial(self.decode_s, parallel=parallel)
        return self._one_gpu_decode_s

    def _one_gpu_decode_pricer(self) -> Callable[[int, int], float]:
        """decode_s's arithmetic for one GPU and integer per-sequence FLOPs, bound to this model's constants."""
        flops_per_seq = self._flops_per_seq
        assert flops_per_seq is not None, "only built for integer per-sequence FLOPs"
        attention_flops_per_pair = self._attention_flops_per_pair
        weight_bytes, kv_bytes_per_token = self._weight_bytes, self.kv_bytes_per_token
        s_per_flop, s_per_byte, step_overhead_s = self._s_per_flop, self._s_per_byte, self._step_overhead_s

        def decode_s(num_seqs: int, context_tokens: int) -> float:
            if num_seqs <= 0:
                return 0.0
            compute_s = (flops_per_seq * num_seqs + attention_flops_per_pair * context_tokens) * s_per_flop
            memory_s = (weight_bytes + kv_bytes_per_token * (context_tokens + num_seqs)) * s_per_byte
            return (compute_s if compute_s >= memory_s else memory_s) + step_overhead_s

        return decode_s

    def _price(self, num_tokens: int, num_sampled: int, attention_pairs: int | float, context_read: int,
               parallel: Parallelism) -> float:
        flops = (self._flops_per_token * num_tokens + self._flops_per_sampled_row * num_sampled
                 + self._attention_flops_per_pair * attention_pairs)
        mem_bytes = self._weight_bytes + self.kv_bytes_per_token * (context_read + num_tokens)
        tp, pp = parallel.tp, parallel.pp
        step_s = max(flops * self._s_per_flop, mem_bytes * self._s_per_byte) / tp
        step_s += self._step_overhead_s
        if tp > 1 or pp > 1:
            activation_bytes = num_tokens * self._activation_bytes_per_token
            if tp > 1:
                ring_bytes = 2 * (tp - 1) / tp * activation_bytes
                step_s += 2 * self.model.num_layers * self._link.transfer_s(int(ring_bytes))
            if pp > 1:
                step_s += (pp - 1) * self._link.transfer_s(activation_bytes)
        return step_s / pp
