"""Workload statistics for `kvbaton bench --describe`: counts, mean lengths and measured prefix sharing.

Sharing is measured at the token level, the way a prefix cache with unlimited capacity would see
it: a request's shared tokens are the longest common prefix between its prompt and the prompt
of any *earlier* request of the same tenant (tenants never share cached KV). The workload's
sharing ratio is the sum of shared tokens over the sum of prompt tokens, so the first request
of every prefix counts as a miss — the paper figures (Preble: 85–97 %) are comparable.

The index is a tree of 128-token chunks (bytes of the int32 ids) with, at each node, its child
chunks listed by first token: a full-chunk match descends; the divergent chunk's longest
common prefix with any sibling gives the exact token-level remainder.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvbaton.bench.workloads.base import WorkloadRequest
from kvbaton.core.errors import InvalidRequestError

_CHUNK_TOKENS = 128  # any size gives the same exact answer; larger walks faster
_TOKEN_BYTES = 4  # int32


@dataclass(frozen=True, slots=True)
class WorkloadStats:
    num_requests: int
    mean_prompt_tokens: float
    mean_output_tokens: float
    max_prompt_tokens: int
    total_prompt_tokens: int
    shared_prompt_tokens: int  # tokens in a common prefix with an earlier request (same tenant)
    sharing_ratio: float  # shared_prompt_tokens / total_prompt_tokens
    duration_s: float  # last arrival minus first arrival
    mean_rate_rps: float  # (num_requests - 1) / duration_s; 0 when undefined
    num_groups: int  # distinct `group` labels
    requests_per_class: dict[str, int] = field(default_factory=dict)


class PrefixSharingIndex:
    """Incremental exact longest-common-prefix against all prompts inserted so far."""

    def __init__(self) -> None:
        self._children: dict[tuple[int, bytes], int] = {}  # (node, chunk bytes) -> child node
        # (node, first token) -> the child chunks starting with it, each padded to a full chunk
        # with -1, concatenated; compared in one vectorised step (a hot node can have thousands).
        self._by_first: dict[tuple[int, int], bytearray] = {}
        self._roots: dict[str, int] = {}
        self._num_nodes = 0

    def _new_node(self) -> int:
        self._num_nodes += 1
        return self._num_nodes

    def _partial_match(self, node: int, chunk: np.ndarray) -> int:
        rows_buf = self._by_first.get((node, int(chunk[0])))
        if rows_buf is None:
            return 0
        rows = np.frombuffer(rows_buf, dtype=np.int32).reshape(-1, _CHUNK_TOKENS)
        # Pad the query with -2 so padding never matches padding (-1) or a real id.
        query = np.full(_CHUNK_TOKENS, -2, dtype=np.int32)
        query[:len(chunk)] = chunk
        equal = rows == query
        lcps = np.where(equal.all(axis=1), _CHUNK_TOKENS, equal.argmin(axis=1))
        return int(lcps.max())

    def _add_child(self, node: int, chunk: np.ndarray, chunk_bytes: bytes) -> int:
        child = self._new_node()
        self._children[(node, chunk_bytes)] = child
        if len(chunk) < _CHUNK_TOKENS:
            padded = np.full(_CHUNK_TOKENS, -1, dtype=np.int32)
            padded[:len(chunk)] = chunk
            chunk_bytes = padded.tobytes()
        self._by_first.setdefault((node, int(chunk[0])), bytearray()).extend(chunk_bytes)
        return child

    def insert(self, prompt: np.ndarray, tenant: str = "") -> int:
        """Adds one prompt; returns its longest common prefix (tokens) with any earlier prompt."""
        tokens = np.ascontiguousarray(prompt, dtype=np.int32)
        data = tokens.tobytes()
        node = self._roots.get(tenant)
        if node is None:
            node = self._roots[tenant] = self._new_node()
        shared, matching = 0, True
        for start in range(0, len(tokens), _CHUNK_TOKENS):
            chunk_bytes = data[start * _TOKEN_BYTES:(start + _CHUNK_TOKENS) * _TOKEN_BYTES]
            child = self._children.get((node, chunk_bytes))
            if child is None:
                chunk = tokens[start:start + _CHUNK_TOKENS]
                if matching:
                    shared += self._partial_match(node, chunk)
                    matching = False
                child = self._add_child(node, chunk, chunk_bytes)
            elif matching:
                shared += len(chunk_bytes) // _TOKEN_BYTES
            node = child
        return shared


def measure_sharing(requests: Sequence[WorkloadRequest]) -> tuple[int, int]:
    """(shared prompt tokens, total prompt tokens), requests taken in arrival order."""
    index = PrefixSharingIndex()
    shared = total = 0
    for request in sorted(requests, key=lambda r: (r.arrival_s, r.index)):
        prompt = request.prompt_array
        shared += index.insert(prompt, request.tenant)
        total += len(prompt)
    return shared, total


def describe_workload(requests: Sequence[WorkloadRequest]) -> WorkloadStats:
    if not requests:
        raise InvalidRequestError("cannot describe an empty workload")
    shared, total = measure_sharing(requests)
    arrivals = [r.arrival_s for r in requests]
    duration_s = max(arrivals) - min(arrivals)
    return WorkloadStats(
        num_requests=len(requests),
        mean_prompt_tokens=total / len(requests),
        mean_output_tokens=statistics.fmean(r.output_tokens for r in requests),
        max_prompt_tokens=max(r.num_prompt_tokens for r in requests),
        total_prompt_tokens=total,
        shared_prompt_tokens=shared,
        sharing_ratio=shared / total if total else 0.0,
        duration_s=duration_s,
        mean_rate_rps=(len(requests) - 1) / duration_s if duration_s > 0 else 0.0,
        num_groups=len({r.group for r in requests}),
        requests_per_class=dict(sorted(Counter(r.slo_class for r in requests).items())),
    )
