"""What a store load costs: per block, the path from the tier and node that hold it to a worker's GPUs.

One price list serves the router (predicting a placement's TTFT) and the simulator (charging the load),
so both price a block alike. A block on the reader's own node comes over the host link (each GPU of the
worker copying its shard over its own link); on another node it also crosses the NIC between the two
nodes; from disk it is also read at the disk's bandwidth. The blocks of one path stream at that path's
narrowest link; paths are priced one after another (a conservative model: a live store reads them in
parallel). A load also pays a fixed round trip once (`load_latency_s`: asking the node for its blocks, a lease
and its answer), whatever its size: a live router measures it apart from the bytes' speed, so a link measured on
small loads does not price big ones slow, nor one measured on big loads small ones fast. Nominal figures: PCIe
5.0 x16 host link (50 GB/s per GPU), 200 Gb InfiniBand NIC (25 GB/s), an NVMe disk (5 GB/s), 10 us per path,
and no round trip (`load_latency_s` 0: the simulator's outputs as before it existed).
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
    load_latency_s: float = 0.0  # per load that brings blocks: its request's round trip to the node

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
        """Seconds to load blocks from `sources` (node, tier of each) into a worker on node `reader`: its round trip
        (none for no blocks) and its paths."""
        if not sources:
            return 0.0
        counts = [0, 0, 0, 0]  # (remote, on disk) as bits
        for node_id, tier in sources:
            counts[(node_id != reader) * 2 + (tier == DISK)] += 1
        return self.load_latency_s + sum(self.path_s(n, bool(i & 2), bool(i & 1), num_gpus)
                                         for i, n in enumerate(counts))


MIN_MEASURED_BYTES = 1 << 20  # a counter delta below this says little about a link's speed (latency dominates)


class LinkMeter:
    """A link's measured speed and round trip: EWMAs over the deltas of cumulative counters that several sources
    (workers, a store node) report, each source's on its own: (bytes, seconds) and, where the source tells them,
    (loads, round-trip seconds: of `seconds`, the part each load waited for its first answer). Then `bytes_per_s`
    is the bytes over the seconds left after the round trips, and `latency_s` the round trips' seconds per load, so
    a load of B bytes is priced `latency_s + B / bytes_per_s` (`StorePrices.load_latency_s`); a source that counts
    no round trips measures bytes over all its seconds, as before, and no latency. A delta counts only when it
    carries at least `min_bytes` and took some time; a counter that went back (its source restarted) counts from 0
    again. Plain Python, time passed in (`measured_at` says when the figure last moved)."""

    __slots__ = ("alpha", "min_bytes", "bytes_per_s", "latency_s", "num_samples", "num_loads", "measured_at",
                 "_last")

    def __init__(self, alpha: float = 0.3, min_bytes: int = MIN_MEASURED_BYTES) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.min_bytes = min_bytes
        self.bytes_per_s: float | None = None  # None until the first delta that counts
        self.latency_s: float | None = None  # None until a delta with loads and their round trips counts
        self.num_samples = 0
        self.num_loads = 0  # loads in the deltas taken
        self.measured_at: float | None = None
        self._last: dict[str, tuple[int, float, int, float]] = {}  # source -> its counters at the last delta taken

    def observe(self, source: str, total_bytes: int, total_s: float, now: float, num_loads: int = 0,
                round_trip_s: float = 0.0) -> bool:
        """`source`'s cumulative counters now (bytes, seconds, and the loads and their round trips' seconds, 0 when
        it does not count them); True when they moved the figures. A source's counters start at 0 (a source first
        heard of, or one whose counters went back: it restarted)."""
        if not (total_bytes >= 0 and 0.0 <= total_s < math.inf and num_loads >= 0 and 0.0 <= round_trip_s <= total_s):
            return False  # not a counter (a NaN, an inf, a negative, more round trip than time): never let it in
        last = self._last.get(source, (0, 0.0, 0, 0.0))
        if total_bytes < last[0] or total_s < last[1] or num_loads < last[2] or round_trip_s < last[3]:
            last = (0, 0.0, 0, 0.0)
        num_bytes, seconds = total_bytes - last[0], total_s - last[1]
        loads, waited_s = num_loads - last[2], min(round_trip_s - last[3], seconds)
        if num_bytes < self.min_bytes or seconds - waited_s <= 0.0:
            self._last[source] = last  # too little to mean something: the delta grows until it does
            return False
        self._last[source] = (total_bytes, total_s, num_loads, round_trip_s)
        self.bytes_per_s = self._average(self.bytes_per_s, num_bytes / (seconds - waited_s))
        if loads > 0 and waited_s > 0.0:
            self.latency_s = self._average(self.latency_s, waited_s / loads)
            self.num_loads += loads
        self.num_samples += 1
        self.measured_at = now
        return True

    def _average(self, figure: float | None, sample: float) -> float:
        return sample if figure is None else self.alpha * sample + (1.0 - self.alpha) * figure

    def forget(self, source: str) -> None:
        self._last.pop(source, None)


class MeasuredStorePrices:
    """The live router's store prices: the nominal ones until its links are measured, then the measured speeds and
    round trip (`load_latency_s`, from the host link's meter as its speed).
    Workers report what their loads moved and took, per transport ("shm": copies from the node's shared memory on
    their own host; "tcp": reads over the node's TCP port), and the store node its disk reads. The router's model
    prices every live load as a load from its own node's DRAM (`StorePrices.host_bytes_per_s`), so that is the
    shared-memory figure, or the TCP one while no load went over shared memory (every worker reads over TCP);
    `disk_bytes_per_s` is the node's disk read speed."""

    __slots__ = ("nominal", "meters")

    def __init__(self, nominal: StorePrices, alpha: float = 0.3, min_bytes: int = MIN_MEASURED_BYTES) -> None:
        self.nominal = nominal
        self.meters = {link: LinkMeter(alpha, min_bytes) for link in ("shm", "tcp", "disk")}

    def observe(self, link: str, source: str, total_bytes: int, total_s: float, now: float, num_loads: int = 0,
                round_trip_s: float = 0.0) -> bool:
        """`source`'s cumulative counters on `link` ("shm" | "tcp" | "disk"; another name counts nowhere)."""
        meter = self.meters.get(link)
        return meter is not None and meter.observe(source, total_bytes, total_s, now, num_loads, round_trip_s)

    def forget(self, source: str) -> None:
        for meter in self.meters.values():
            meter.forget(source)

    @property
    def host_meter(self) -> LinkMeter:
        """The meter the host link's price comes from: shared memory's once it measured, else TCP's."""
        return self.meters["shm"] if self.meters["shm"].bytes_per_s is not None else self.meters["tcp"]

    @property
    def host_bytes_per_s(self) -> float | None:
        return self.host_meter.bytes_per_s

    @property
    def load_latency_s(self) -> float | None:
        return self.host_meter.latency_s

    def prices(self) -> StorePrices:
        host, disk, latency = self.host_bytes_per_s, self.meters["disk"].bytes_per_s, self.load_latency_s
        return replace(self.nominal, host_bytes_per_s=self.nominal.host_bytes_per_s if host is None else host,
                       disk_bytes_per_s=self.nominal.disk_bytes_per_s if disk is None else disk,
                       load_latency_s=self.nominal.load_latency_s if latency is None else latency)

    def info(self) -> dict[str, object]:
        """For /cluster: each priced speed and whether it is "measured" or "nominal", with each link's EWMA."""
        prices = self.prices()
        host, disk = self.host_bytes_per_s, self.meters["disk"].bytes_per_s
        latency = self.load_latency_s
        return {"host_bytes_per_s": prices.host_bytes_per_s, "host_speed": "nominal" if host is None else "measured",
                "disk_bytes_per_s": prices.disk_bytes_per_s, "disk_speed": "nominal" if disk is None else "measured",
                "load_latency_s": prices.load_latency_s, "load_latency": "nominal" if latency is None else "measured",
                "links": {link: {"bytes_per_s": meter.bytes_per_s, "latency_s": meter.latency_s,
                                 "num_samples": meter.num_samples, "num_loads": meter.num_loads}
                          for link, meter in self.meters.items()}}
