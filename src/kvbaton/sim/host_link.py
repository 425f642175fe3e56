"""A simulated worker's link to host memory: the host KV tier's `TierIO`, which moves no bytes but prices the copies.

`HostTier` (`kvbaton.cache.host_tier`) calls `save` when the device cache demotes evicted blocks and
`load` when an admission promotes blocks back, synchronously, inside the scheduler's calls. The
simulator counts what each call moves and the worker charges it to its next step
(`take_copy_s`): a copy of B bytes takes `latency_s + B / (bytes_per_s x GPUs)`, the worker's GPUs
each copying their shard of every block over their own link. The model is conservative: copies
are serial with the step's compute, where a live engine may overlap them with other layers' work.
"""

from __future__ import annotations

from kvbaton.sim.links import LinkSpec


class HostLink:
    """Counts the blocks the host tier copies each way, and the seconds they take not yet charged to a step."""

    __slots__ = ("_s_per_block", "_latency_s", "_num_pending_copies", "_num_pending_blocks", "num_copies",
                 "num_saved_blocks", "num_loaded_blocks", "copy_s")

    def __init__(self, link: LinkSpec, block_bytes: int, num_gpus: int = 1) -> None:
        if block_bytes < 0 or num_gpus < 1:
            raise ValueError(f"a host link needs block_bytes >= 0 and num_gpus >= 1, got {block_bytes}, {num_gpus}")
        self._s_per_block = block_bytes / (link.bytes_per_s * num_gpus)
        self._latency_s = link.latency_s
        self._num_pending_copies = 0  # copies made since the last `take_copy_s`
        self._num_pending_blocks = 0
        self.num_copies = 0  # `save` and `load` calls, in all
        self.num_saved_blocks = 0  # device -> host, in all
        self.num_loaded_blocks = 0  # host -> device, in all
        self.copy_s = 0.0  # seconds charged to steps, in all

    def save(self, device_block_ids: list[int], host_block_ids: list[int]) -> None:
        """One copy of the device blocks into the host blocks (`TierIO.save`): counted, priced at the next step."""
        self._num_pending_copies += 1
        self._num_pending_blocks += len(device_block_ids)
        self.num_copies += 1
        self.num_saved_blocks += len(device_block_ids)

    def load(self, host_block_ids: list[int], device_block_ids: list[int]) -> None:
        """One copy of the host blocks into the device blocks (`TierIO.load`): counted, priced at the next step."""
        self._num_pending_copies += 1
        self._num_pending_blocks += len(host_block_ids)
        self.num_copies += 1
        self.num_loaded_blocks += len(host_block_ids)

    def take_copy_s(self, now: float) -> float:
        """Seconds the copies made since the last call take, one after another, over this worker's own link
        (`now` does not matter: nothing else shares it); they count as charged."""
        if not self._num_pending_copies:
            return 0.0
        copy_s = self._num_pending_copies * self._latency_s + self._num_pending_blocks * self._s_per_block
        self._num_pending_copies = self._num_pending_blocks = 0
        self.copy_s += copy_s
        return copy_s
