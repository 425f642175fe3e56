"""What both handoff drivers share: the engine's KV layout and storage as the transfer package sees them, and counters.

The prefill side (`handoff_prefill.PrefillHandoffs`) and the decode side (`handoff_decode.DecodeHandoffs`)
drive the pure protocol legs of `kvbaton.transfer` against a live `Engine`; this module turns the
engine's torch storage into the layout identity and the numpy view the transports copy from or into.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvbaton.model.registry import LoadedModel
from kvbaton.transfer.layout import KVLayout
from kvbaton.transfer.messages import TransferId

DEFAULT_LEASE_S = 60.0  # a reservation covers the prefill's queue time on the prefill worker too


def kv_layout_for(loaded: LoadedModel, block_size: int, tensor_parallel_size: int = 1,
                  pipeline_parallel_size: int = 1) -> KVLayout:
    """The layout identity of an engine built from `loaded` with `block_size`-token blocks and that parallelism."""
    config = loaded.config
    dtype_name = str(loaded.dtype).removeprefix("torch.")
    return KVLayout(loaded.revision, dtype_name, block_size, config.num_layers, config.num_kv_heads, config.head_dim,
                    tensor_parallel_size, pipeline_parallel_size)


def numpy_kv(kv_cache: torch.Tensor) -> np.ndarray:
    """A no-copy numpy view of CPU KV storage; bfloat16 as its raw 16-bit pattern (the transports' convention).
    A device tensor is refused: the transports reach it through `kv_staging.KVStaging`'s host buffer."""
    if kv_cache.device.type != "cpu":
        raise ValueError(f"KV storage on {kv_cache.device} has no host view: stage it through KVStaging")
    if kv_cache.dtype == torch.bfloat16:
        return kv_cache.view(torch.int16).numpy().view(np.uint16)
    return kv_cache.numpy()


def transfer_id_of(request_id: str) -> TransferId:
    """One transfer per engine request: the API expands `n` into one request id per sample already."""
    return TransferId(request_id, 0)


@dataclass(slots=True)
class TransferCounters:
    """Cumulative transfer figures of one worker, reported in its heartbeat."""

    num_started: int = 0  # legs begun (prefill: reserve sent; decode: reservation granted)
    num_completed: int = 0  # prefill: acked; decode: adopted by the engine
    num_failed: int = 0  # failed or expired legs
    num_refused: int = 0  # reservations refused (backpressure or layout)
    num_cancelled: int = 0
    num_recomputed: int = 0  # decode side: prompts prefilled locally after a failed transfer
    num_bytes: int = 0  # KV bytes streamed (prefill side)
    transfer_time_s: float = 0.0  # sum over completed legs of first chunk -> ack (prefill side)
    queue_time_s: float = 0.0  # sum over completed legs of reserve -> grant (prefill side)

    def as_tuple(self) -> tuple[int, int, int, int, int, int, int, float, float]:
        return (self.num_started, self.num_completed, self.num_failed, self.num_refused, self.num_cancelled,
                self.num_recomputed, self.num_bytes, self.transfer_time_s, self.queue_time_s)
