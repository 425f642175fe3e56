"""Frozen configuration values; derived quantities are properties, never mutated after build."""

from __future__ import annotations

from dataclasses import dataclass

from kvbaton.core.errors import InvalidRequestError

QUEUE_POLICIES = ("fcfs", "lpm", "preble", "priority")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    num_blocks: int = 2048  # KV blocks in the pool
    enable_prefix_cache: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise InvalidRequestError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_blocks <= 1:
            raise InvalidRequestError(f"num_blocks must be > 1, got {self.num_blocks}")

    @property
    def num_token_slots(self) -> int:
        return self.block_size * self.num_blocks


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512  # token budget of one step (decodes + prefill chunks)
    max_num_seqs: int = 128  # running requests at most
    long_prefill_token_threshold: int = 0  # cap one request's chunk per step; 0 = the whole budget
    queue_policy: str = "fcfs"  # fcfs | lpm | preble | priority (SamplingParams.priority, as vLLM's)
    lpm_fallback_waiting: int = 128  # lpm falls back to fcfs above this many waiting requests
    # Speculative decoding by prompt lookup (scheduler/spec_decode.py): up to this many draft tokens per decode;
    # 0 turns it off. Drafts come from n-grams of min..max tokens, and only while at most spec_max_running
    # requests run: with more, the draft rows cost what they save (SmolLM2 on 2 cores: 4 free-text streams 1.03x,
    # 8 streams 0.95x; benchmarks/spec_decode.py).
    num_speculative_tokens: int = 0
    spec_ngram_min: int = 2
    spec_ngram_max: int = 4
    spec_max_running: int = 4

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens <= 0:
            raise InvalidRequestError("max_num_batched_tokens must be positive")
        if self.max_num_seqs <= 0:
            raise InvalidRequestError("max_num_seqs must be positive")
        if (self.num_speculative_tokens < 0 or not 1 <= self.spec_ngram_min <= self.spec_ngram_max
                or self.spec_max_running < 0):
            raise InvalidRequestError("num_speculative_tokens and spec_max_running must be >= 0, and "
                                      "1 <= spec_ngram_min <= spec_ngram_max")
        if self.queue_policy not in QUEUE_POLICIES:
            raise InvalidRequestError(f"queue_policy must be one of {QUEUE_POLICIES}, got {self.queue_policy!r}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "smollm2-135m"  # built-in name, .gguf path or Hugging Face directory
    dtype: str = "auto"  # "auto" picks the measured default (see kvbaton.model.registry.DEFAULT_DTYPE)
    device: str = "cpu"
    max_model_len: int = 0  # 0 = the model's context length
    seed: int = 0  # seeds the engine RNG used by requests that give no seed of their own
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    # Rank processes behind this engine's scheduler (kvbaton.engine.rank_group): heads and MLP rows split over
    # tensor_parallel_size ranks, layers over pipeline_parallel_size stages; 1 x 1 runs the model in-process.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    rank_num_threads: int = 0  # torch threads of each rank process (0: torch's default)

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise InvalidRequestError(f"tensor and pipeline parallel sizes must be >= 1, got "
                                      f"{self.tensor_parallel_size} and {self.pipeline_parallel_size}")

    @property
    def num_ranks(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size
