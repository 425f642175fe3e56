"""KV handoff staging for an accelerator: the host copy of a worker's KV storage that the shm/tcp transports move.

The transports copy bytes between host arrays (`numpy` views: a shared-memory mapping, a socket's buffers); they
never see a device tensor, and nothing here calls `.numpy()` on one. On the CPU the storage is itself host memory,
so `KVStaging` hands the transports a no-copy view of it and every copy below is skipped. On a GPU:

- **Prefill side.** `KVStaging(device_kv)` keeps a pinned host buffer shaped as the storage
  (`[layers, 2, blocks, block_size, kv_heads, head_dim]`, the same block ids); before a step's chunks go out,
  `to_host(block_ids)` copies those blocks of every layer device -> host (synchronous: the bytes are in the buffer
  when it returns), and the transports read the buffer.
- **Decode side.** `KVStaging(device_kv, host_kv=region)` wraps the memory the transports write into (the
  shared-memory region, or the tcp receiver's buffer); when a leg is adopted, `to_device(block_ids)` copies its
  blocks host -> device before the engine decodes from them.

The price: host memory the size of the device pool (pinned where torch can pin it), and one device <-> host copy of
each handed-off block, which the CPU path does not pay. Per-layer overlap of that copy with the step is not done.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvbaton.engine.handoff import numpy_kv
from kvbaton.engine.kv_storage import _copy_blocks


class KVStaging:
    """The host side of one worker's KV storage for the transports; see the module docstring."""

    def __init__(self, device_kv: torch.Tensor, host_kv: torch.Tensor | None = None) -> None:
        self.device_kv = device_kv
        if host_kv is None:
            if device_kv.device.type == "cpu":
                host_kv = device_kv
            else:
                host_kv = torch.zeros(device_kv.shape, dtype=device_kv.dtype, device="cpu",
                                      pin_memory=device_kv.device.type == "cuda")
        elif tuple(host_kv.shape) != tuple(device_kv.shape) or host_kv.dtype != device_kv.dtype:
            raise ValueError(f"host KV {tuple(host_kv.shape)} {host_kv.dtype} does not mirror the device's "
                             f"{tuple(device_kv.shape)} {device_kv.dtype}")
        self.host_kv = host_kv
        self.host_numpy = numpy_kv(host_kv)
        self.num_staged_bytes = 0  # device <-> host, both ways
        self._bytes_per_block = device_kv[:, :, :1].numel() * device_kv.element_size()

    @property
    def stages(self) -> bool:
        """True when the transports' memory is not the storage itself (a device, or a separate landing buffer)."""
        return self.host_kv.data_ptr() != self.device_kv.data_ptr() or self.host_kv.device != self.device_kv.device

    def to_host(self, block_ids: Sequence[int]) -> None:
        """Copy these blocks (every layer, K and V) from the storage into the host buffer; returns once they are
        there."""
        if self.stages and block_ids:
            ids = list(block_ids)
            _copy_blocks(self.device_kv, ids, self.host_kv, ids)
            self.num_staged_bytes += len(ids) * self._bytes_per_block

    def to_device(self, block_ids: Sequence[int]) -> None:
        """Copy these blocks from the host buffer into the storage (a landed handoff, before the engine adopts it)."""
        if self.stages and block_ids:
            ids = list(block_ids)
            _copy_blocks(self.host_kv, ids, self.device_kv, ids)
            self.num_staged_bytes += len(ids) * self._bytes_per_block
