"""`RequestRecord`: what happened to one request — the single input of every kvbaton metric.

The live bench driver, the engine, the simulator and the planner all emit these; `summarize`
(metrics.py) turns them into figures, so a TTFT means the same thing everywhere. All times are
absolute seconds on the clock of whoever ran the requests (wall clock since the run started for
the live driver, simulated time for the simulator); only differences are ever reported.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from operator import lt
from pathlib import Path
from typing import Any

from kvbaton.core.errors import InvalidRequestError

STATUSES = ("completed", "rejected", "failed")


@dataclass(frozen=True, slots=True)
class RequestRecord:
    request_id: str  # unique within a run
    arrival_s: float  # when the request reached the system (sent, for the live driver)
    status: str = "completed"  # "completed" | "rejected" (admission said no: 429/503) | "failed" (error, timeout)
    reason: str = ""  # why it was rejected or failed; empty when completed
    slo_class: str = "default"  # latency class; metrics are reported per class and overall
    tenant: str = ""  # who sent it
    prompt_tokens: int = 0  # prompt length
    cached_tokens: int | None = None  # prompt tokens served from a prefix cache; None = not reported
    output_tokens: int = 0  # tokens generated (len(token_times_s) when every token was observed)
    first_token_s: float | None = None  # when the first output token arrived; None if none did
    token_times_s: tuple[float, ...] = ()  # arrival time of every output token, in order (first = first_token_s)
    finish_s: float | None = None  # when the last byte arrived / the request ended (also for failures)
    queue_s: float | None = None  # time spent waiting before its first scheduled step; None = unknown
    worker_ids: tuple[str, ...] = ()  # workers that served it (prefill worker first when disaggregated)
    transfer_bytes: int = 0  # KV bytes moved between workers for it (0 when colocated)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise InvalidRequestError(f"record status must be one of {STATUSES}, got {self.status!r}")
        times = self.token_times_s
        if any(map(lt, times[1:], times)):  # a later token before an earlier one (pairs compared in C)
            raise InvalidRequestError(f"{self.request_id}: token_times_s must be non-decreasing")

    @property
    def completed(self) -> bool:
        return self.status == "completed"

    @property
    def ttft_s(self) -> float | None:
        """Time to first token, from arrival; None when no token was produced."""
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (last - first) / (n - 1); None with fewer than 2 tokens."""
        if len(self.token_times_s) < 2:
            return None
        return (self.token_times_s[-1] - self.token_times_s[0]) / (len(self.token_times_s) - 1)

    @property
    def itls_s(self) -> tuple[float, ...]:
        """Inter-token latencies: the gaps between consecutive output tokens."""
        times = self.token_times_s
        return tuple(b - a for a, b in zip(times, times[1:]))

    @property
    def e2e_s(self) -> float | None:
        """End-to-end latency, arrival to finish; None when the finish time is unknown."""
        return None if self.finish_s is None else self.finish_s - self.arrival_s

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["token_times_s"] = list(self.token_times_s)
        data["worker_ids"] = list(self.worker_ids)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise InvalidRequestError(f"unknown record fields: {sorted(unknown)}")
        values = dict(data)
        values["token_times_s"] = tuple(float(t) for t in values.get("token_times_s", ()))
        values["worker_ids"] = tuple(str(w) for w in values.get("worker_ids", ()))
        return cls(**values)


def write_records(path: str | Path, records: Iterable[RequestRecord]) -> None:
    """JSON Lines, one record per line, in the given order."""
    with Path(path).open("w") as f:
        for record in records:
            f.write(json.dumps(record.to_dict()) + "\n")


def read_records(path: str | Path) -> list[RequestRecord]:
    with Path(path).open() as f:
        return [RequestRecord.from_dict(json.loads(line)) for line in f if line.strip()]


def records_by_class(records: Sequence[RequestRecord]) -> dict[str, list[RequestRecord]]:
    """Records grouped by SLO class, classes in sorted order (deterministic reports)."""
    groups: dict[str, list[RequestRecord]] = {}
    for record in records:
        groups.setdefault(record.slo_class, []).append(record)
    return dict(sorted(groups.items()))
