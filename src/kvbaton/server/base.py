"""The seam between the HTTP API layer and the cluster that runs requests.

The API layer validates, applies the chat template, tokenizes once at ingress and hands the
cluster one `GenerateCall` per sample; the cluster streams `TokenDelta`s back until one has
`finished=True`. Every call ends, in bounded time, with exactly one finished delta (completed,
aborted, or failed with a reason) — the API layer relies on it. A cluster may also take calls with a
callback (`SubmittingClusterClient.submit`): no stream, no task per call; the API layer prefers it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kvbaton.core.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class GenerateCall:
    request_id: str  # internal id, unique per sample ("<api id>-<sample index>")
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams  # n is already expanded: each call is one sample
    arrival_at: float  # router clock (time.monotonic) when the HTTP request arrived
    tenant: str = ""  # prefix-cache namespace; from the `user` field or an x-tenant header
    slo_class: str = "default"


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()
    rank: int = 0  # token_id's 1-based rank in its distribution, for prompt logprobs; 0 when not computed


@dataclass(frozen=True, slots=True)
class TokenDelta:
    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finished: bool
    # "stop" | "length" | "abort" | "error" on the finished delta; "rejected" (before any token) when admission's
    # decode-stage gate refused a call the cluster had taken: the API answers 429 as for a refusal at arrival.
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit (usage.prompt_tokens_details.cached_tokens)
    logprobs: tuple[TokenLogprob, ...] = ()  # one per new token when requested
    error: str = ""  # reason when finish_reason == "error"
    worker_id: str = ""
    extra: dict[str, float] = field(default_factory=dict)  # e.g. transfer bytes/time in disaggregated mode
    # With SamplingParams.prompt_logprobs, on the delta of the first token: prompt tokens 1.. given those before.
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


class RejectedError(Exception):
    """The cluster refuses the call before running it (HTTP 429/503 with Retry-After)."""

    def __init__(self, message: str, status_code: int = 429, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.retry_after_s = retry_after_s


class ClusterClient(Protocol):
    def generate(self, call: GenerateCall) -> AsyncIterator[TokenDelta]:
        """Streams deltas for one call; raises RejectedError before the first delta if refused."""
        ...

    async def abort(self, request_id: str) -> None:
        """Idempotent; the stream of that call ends with a finished delta (finish_reason "abort")."""
        ...

    def is_ready(self) -> tuple[bool, str]:
        """(ready, reason): workers registered and making progress."""
        ...

    def cluster_info(self) -> dict[str, object]:
        """JSON for /cluster: workers, roles, loads, cache sizes, policy."""
        ...

    def reset_prefix_cache(self) -> list[str]:
        """Every worker drops the cached blocks no request holds (vLLM's /reset_prefix_cache); returns the
        workers asked. The reset happens on each worker soon after, not before this returns."""
        ...


DeltaSink = Callable[[TokenDelta], None]  # called on the event loop with each delta of one call, in order


@runtime_checkable
class SubmittingClusterClient(ClusterClient, Protocol):
    def submit(self, call: GenerateCall, sink: DeltaSink) -> None:
        """Starts the call now, or raises RejectedError (nothing started); `sink` then gets its deltas on the
        event loop, ending with exactly one finished one. Same calls, aborts and endings as `generate`."""
        ...
