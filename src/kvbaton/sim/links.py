"""Simulated links: bandwidth, latency and contention (one transfer at a time per link, FIFO).

A transfer of B bytes that starts when the link frees up takes `latency_s + B / bytes_per_s`.
Presets are nominal one-direction figures: NVLink per GPU (A100: 300 GB/s, H100: 450 GB/s),
PCIe 4.0 x16, InfiniBand HDR (200 Gb/s) and 100 Gb Ethernet. The `host-pcie*` presets are one GPU's
link to host memory, which the KV store's loads cross (`kvbaton.cache.store_prices`): effective
pinned-memory copy rates of PCIe 4.0 and 5.0 x16 (about 25 and 50 GB/s, below the nominal 32 and 64),
and a copy's launch and synchronization (~10 us).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbaton.core.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class LinkSpec:
    name: str
    bytes_per_s: float
    latency_s: float

    def transfer_s(self, num_bytes: int) -> float:
        return self.latency_s + num_bytes / self.bytes_per_s


LINKS: dict[str, LinkSpec] = {link.name: link for link in (
    LinkSpec("nvlink", 450e9, 2e-6),
    LinkSpec("nvlink-a100", 300e9, 2e-6),
    LinkSpec("pcie", 32e9, 5e-6),
    LinkSpec("infiniband", 25e9, 5e-6),
    LinkSpec("ethernet", 12.5e9, 20e-6),
    LinkSpec("host-pcie4", 25e9, 10e-6),
    LinkSpec("host-pcie5", 50e9, 10e-6),
)}


def get_link(name: str) -> LinkSpec:
    link = LINKS.get(name)
    if link is None:
        raise InvalidRequestError(f"unknown link {name!r}; choose from {', '.join(LINKS)}")
    return link


class Link:
    """One link's queue: transfers are served in the order they are offered."""

    __slots__ = ("spec", "free_at", "num_bytes", "busy_s")

    def __init__(self, spec: LinkSpec) -> None:
        self.spec = spec
        self.free_at = 0.0  # when the transfer in progress (if any) ends
        self.num_bytes = 0  # total carried
        self.busy_s = 0.0

    def offer(self, num_bytes: int, now: float) -> float:
        """Queue a transfer offered at `now`; returns when it completes."""
        start = max(now, self.free_at)
        duration_s = self.spec.transfer_s(num_bytes)
        self.free_at = start + duration_s
        self.num_bytes += num_bytes
        self.busy_s += duration_s
        return self.free_at
