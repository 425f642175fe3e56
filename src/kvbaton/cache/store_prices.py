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

import math

from collections.abc import Sequence
from dataclasses import dataclass, replace

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


MIN_MEASURED_BYTES = 1 << 20  # a counter delta below this says little about a link's speed (latency dominates)


class LinkMeter:
    """A link's measured speed: an EWMA of bytes/s over the deltas of cumulative (bytes, seconds) counters that
    several sources (workers, a store node) report, each counter pair on its own. A delta counts only when it
    carries at least `min_bytes` and took some time; a counter that went back (its source restarted) counts
    from 0 again. Plain Python, time passed in (`measured_at` says when the figure last moved)."""

    __slots__ = ("alpha", "min_bytes", "bytes_per_s", "num_samples", "measured_at", "_last")

    def __init__(self, alpha: float = 0.3, min_bytes: int = MIN_MEASURED_BYTES) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.min_bytes = min_bytes
        self.bytes_per_s: float | None = None  # None until the first delta that counts
        self.num_samples = 0
        self.measured_at: float | None = None
        self._last: dict[str, tuple[int, float]] = {}  # source -> its counters at the last delta taken

    def observe(self, source: str, total_bytes: int, total_s: float, now: float) -> bool:
        """`source`'s cumulative counters now; True when they moved the figure. A source's counters start at 0 (a
        source first heard of, or one whose counters went back: it restarted)."""
        if not (total_bytes >= 0 and 0.0 <= total_s < math.inf):
            return False  # not a counter (a NaN, an inf, a negative): never let it into the figure
        last = self._last.get(source, (0, 0.0))
        if total_bytes < last[0] or total_s < last[1]:
            last = (0, 0.0)
        num_bytes, seconds = total_bytes - last[0], total_s - last[1]
        if num_bytes < self.min_bytes or seconds <= 0.0:
            self._last[source] = last  # too little to mean something: the delta grows until it does
            return False
        self._last[source] = (total_bytes, total_s)
        speed = num_bytes / seconds
        self.bytes_per_s = speed if self.bytes_per_s is None else (
            self.alpha * speed + (1.0 - self.alpha) * self.bytes_per_s)
        self.num_samples += 1
        self.measured_at = now
        return True

    def forget(self, source: str) -> None:
        self._last.pop(source, None)


class MeasuredStorePrices:
    """The live router's store prices: the nominal ones until its links are measured, then the measured speeds.
    Workers report what their loads moved and took, per transport ("shm": copies from the node's shared memory on
    their own host; "tcp": reads over the node's TCP port), and the store node its disk reads. The router's model
    prices every live load as a load from its own node's DRAM (`StorePrices.host_bytes_per_s`), so that is the
    shared-memory figure, or the TCP one while no load went over shared memory (every worker reads over TCP);
    `disk_bytes_per_s` is the node's disk read speed."""

    __slots__ = ("nominal", "meters")

    def __init__(self, nominal: StorePrices, alpha: float = 0.3, min_bytes: int = MIN_MEASURED_BYTES) -> None:
        self.nominal = nominal
        self.meters = {link: LinkMeter(alpha, min_bytes) for link in ("shm", "tcp", "disk")}

    def observe(self, link: str, source: str, total_bytes: int, total_s: float, now: float) -> bool:
        """`source`'s cumulative counters on `link` ("shm" | "tcp" | "disk"; another name counts nowhere)."""
        meter = self.meters.get(link)
        return meter is not None and meter.observe(source, total_bytes, total_s, now)

    def forget(self, source: str) -> None:
        for meter in self.meters.values():
            meter.forget(source)

    @property
    def host_bytes_per_s(self) -> float | None:
        shm, tcp = self.meters["shm"].bytes_per_s, self.meters["tcp"].bytes_per_s
        return shm if shm is not None else tcp

    def prices(self) -> StorePrices:
        host, disk = self.host_bytes_per_s, self.meters["disk"].bytes_per_s
        return replace(self.nominal, host_bytes_per_s=self.nominal.host_bytes_per_s if host is None else host,
                       disk_bytes_per_s=self.nominal.disk_bytes_per_s if disk is None else disk)

    def info(self) -> dict[str, object]:
        """For /cluster: each priced speed and whether it is "measured" or "nominal", with each link's EWMA."""
        prices = self.prices()
        host, disk = self.host_bytes_per_s, self.meters["disk"].bytes_per_s
        return {"host_bytes_per_s": prices.host_bytes_per_s, "host_speed": "nominal" if host is None else "measured",
                "disk_bytes_per_s": prices.disk_bytes_per_s, "disk_speed": "nominal" if disk is None else "measured",
                "links": {link: {"bytes_per_s": meter.bytes_per_s, "num_samples": meter.num_samples}
                          for link, meter in self.meters.items()}}
