"""What a store load costs: per block, the path from the tier and node that hold it to a worker's GPUs.

One price list serves the router (predicting a placement's TTFT) and the simulator (charging the load),
so both price a block alike. A block on the reader's own node comes over the host link (each GPU of the
worker copying its shard over its own link); on another node it also crosses the NIC between the two
nodes; from disk it is also read at the disk's bandwidth. The blocks of one path stream at that path's
narrowest link; paths are priced one after another (a conservative model: a live store reads them in
parallel). Nominal figures: PCIe 5.0 x16 host link (50 GB/s per GPU), 200 Gb InfiniBand NIC (25 GB/s),
an NVMe disk (5 GB/s), 10 us per path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvbaton.cache.kv_store import DISK, NodeId


@dataclass(frozen=True, slots=True)
class StorePrices:
    block_bytes: int  # KV bytes of one block, all layers, K and V
    host_bytes_per_s: float = 50e9  # one GPU's link to host memory
    nic_bytes_per_s: float = 25e9  # between two nodes
    disk_bytes_per_s: float = 5e9  # one node's local disk
    latency_s: float = 10e-6  # per path

    def path_s(self, num_blocks: int, remote: bool, on_disk: bool, num_gpus: int = 1) -> float:
        """Seconds to bring `num_blocks` over one path (0 blocks: free)."""
        if num_blocks <= 0:
            return 0.0
        bytes_per_s = self.host_bytes_per_s * num_gpus
        if remote:
            bytes_per_s = min(bytes_per_s, self.nic_bytes_per_s)
        if on_disk:
            bytes_per_s = min(bytes_per_s, self.disk_bytes_per_s)
        return self.latency_s + num_blocks * self.block_bytes / bytes_per_s

    def load_s(self, sources: Sequence[tuple[NodeId, str]], reader: NodeId, num_gpus: int = 1) -> float:
        """Seconds to load blocks from `sources` (node, tier of each) into a worker on node `reader`."""
        counts = [0, 0, 0, 0]  # (remote, on disk) as bits
        for node_id, tier in sources:
            counts[(node_id != reader) * 2 + (tier == DISK)] += 1
        return sum(self.path_s(n, bool(i & 2), bool(i & 1), num_gpus) for i, n in enumerate(counts))
