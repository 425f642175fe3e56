"""A worker's KV memory on the CPU: zeroed, shaped as the pool is, and backed by transparent huge pages where the
kernel takes `MADV_HUGEPAGE` (THP in `madvise` or `always` mode)."""

from __future__ import annotations

import gc
import mmap
from pathlib import Path

import pytest
import torch

from kvbaton.engine.kv_storage import host_zeros

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_kib_at(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:
            start, end = (int(part, 16) for part in fields[0].split("-"))
            inside = start <= address < end
        elif inside and fields[0] == "AnonHugePages:":
            return int(fields[1])
    return 0


def test_host_memory_is_zeroed_writable_and_outlives_every_view() -> None:
    kv = host_zeros((4, 2, 64, 16, 3, 64), torch.bfloat16)
    assert kv.shape == (4, 2, 64, 16, 3, 64) and kv.dtype == torch.bfloat16 and kv.is_contiguous()
    assert not kv.any()
    kv[3, 1, 63] = 2.0
    view = kv[3, 1]
    del kv
    gc.collect()
    assert float(view.sum()) == 2.0 * 16 * 3 * 64  # the mapping lives while a view of it does
    small = host_zeros((2, 3), torch.float32)  # under a huge page: plain torch memory
    assert small.tolist() == [[0.0] * 3] * 2


@pytest.mark.skipif(not THP.exists() or not any(f"[{mode}]" in THP.read_text() for mode in ("madvise", "always"))
                    or not hasattr(mmap, "MADV_HUGEPAGE"), reason="no transparent huge pages on this kernel")
def test_a_pool_larger_than_a_few_huge_pages_gets_them() -> None:
    kv = host_zeros((30, 2, 128, 16, 3, 64), torch.bfloat16)  # 47 MB, as a 128-block SmolLM2 pool
    assert _huge_kib_at(kv.data_ptr() + kv.numel()) >= 2048  # in 2 MiB pages (as many as the kernel had free)
