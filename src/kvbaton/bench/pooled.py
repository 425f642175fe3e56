"""The pooled bound: the prefix-hit ratio of ONE LRU cache holding a given memory, so a report can say achieved / pooled.

Every request, in arrival order and with no timing, looks up the leading blocks of its prompt in a single
block-granular LRU cache of `capacity_blocks` blocks (chained block hashes, so a block matches only after
the same prefix), counts the leading run it finds as hit tokens, then caches all its full blocks. A hit
counts at most `(num_prompt_tokens - 1) // block_size` blocks, as a worker's prefix cache does (the last
prompt token is always computed, so the step samples). Blocks of one prompt are touched deepest first, so a
prefix's head outlives its tail and eviction trims prompts from the end, as a radix cache's leaf eviction
does. The figure is hit tokens over prompt tokens, the same ratio the simulator and the bench report.

`pooled_lru_hit_ratio` takes workload requests (token ids, hashed as the workers hash them);
`pooled_lru_hit_ratio_of_blocks` takes chained block ids directly, such as a Mooncake trace's `hash_ids`
(one id per 512-token block, equal ids meaning equal prefixes).
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvbaton.bench.workloads.base import WorkloadRequest
from kvbaton.core.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class PooledBound:
    hit_ratio: float  # hit tokens / prompt tokens
    num_hit_tokens: int
    num_prompt_tokens: int
    capacity_blocks: int  # of the one cache (None capacity is reported as -1: unlimited)
    block_size: int


def capacity_blocks_for(memory_bytes: float, kv_bytes_per_token: int, block_size: int) -> int:
    """Blocks of `block_size` tokens that `memory_bytes` of KV holds at `kv_bytes_per_token`."""
    if kv_bytes_per_token <= 0 or block_size <= 0 or memory_bytes < 0:
        raise InvalidRequestError("capacity needs kv_bytes_per_token > 0, block_size > 0 and memory >= 0")
    return int(memory_bytes // (kv_bytes_per_token * block_size))


def pooled_lru_hit_ratio_of_blocks(prompts: Iterable[tuple[Sequence[int], int]], capacity_blocks: int | None,
                                   block_size: int) -> PooledBound:
    """The bound over `prompts`: (chained ids of the prompt's full blocks, its length in tokens) in arrival order;
    `capacity_blocks` None: unlimited memory. Ids of a trailing partial block may be included: a block counts
    only where `(index + 1) * block_size <= num_prompt_tokens`."""
    if block_size <= 0:
        raise InvalidRequestError(f"block_size must be positive, got {block_size}")
    if capacity_blocks is not None and capacity_blocks < 0:
        raise InvalidRequestError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
    lru: OrderedDict[int, None] = OrderedDict()  # least recently used first
    num_hit_tokens = num_prompt_tokens = 0
    for block_ids, num_tokens in prompts:
        num_prompt_tokens += num_tokens
        full = list(block_ids[: num_tokens // block_size])
        max_hit = max(0, (num_tokens - 1) // block_size)
        num_hit = 0
        while num_hit < min(max_hit, len(full)) and full[num_hit] in lru:
            num_hit += 1
        num_hit_tokens += num_hit * block_size
        if capacity_blocks == 0:
            continue
        for block_id in reversed(full):  # deepest first: the head ends most recently used
            if block_id in lru:
                lru.move_to_end(block_id)
            else:
                lru[block_id] = None
        if capacity_blocks is not None:
            while len(lru) > capacity_blocks:
                lru.popitem(last=False)
    return PooledBound(num_hit_tokens / num_prompt_tokens if num_prompt_tokens else 0.0, num_hit_tokens,
                       num_prompt_tokens, -1 if capacity_blocks is None else capacity_blocks, block_size)


def pooled_lru_hit_ratio(requests: Sequence[WorkloadRequest], capacity_blocks: int | None,
                         block_size: int) -> PooledBound:
    """The bound over workload requests, their prompts hashed per tenant as the workers' caches hash them (two
    tenants never share a block); `capacity_blocks` None: unlimited memory."""

    def prompts() -> Iterable[tuple[Sequence[int], int]]:
        for request in requests:
            tokens = request.prompt_array.tolist()
            yield _chained_ids(request.tenant, tokens, block_size), len(tokens)

    return pooled_lru_hit_ratio_of_blocks(prompts(), capacity_blocks, block_size)


def _chained_ids(tenant: str, tokens: list[int], block_size: int) -> list[int]:
    """Chained ids of the full blocks of `tokens` from a per-tenant root, as `kvbaton.cache.hashing` chains them
    (that layer sits above bench, so the two lines are repeated here)."""
    parent = zlib.crc32(tenant.encode())  # str hashes are salted per process; ints and int tuples are not
    ids = []
    for block in zip(*[iter(tokens)] * block_size):
        parent = hash((parent, block))
        ids.append(parent)
    return ids


def pooled_lru_hit_ratio_of_trace(rows: Sequence[dict], capacity_tokens: int | None,
                                  block_tokens: int) -> PooledBound:
    """The bound over Mooncake trace rows (`hash_ids`, `input_length`) at the trace's own block granularity;
    `capacity_tokens` None: unlimited."""
    capacity = None if capacity_tokens is None else capacity_tokens // block_tokens
    return pooled_lru_hit_ratio_of_blocks(((row["hash_ids"], row["input_length"]) for row in rows), capacity,
                                          block_tokens)
