"""KV tensors of one worker: `[layers, 2, blocks, block_size, kv_heads, head_dim]`, indexed by BlockPool ids.

The block pool owns ids and reference counts; this owns the memory those ids point at.
"""

from __future__ import annotations

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
            kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        elif tuple(kv_cache.shape) != shape or kv_cache.dtype != dtype:
            raise ValueError(f"KV storage {tuple(kv_cache.shape)} {kv_cache.dtype} is not {shape} {dtype}")
        self.kv_cache = kv_cache

    @property
    def num_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()

    @property
    def bytes_per_block(self) -> int:
        return self.num_bytes // self.num_blocks
