"""The seam between the HTTP API layer and the cluster that runs requests.

The API layer validates, applies the chat template, tokenizes once at ingress and hands the
cluster one `GenerateCall` per sample; the cluster streams `TokenDelta`s back until one has
`finished=True`. Every call ends, in bounded time, with exactly one finished delta (completed,
aborted, or failed with a reason) — the API layer relies on it. A cluster may also take calls with a
callback (`SubmittingClusterClient.submit`): no stream, no task per call; the API layer prefers it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvbaton.core.sampling import SamplingParams
from kvbaton.core.step import TokenDelta

__all__ = ["ClusterClient", "DeltaSink", "GenerateCall", "RejectedError", "SubmittingClusterClient", "TokenDelta"]


@dataclass(frozen=True, slots=True)
class GenerateCall:
    request_id: str  # internal id, unique per sample ("<api id>-<sample index>")
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams  # n is already expanded: each call is one sample
    arrival_at: float  # router clock (time.monotonic) when the HTTP request arrived
    tenant: str = ""  # prefix-cache namespace; from the `user` field or an x-tenant header
    slo_class: str = "default"


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
