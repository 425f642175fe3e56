"""KV tensors of one worker: `[layers, 2, blocks, block_size, kv_heads, head_dim]`, indexed by BlockPool ids.

The block pool owns ids and reference counts; this owns the memory those ids point at.
"""

from __future__ import annotations

import mmap

import torch

from kvbaton.model.config import ModelConfig


class KVStorage:
    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: str = "cpu",
        kv_cache: torch.Tensor | None = None,
    ) -> None:
        """`kv_cache`, when given, is memory someone else owns (a decode worker's shared-memory region,
        written in place by prefill workers); it must already have this storage's shape and dtype."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        if kv_cache is None:
            kv_cache = host_zeros(shape, dtype) if device == "cpu" else torch.zeros(shape, dtype=dtype, device=device)
        elif tuple(kv_cache.shape) != shape or kv_cache.dtype != dtype:
            raise ValueError(f"KV storage {tuple(kv_cache.shape)} {kv_cache.dtype} is not {shape} {dtype}")
        self.kv_cache = kv_cache

    @property
    def num_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()

    @property
    def bytes_per_block(self) -> int:
        return self.num_bytes // self.num_blocks


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in anonymous memory the kernel is asked to back with transparent huge pages
    (`MADV_HUGEPAGE`: on Linux with THP in `madvise` mode, as here, plain allocations get 4 KiB pages). A KV pool is
    read a block at a time by attention and written a row at a time by store loads and handoffs: with 2 MiB pages a
    2,000-token load's copy into it takes a few dozen TLB misses where it took ~11,000, and ran 2-5 % faster timed by
    hand here. Where the kernel does not take the advice the memory is ordinary pages; without the advice (not
    Linux), or under one huge page, `torch.zeros`."""
    num_bytes = dtype.itemsize
    for size in shape:
        num_bytes *= size
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or num_bytes < 1 << 21:
        return torch.zeros(shape, dtype=dtype)
    memory = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        memory.madvise(advice)
    except OSError:
        pass  # THP off, or no such advice on this kernel: ordinary pages
    tensor = torch.frombuffer(memory, dtype=dtype).view(shape)  # holds `memory` for as long as it lives
    tensor.zero_()  # touched now, as torch.zeros does, so no step pays the page faults
    return tensor


def _copy_blocks(src: torch.Tensor, src_ids: list[int], dst: torch.Tensor, dst_ids: list[int]) -> None:
    """dst's blocks dst_ids[i] = src's blocks src_ids[i] (dimension 2 of both), one slice copy per stretch where both
    id lists count up by one: blocks taken from free lists in turn mostly do, and a slice copy runs at memcpy speed
    where a gather and a scatter copy twice."""
    start = 0
    for end in range(1, len(src_ids) + 1):
        if end < len(src_ids) and src_ids[end] == src_ids[end - 1] + 1 and dst_ids[end] == dst_ids[end - 1] + 1:
            continue
        src_first, dst_first, num = src_ids[start], dst_ids[start], end - start
        dst[:, :, dst_first : dst_first + num].copy_(src[:, :, src_first : src_first + num], non_blocking=False)
        start = end
