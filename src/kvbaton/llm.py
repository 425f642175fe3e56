"""Offline Python API: `LLM(model=...).generate(prompts, SamplingParams)` over one in-process engine."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvbaton.core.config import CacheConfig, EngineConfig, SchedulerConfig
from kvbaton.core.errors import InvalidRequestError, KvbatonError
from kvbaton.core.request import FinishReason
from kvbaton.core.sampling import SamplingParams
from kvbaton.core.step import SampledToken
from kvbaton.engine.engine import Engine
from kvbaton.model.registry import kv_block_bytes, read_model_header, resolve_model_source
from kvbaton.server.store_client import LocalStoreNode


@dataclass(slots=True)
class CompletionOutput:
    index: int  # sample index in [0, n)
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[SampledToken] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str = ""
    first_token_at: float | None = None
    finished_at: float | None = None


@dataclass(slots=True)
class GenerateResult:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int  # prefix-cache hit of the first sample
    arrival_at: float
    # With SamplingParams.prompt_logprobs: None for the first prompt token (nothing precedes it), then each
    # prompt token's logprob given those before it, as vLLM's RequestOutput.prompt_logprobs.
    prompt_logprobs: list[SampledToken | None] | None = None

    @property
    def ttft_s(self) -> float:
        first = self.outputs[0].first_token_at
        return (first - self.arrival_at) if first is not None else float("nan")

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first, of the first sample (0 with a single token)."""
        out = self.outputs[0]
        if out.first_token_at is None or out.finished_at is None or len(out.token_ids) < 2:
            return 0.0
        return (out.finished_at - out.first_token_at) / (len(out.token_ids) - 1)


class LLM:
    def __init__(self, model: str = "smollm2-135m", *, dtype: str = "auto", block_size: int = 16,
                 num_blocks: int = 2048, enable_prefix_cache: bool = True, max_num_batched_tokens: int = 512,
                 max_num_seqs: int = 128, queue_policy: str = "fcfs", max_model_len: int = 0, seed: int = 0,
                 num_speculative_tokens: int = 0, kv_store_gb: float = 0.0, kv_store_disk: str = "",
                 device: str = "cpu", tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                 rank_num_threads: int = 0) -> None:
        """`device`: cpu, cuda or cuda:N (`kvbaton.model.device`), where the weights, the KV pool and the forward
        live. `tensor_parallel_size` / `pipeline_parallel_size` (vLLM's names): run the model in that many rank
        processes (`kvbaton.engine.rank_group`); `close()` (or leaving a `with` block) stops them.
        `kv_store_gb`: a KV store node of that much DRAM on a thread of this process (`kvbaton serve`'s, private to
        this engine), past the KV pool: new full blocks are written through to it and a prefix the pool evicted is
        loaded back from it instead of prefilled, both off the step's path; `kv_store_disk` ("DIR:GB") adds its
        disk tier. `close()` stops it."""
        config = EngineConfig(
            model=model, dtype=dtype, device=device, max_model_len=max_model_len, seed=seed,
            tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
            rank_num_threads=rank_num_threads,
            cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_cache=enable_prefix_cache),
            scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                      queue_policy=queue_policy, num_speculative_tokens=num_speculative_tokens),
        )
        self.store_node: LocalStoreNode | None = None
        if kv_store_gb < 0 or (kv_store_disk and not kv_store_gb):
            raise InvalidRequestError(f"kv_store_gb must be >= 0, and kv_store_disk needs it (got {kv_store_gb:g})")
        if kv_store_gb:
            model_config, _ = read_model_header(resolve_model_source(model))
            self.store_node = LocalStoreNode(kv_block_bytes(model_config, dtype, block_size), block_size,
                                             model_config.num_layers * 2, kv_store_gb, kv_store_disk)
        try:
            self.engine = Engine(config, create_store_link=self.store_node.link if self.store_node else None)
        except BaseException:
            if self.store_node is not None:
                self.store_node.stop()
            raise

    def close(self) -> None:
        """Stop the engine's rank processes and its store node, if it has any; idempotent."""
        self.engine.close()
        if self.store_node is not None:
            self.store_node.stop()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def reset_prefix_cache(self, clear_store: bool = True) -> int:
        """Forget every cached prefix, the KV pool's and (`clear_store`) the store node's, as vLLM's
        LLM.reset_prefix_cache; returns the device blocks freed. Raises StoreUnavailable when the store node does
        not answer in 10 s."""
        return self.engine.reset_prefix_cache(clear_store=clear_store, store_wait_s=10.0)

    @property
    def tokenizer(self):  # noqa: ANN201 - kvbaton.model.tokenizer.Tokenizer
        return self.engine.tokenizer

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 sampling_params: SamplingParams | None = None) -> list[GenerateResult]:
        """Runs all prompts to completion, batched together; results in prompt order.

        A prompt is text (tokenized without a chat template) or a list of token ids.
        """
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        results: list[GenerateResult] = []
        owner: dict[str, tuple[GenerateResult, CompletionOutput]] = {}
        try:
            for prompt in prompts:
                now = time.monotonic()
                ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                result = GenerateResult(ids, [CompletionOutput(i) for i in range(params.n)], 0, now)
                results.append(result)
                for out in result.outputs:
                    rid = self.engine.add_request(ids, params.for_sample(out.index), arrival_at=now)
                    owner[rid] = (result, out)
            while self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    result, out = owner[delta.request_id]
                    now = time.monotonic()
                    if delta.new_token_ids and out.first_token_at is None:
                        out.first_token_at = now
                        if out.index == 0:
                            result.num_cached_tokens = delta.num_cached_tokens
                            if params.prompt_logprobs is not None:
                                result.prompt_logprobs = [None, *delta.prompt_logprobs]
                    out.token_ids.extend(delta.new_token_ids)
                    out.logprobs.extend(delta.logprobs)
                    out.text += delta.new_text
                    if delta.finished:
                        reason = None if delta.finish_reason is None else FinishReason(delta.finish_reason)
                        out.finish_reason, out.error, out.finished_at = reason, delta.error, now
        except (KvbatonError, KeyboardInterrupt):
            for rid in owner:
                self.engine.abort_request(rid)
            while self.engine.has_unfinished_requests():
                self.engine.step()
            raise
        return results
