"""The `CostModel` seam: how long one batch step, one prefill or one KV transfer takes.

A step is described by its `BatchShape` (what the scheduler's `StepPlan` asks the GPU to do,
stripped of ids); every model answers in seconds. Prefill cost depends on the new tokens and on
the context already in KV (prefix-cache hits and earlier chunks), decode cost on the batch size
and the total context it attends over. Models are pure values: no clock, no RNG.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from kvbaton.core.errors import InvalidRequestError
from kvbaton.core.step import StepPlan


@dataclass(frozen=True, slots=True)
class BatchShape:
    prefill_new_tokens: tuple[int, ...] = ()  # per prefill chunk: tokens computed this step
    prefill_context_tokens: tuple[int, ...] = ()  # per prefill chunk: tokens already in KV before it
    num_decodes: int = 0  # one-token chunks (decoding requests)
    decode_context_tokens: int = 0  # sum over decodes of the context each attends to (position + 1)

    @staticmethod
    def of_plan(plan: StepPlan) -> BatchShape:
        new: list[int] = []
        ctx: list[int] = []
        num_decodes = decode_ctx = 0
        for chunk in plan.chunks:  # the simulator's hot path: every step of every worker
            start_pos = chunk.start_pos
            if len(chunk.token_ids) == 1 and start_pos > 0 and chunk.samples:
                num_decodes += 1
                decode_ctx += start_pos + 1
            else:
                new.append(len(chunk.token_ids))
                ctx.append(start_pos)
        if not new:
            return BatchShape((), (), num_decodes, decode_ctx)
        return BatchShape(tuple(new), tuple(ctx), num_decodes, decode_ctx)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.prefill_new_tokens)

    @property
    def num_tokens(self) -> int:
        return sum(self.prefill_new_tokens) + self.num_decodes


@dataclass(frozen=True, slots=True)
class Parallelism:
    """How one worker (model replica) is split over GPUs."""

    tp: int = 1  # tensor-parallel degree: every layer split over tp GPUs, two all-reduces per layer
    pp: int = 1  # pipeline-parallel degree: layers split over pp stages in sequence

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise InvalidRequestError(f"tp and pp must be >= 1, got tp={self.tp} pp={self.pp}")

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp


class CostModel(ABC):
    """Predicts execution times in seconds; the simulator takes them as ground truth."""

    name: str = "cost-model"
    kv_bytes_per_token: int = 0  # bytes of K and V for one token over all layers (0: transfers are free)
    # Spread of measured step times around the model (std of log(measured / predicted)); the simulator draws
    # each step's time around the prediction with it, from a seeded generator. 0: exact, deterministic steps.
    step_noise_sigma: float = 0.0
    # Lag-1 correlation of consecutive steps' log(measured / predicted) on one worker: a slow step is followed
    # by slow steps (host contention lasts longer than a step). The simulator's draws follow it (AR(1)).
    step_noise_rho: float = 0.0
    # The catalog GPU whose steps it prices: the simulator sizes each worker's KV pool from that GPU's memory.
    # None: a host the catalog does not describe (a CPU profile), whose pool is sized like the live engine's.
    gpu_name: str | None = None
    # The model whose steps it prices: with `kv_bytes_per_token`, the KV layout identity two workers must share to
    # hand KV from one to the other (`kvbaton.sim.handoff.layout_identity`). "": one unnamed model.
    model_name: str = ""

    @abstractmethod
    def step_s(self, shape: BatchShape, parallel: Parallelism = Parallelism()) -> float:
        """Time of one engine step running `shape` (prefill chunks and decodes in one batch)."""

    def plan_s(self, plan: StepPlan, parallel: Parallelism = Parallelism()) -> float:
        """Time of the step `plan` asks for: exactly `step_s(BatchShape.of_plan(plan), parallel)`.

        The simulator calls this for every step; a model may override it to skip building the shape.
        """
        return self.step_s(BatchShape.of_plan(plan), parallel)

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0, parallel: Parallelism = Parallelism()) -> float:
        """One request's prefill alone: `new_tokens` on top of `cached_tokens` already in KV."""
        if new_tokens <= 0:
            return 0.0
        return self.step_s(BatchShape((new_tokens,), (cached_tokens,)), parallel)

    def decode_s(self, num_seqs: int, context_tokens: int, parallel: Parallelism = Parallelism()) -> float:
        """One decode step of `num_seqs` requests attending over `context_tokens` in total."""
        if num_seqs <= 0:
            return 0.0
        return self.step_s(BatchShape(num_decodes=num_seqs, decode_context_tokens=context_tokens), parallel)

    def decode_pricer(self, parallel: Parallelism = Parallelism()) -> Callable[[int, int], float]:
        """`decode_s` with `parallel` bound: (num_seqs, context_tokens) -> the same seconds. The simulator prices
        every steady decode step of a worker through one; a model may return a cheaper closure."""
        return partial(self.decode_s, parallel=parallel)

    def kv_bytes(self, num_tokens: int) -> int:
        return num_tokens * self.kv_bytes_per_token


class ConstantCostModel(CostModel):
    """Every non-empty step takes `step_s_each` seconds (0: the zero-cost model of the parity test)."""

    name = "constant"

    def __init__(self, step_s_each: float = 0.0, kv_bytes_per_token: int = 0) -> None:
        if step_s_each < 0:
            raise InvalidRequestError(f"step time must be >= 0, got {step_s_each}")
        self.step_s_each = step_s_each
        self.kv_bytes_per_token = kv_bytes_per_token

    def step_s(self, shape: BatchShape, parallel: Parallelism = Parallelism()) -> float:
        return self.step_s_each if shape.num_tokens else 0.0
