"""One simulated request in flight: what the cluster tracks of it from arrival to its record."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbaton.bench.workloads.base import WorkloadRequest
from kvbaton.cache.hashing import HashedBlocks
from kvbaton.core.request import Request


@dataclass(slots=True)
class Flight:
    workload: WorkloadRequest
    front: str  # worker id of the mixed or prefill worker
    prompt: list[int]  # wr.prompt_array as a list, converted once (the decode side copies it)
    prompt_blocks: HashedBlocks | None = None  # its blocks as hashed to route it, handed to the front scheduler
    decode: str = ""  # decode worker id when disaggregated
    whole: bool = False  # adaptive pools: `front`, lent to mixed duty, serves it start to end (no handoff)
    prefill_request: Request | None = None  # waiting for its reservation to be granted
    attempts: int = 0  # refused reservations so far
    token_times_s: list[float] = field(default_factory=list)
    first_token_id: int = 0
    cached_tokens: int | None = None
    queue_s: float | None = None
    transfer_bytes: int = 0
    at_decode: bool = False  # its KV reached the decode worker
    reserving: bool = False  # its reservation was asked for (granted or not)
