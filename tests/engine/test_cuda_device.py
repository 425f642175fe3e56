"""The engine on a CUDA device: the same greedy tokens as the CPU in float32, KV on the device, handoff staging
through pinned host memory. Skipped where torch sees no CUDA device (nothing here touches CUDA otherwise)."""

from __future__ import annotations

import pytest
import torch

from kvbaton import LLM, SamplingParams
from kvbaton.engine.kv_staging import KVStaging

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = [[1, 2, 3, 4, 5], list(range(7, 60)), [9] * 40]


def _greedy(device: str) -> list[list[int]]:
    llm = LLM("tiny-random", dtype="float32", num_blocks=64, device=device)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params)]
    llm.engine.check_invariants()
    return outs


def test_greedy_tokens_on_cuda_equal_the_cpu_in_float32() -> None:
    assert _greedy("cuda") == _greedy("cpu")


def test_kv_weights_and_sampling_live_on_the_device() -> None:
    llm = LLM("tiny-random", dtype="float32", num_blocks=16, device="cuda:0")
    assert llm.engine.storage.kv_cache.device.type == "cuda"
    assert llm.engine.loaded.model.embed_tokens.device.type == "cuda"
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=3, logprobs=2, ignore_eos=True)
    a = llm.generate([1, 2, 3], sampled)[0].outputs[0]
    b = llm.generate([1, 2, 3], sampled)[0].outputs[0]
    assert a.token_ids == b.token_ids and len(a.logprobs) == 8 and len(a.logprobs[0].top_logprobs) == 2


def test_staging_round_trips_device_blocks_through_pinned_host_memory() -> None:
    shape = (2, 2, 6, 4, 2, 8)
    device_kv = torch.randn(shape, device="cuda").to(torch.bfloat16)
    staging = KVStaging(device_kv)
    assert staging.stages and staging.host_kv.is_pinned() and staging.host_kv.device.type == "cpu"
    staging.to_host([1, 2, 5])
    assert torch.equal(staging.host_kv[:, :, [1, 2, 5]], device_kv[:, :, [1, 2, 5]].cpu())
    staging.host_kv[:, :, 3] = 1.0
    staging.to_device([3])
    assert torch.equal(device_kv[:, :, 3].cpu(), staging.host_kv[:, :, 3])


def test_the_store_loads_evicted_prefixes_back_into_device_blocks() -> None:
    """A 40-block device pool for six 13-block prefixes taken in turn: blocks are written through to the LLM's store
    node (shared memory) and loaded back into device blocks as hits, with the tokens of a CPU pool that never
    evicts."""
    import random

    rng = random.Random(0)
    prefixes = [[rng.randrange(1, 200) for _ in range(200)] for _ in range(6)]
    prompts = [prefixes[i % 6] + [rng.randrange(1, 200) for _ in range(10)] for i in range(18)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with LLM("tiny-random", dtype="float32", num_blocks=2000) as reference, LLM(
            "tiny-random", dtype="float32", num_blocks=40, kv_store_gb=0.01, device="cuda") as stored:
        for prompt in prompts:
            expected = reference.generate([prompt], params)[0].outputs[0].token_ids
            assert stored.generate([prompt], params)[0].outputs[0].token_ids == expected
        stored.engine.check_invariants()
        assert stored.engine.store_io.num_loaded_blocks > 0
