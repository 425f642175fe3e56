"""What one engine step runs (`StepPlan`), what it produced (`StepResult`), and what a request gets out of it
(`TokenDelta`).

The scheduler emits a plan over metadata only; an executor (the torch model runner, or the
simulator's cost model) runs it and answers with a result. Both are plain values so the
same scheduler code drives the live engine and the simulator. A token has one type from the sampler to the
socket: the sampler's `SampledToken`, carried inside the engine's `TokenDelta`, which the worker sends as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    request_id: str
    start_pos: int  # position of token_ids[0]; equals the request's num_computed_tokens before the step
    token_ids: tuple[int, ...]  # tokens whose KV this step computes (1 for a decode)
    block_ids: tuple[int, ...]  # the request's whole block table after allocation for this step
    samples: bool  # True when the chunk reaches the request's last known token, so a token is sampled

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class StepPlan:
    step_id: int
    chunks: tuple[ScheduledChunk, ...]  # decodes first (in running order), then prefill chunks
    num_batched_tokens: int  # sum of chunk lengths, never above the token budget
    preempted_ids: tuple[str, ...] = ()  # requests sent back to waiting this step (blocks freed)
    finished_ids: tuple[str, ...] = ()  # requests that ended while scheduling (e.g. could never fit)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprob: float = 0.0  # log-probability of token_id under the (temperature-scaled) distribution
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first
    rank: int = 0  # token_id's 1-based rank in its distribution (prompt logprobs compute it); 0 when not computed


@dataclass(frozen=True, slots=True)
class StepResult:
    step_id: int
    sampled: dict[str, SampledToken] = field(default_factory=dict)  # one per chunk with samples=True
    duration_s: float = 0.0  # executor time for the batch (wall clock live, cost model simulated)
    # Speculative chunks (draft tokens after the request's known ones): the drafts the model agreed with, in
    # order; `sampled` holds the token after them (the model's own). A chunk absent here accepted none.
    accepted: dict[str, tuple[SampledToken, ...]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """What one step produced for one request: the engine's output, the worker's message to the router and the
    cluster's answer to the API layer (a delta; the final one has finished=True)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finished: bool
    # "stop" | "length" | "abort" | "error" (kvbaton.core.request.FinishReason's values) on the finished delta;
    # "rejected" (before any token) when admission's decode-stage gate refused a call the cluster had taken: the
    # API answers 429 as for a refusal at arrival.
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit (usage.prompt_tokens_details.cached_tokens)
    logprobs: tuple[SampledToken, ...] = ()  # one per new token, only when the request asks for logprobs
    error: str = ""  # reason when finish_reason == "error"
    worker_id: str = ""
    # e.g. "queue_s" (arrival to first scheduled, on the first token's delta), transfer bytes/time when disaggregated
    extra: dict[str, float] = field(default_factory=dict)
    # With SamplingParams.prompt_logprobs, on the delta of the first token: prompt tokens 1.. given those before.
    prompt_logprobs: tuple[SampledToken, ...] = ()
