"""The values the local scheduler hands out: one sampled token of one request, and its stats snapshot."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kvbaton.core.request import FinishReason
from kvbaton.core.step import SampledToken


class TokenOutput(NamedTuple):
    """One sampled token of one request. A NamedTuple, not a frozen dataclass: `update` builds one per
    request per step (the simulator's hot path), and a tuple subclass can be built in C (`new_output`)."""

    request_id: str
    token: SampledToken
    finish_reason: FinishReason | None  # set on the request's last token


# TokenOutput(a, b, c) runs the NamedTuple's Python-level __new__; tuple.__new__(TokenOutput, (a, b, c)) builds the
# same instance in C (the hot loop of `update` builds one per sampled token).
new_output = tuple.__new__


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_waiting: int
    num_running: int
    num_queued_prefill_tokens: int  # uncomputed tokens of waiting requests and of running ones still prefilling
    num_used_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    prefix_cache_queries_tokens: int  # tokens looked up at admissions (with a cache attached)
    prefix_cache_hits_tokens: int  # of which the cache supplied
    num_preemptions: int
    num_steps: int  # plans with at least one chunk
    # The prefix cache's tier past the device, the KV store (kvbaton.cache.tier), when there is one: blocks its node
    # holds now, and blocks this worker loaded from it and wrote to it so far.
    num_store_cached_blocks: int = 0
    num_store_loaded_blocks: int = 0
    num_store_saved_blocks: int = 0
    num_evictable_blocks: int = 0  # cached blocks no request holds: the first taken when room is needed
