"""A request's identity and its mutable progress, as the scheduler and engine track it.

There is no prefill/decode phase flag: `num_computed_tokens` catches up with `num_tokens`
(prompt plus output so far). A request is "prefilling" while more than one token is
uncomputed and "decoding" when exactly the last sampled token is; chunked prefill and prefix
cache hits are the same mechanism.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvbaton.core.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no blocks
    RUNNING = "running"  # admitted, holds blocks, gets scheduled every step it can
    PREEMPTED = "preempted"  # blocks taken back; will recompute from its cached prefix
    FINISHED = "finished"  # terminal; see FinishReason


class FinishReason(enum.StrEnum):
    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached or context full
    ABORT = "abort"  # cancelled by the caller (disconnect, explicit abort)
    ERROR = "error"  # failed with a reason (e.g. can never fit in the KV pool)


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_at: float  # seconds, on the clock of whoever drives the engine
    tenant: str = ""  # also the prefix-cache salt: tenants never share cached KV
    slo_class: str = "default"
    eos_token_id: int | None = None
    max_model_len: int = 8192  # prompt + output may not exceed this

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in this request's blocks
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 until admitted
    block_ids: list[int] = field(default_factory=list)  # block table, in logical order
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    finish_message: str = ""  # why it failed, for FinishReason.ERROR
    num_preemptions: int = 0
    first_scheduled_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def token_slice(self, start: int, end: int) -> tuple[int, ...]:
        """all_token_ids[start:end] without building the whole sequence (a decode reads 1 token, drafts a few)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return tuple(self.prompt_token_ids[start:end])
        if start >= n:
            return tuple(self.output_token_ids[start - n:end - n])
        return tuple(self.prompt_token_ids[start:]) + tuple(self.output_token_ids[:end - n])
