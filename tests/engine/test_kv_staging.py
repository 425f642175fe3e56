"""KV handoff staging (engine/kv_staging.py): the host memory the transports move, and copies to and from it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbaton.engine.handoff import numpy_kv
from kvbaton.engine.kv_staging import KVStaging

SHAPE = (3, 2, 8, 4, 2, 5)  # [layers, 2, blocks, block_size, kv_heads, head_dim]


def _numbered(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.arange(np.prod(SHAPE), dtype=torch.float32).reshape(SHAPE).to(dtype)


def test_cpu_storage_is_its_own_host_view_and_nothing_is_copied() -> None:
    kv = _numbered()
    staging = KVStaging(kv)
    assert not staging.stages and staging.host_kv is kv
    staging.to_host([0, 1, 5])
    assert staging.num_staged_bytes == 0
    kv[1, 0, 2] = -1.0
    assert staging.host_numpy[1, 0, 2].tolist() == kv[1, 0, 2].tolist()  # the same memory, no copy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_staged_blocks_round_trip_every_layer_and_leave_the_others(dtype: torch.dtype) -> None:
    storage = _numbered(dtype)
    landing = torch.zeros(SHAPE, dtype=dtype)
    staging = KVStaging(storage, host_kv=landing)
    assert staging.stages
    staging.to_host([6, 2, 3])  # out of order and contiguous runs together
    for block in range(SHAPE[2]):
        expected = storage[:, :, block] if block in (2, 3, 6) else torch.zeros_like(storage[:, :, block])
        assert torch.equal(landing[:, :, block], expected), block
    bytes_per_block = storage[:, :, :1].numel() * storage.element_size()
    assert staging.num_staged_bytes == 3 * bytes_per_block
    # Decode side: what landed in host memory reaches the storage, and only those blocks.
    landing[:, :, 4] = 7.0
    storage_before = storage.clone()
    staging.to_device([4])
    assert torch.equal(storage[:, :, 4], torch.full_like(storage[:, :, 4], 7.0))
    untouched = [b for b in range(SHAPE[2]) if b != 4]
    assert torch.equal(storage[:, :, untouched], storage_before[:, :, untouched])
    # The transports' numpy view is the landing memory (bfloat16 as raw 16-bit words).
    view = staging.host_numpy
    assert view.ctypes.data == landing.data_ptr()
    assert view.dtype == (np.uint16 if dtype == torch.bfloat16 else np.float32)


def test_a_mismatched_landing_buffer_is_refused() -> None:
    with pytest.raises(ValueError, match="does not mirror the device's"):
        KVStaging(_numbered(), host_kv=torch.zeros((3, 2, 7, 4, 2, 5)))
    with pytest.raises(ValueError, match="does not mirror"):
        KVStaging(_numbered(), host_kv=torch.zeros(SHAPE, dtype=torch.float16))


def test_no_numpy_view_of_a_device_tensor() -> None:
    with pytest.raises(ValueError, match="on meta has no host view: stage it through KVStaging"):
        numpy_kv(torch.empty(SHAPE, device="meta"))
