"""The prefix cache's host tier in the real engine: KV copied out and back gives the same greedy outputs as a pool
large enough to never evict, and every device and host block is accounted for afterwards."""

from __future__ import annotations

import random

import pytest
import torch

from kvbaton import LLM, SamplingParams
from kvbaton.engine.kv_storage import HostKVStorage

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
NUM_GROUPS = 6


def _prompts() -> list[list[int]]:
    """Six 200-token prefixes (13 blocks each), taken in turn three times: 40 device blocks hold about three."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(1, 200) for _ in range(200)] for _ in range(NUM_GROUPS)]
    return [prefixes[i % NUM_GROUPS] + [rng.randrange(1, 200) for _ in range(10)] for i in range(3 * NUM_GROUPS)]


def _run(num_blocks: int, host_num_blocks: int) -> tuple[list[list[int]], LLM]:
    llm = LLM("tiny-random", dtype="float32", num_blocks=num_blocks, host_num_blocks=host_num_blocks)
    outputs = [llm.generate([prompt], GREEDY)[0].outputs[0].token_ids for prompt in _prompts()]
    llm.engine.check_invariants()  # the cache's check covers the host tier's blocks too
    return outputs, llm


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return _run(num_blocks=2000, host_num_blocks=0)[0]


def test_host_tier_outputs_equal_a_pool_that_never_evicts(reference: list[list[int]]) -> None:
    outputs, llm = _run(num_blocks=40, host_num_blocks=200)
    assert outputs == reference
    stats = llm.engine.stats()
    # Every prefix after the first round came back from the host tier (the device pool holds about three of six).
    assert stats.num_host_loaded_blocks >= 2 * NUM_GROUPS * 12
    assert stats.prefix_cache_hits_tokens >= 2 * NUM_GROUPS * 12 * 16
    # Block accounting at rest: the device pool is held by the cache alone, the tier by its entries alone.
    assert stats.num_used_blocks == stats.num_cached_blocks
    tier = llm.engine.prefix_cache.tier
    assert tier is not None and tier.num_cached_blocks == stats.num_host_cached_blocks > 0


def test_without_the_tier_the_small_pool_recomputes(reference: list[list[int]]) -> None:
    outputs, llm = _run(num_blocks=40, host_num_blocks=0)
    assert outputs == reference
    assert llm.engine.stats().prefix_cache_hits_tokens < 2 * NUM_GROUPS * 12 * 16 / 4


def test_wrong_kv_loaded_changes_the_outputs(reference: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """The equality above can fail: a load that brings back altered KV changes greedy outputs."""
    load = HostKVStorage.load

    def scaled_load(self: HostKVStorage, host_block_ids: list[int], device_block_ids: list[int]) -> None:
        self.kv_cache.mul_(0.5)
        load(self, host_block_ids, device_block_ids)

    monkeypatch.setattr(HostKVStorage, "load", scaled_load)
    outputs, _ = _run(num_blocks=40, host_num_blocks=200)
    assert outputs != reference


def test_host_storage_copies_blocks_both_ways() -> None:
    llm = LLM("tiny-random", dtype="float32", num_blocks=8, host_num_blocks=4)
    storage = llm.engine.host_storage
    assert storage is not None
    device = llm.engine.storage.kv_cache
    device.copy_(torch.arange(device.numel(), dtype=device.dtype).reshape(device.shape))
    storage.save([5, 2], [0, 3])
    assert torch.equal(storage.kv_cache[:, :, 0], device[:, :, 5])
    assert torch.equal(storage.kv_cache[:, :, 3], device[:, :, 2])
    storage.load([3, 0], [7, 6])
    assert torch.equal(device[:, :, 7], device[:, :, 2]) and torch.equal(device[:, :, 6], device[:, :, 5])
    assert storage.num_saved_bytes == storage.num_loaded_bytes == 2 * storage.bytes_per_block
