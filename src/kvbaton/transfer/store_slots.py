"""The KV store's DRAM tier on a node: fixed-size block slots in one shared-memory file the workers of the host map.

The store node owns the file (`/dev/shm/kvbaton-store-<pid>-<random>`, mode 0600: only the user running the
cluster maps it) and writes slots; a worker on the same host maps it read-only in effect (it only reads the
slots a load lease pinned for it) and copies each block straight from its slot into its KV pool, the only
copy on a same-host load. The file is laid out as the worker's KV pool is, rows first: `[rows, slots, row
bytes]` with a row per layer and K or V (`[layers, 2, slots, block_size, kv_heads, head_dim]`), so a run of
consecutive slots copies into a run of consecutive device blocks as one memcpy per row. A block's bytes on the
wire and on disk are its rows in order (`[layers, 2, block_size, kv_heads, head_dim]`): `write` scatters them,
`read` gathers them. Which slot holds which block is the node's bookkeeping (`kvbaton.server.store_node`); a
slot is reused only once no lease pins its block.
"""

from __future__ import annotations

import heapq
import mmap
import os
import secrets

import numpy as np

from kvbaton.transfer.transport_shm import map_shared_file, remove_stale_regions

SHM_DIRECTORY = "/dev/shm"
SHM_PREFIX = "kvbaton-store"


# glibc copies with ordinary stores below its non-temporal threshold (sized from the last-level cache: tens of MB on
# a server), at about 0.6x the speed of a streaming copy here; a load's copies are one row of a run of blocks each
# (768 KB for SmolLM2's 125 blocks), so a worker with a store runs with the threshold at 256 KiB: they stream.
STREAMING_COPIES = "glibc.cpu.x86_non_temporal_threshold=0x40000"


def with_streaming_copies(environment: dict[str, str]) -> dict[str, str]:
    """`environment` for a process whose large memcpys stream (`STREAMING_COPIES` added to GLIBC_TUNABLES, unless
    the threshold is set there already); glibc reads it at the process's start, and ignores it off x86."""
    tunables = environment.get("GLIBC_TUNABLES", "")
    if "x86_non_temporal_threshold" in tunables:
        return dict(environment)
    return {**environment, "GLIBC_TUNABLES": f"{tunables}:{STREAMING_COPIES}" if tunables else STREAMING_COPIES}


def host_id() -> str:
    """Names this host's shared memory: a worker maps a node's slots only when the node's id equals its own (the
    kernel's boot id, which every process of one running kernel shares, and the host name)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            boot = file.read().strip()
    except OSError:
        boot = ""
    return f"{os.uname().nodename}/{boot}"


class StoreSlots:
    def __init__(self, path: str, block_bytes: int, num_slots: int, owner: bool, num_rows: int = 1) -> None:
        if block_bytes <= 0 or num_slots <= 0 or num_rows <= 0 or block_bytes % num_rows:
            raise ValueError(f"store slots need block_bytes > 0 in num_rows > 0 equal rows and num_slots > 0, got "
                             f"{block_bytes}, {num_rows}, {num_slots}")
        self.path, self.block_bytes, self.num_slots, self.owner = path, block_bytes, num_slots, owner
        self.num_rows = num_rows
        self._mmap: mmap.mmap | None = map_shared_file(path, block_bytes * num_slots, owner, size_error=ValueError)
        self.buffer = memoryview(self._mmap)
        # [rows, slots, row bytes]
        self.rows = np.frombuffer(self.buffer, dtype=np.uint8).reshape(num_rows, num_slots, block_bytes // num_rows)
        # Owner only: a min-heap, so a chain stored at once gets ascending slots, mostly consecutive ones, which a
        # worker copies out in runs (one copy per run) where its device blocks are consecutive too.
        self._free = list(range(num_slots))

    @classmethod
    def create(cls, block_bytes: int, num_slots: int, num_rows: int = 1, directory: str = SHM_DIRECTORY) -> StoreSlots:
        # A node killed before it could unlink its file (SIGKILL, the OOM killer) left its DRAM in /dev/shm: gone now
        remove_stale_regions(directory, SHM_PREFIX)
        path = os.path.join(directory, f"{SHM_PREFIX}-{os.getpid()}-{secrets.token_hex(4)}")
        return cls(path, block_bytes, num_slots, owner=True, num_rows=num_rows)

    @classmethod
    def attach(cls, path: str, block_bytes: int, num_slots: int, num_rows: int = 1) -> StoreSlots:
        return cls(path, block_bytes, num_slots, owner=False, num_rows=num_rows)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free store slot: the policy core's DRAM capacity and the slots disagree")
        return heapq.heappop(self._free)

    def free(self, slot: int) -> None:
        heapq.heappush(self._free, slot)

    def write(self, slot: int, payload: bytes | memoryview) -> None:
        """A block's bytes (its rows in order) into the slot."""
        self.rows[:, slot] = np.frombuffer(payload, dtype=np.uint8).reshape(self.num_rows, -1)

    def read(self, slot: int) -> bytes:
        """The slot's block as bytes, its rows in order."""
        return self.rows[:, slot].tobytes()

    def close(self) -> None:
        """Unmap (and, for the owner, unlink: a worker's mapping stays valid until it closes its own)."""
        if self._mmap is None:
            return
        del self.rows
        self.buffer.release()
        try:
            self._mmap.close()
        except BufferError:
            pass  # a view handed out (a torch tensor over it) is still alive: the mapping goes with it
        self._mmap = None
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
