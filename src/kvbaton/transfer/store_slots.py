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

**The slot index** (after the slots, in the same file): which block each slot holds, for a same-host worker to
copy blocks without asking the node first (an unleased read: no round trip, nothing pinned). Per slot a
generation, the block's hash and its namespace's tag (`namespace_tag`); and a table from block hash to slot (open
addressing, linear probing, at most half full, deletion by backward shift). One writer, the node: `publish` after
a slot's bytes are written (the generation goes from odd to even), `free` withdraws it first (even to odd), so a
slot's bytes change only while its generation is odd and every reuse moves it on. A reader (`lookup`) takes a
slot only at an even generation with the hash and tag it wants, copies, and keeps the copy only where
`still_held` finds the same generation after: a block the node moved or freed meanwhile is a miss, never a wrong
block. The table is a hint: a reader racing a deletion may miss an entry, which it then recomputes (or asks
the node for, when the node has blocks on disk). That ordering
rests on x86's stores and loads each staying in program order (glibc's streaming copies end with a store fence):
`UNLEASED_READS` says whether this machine is one; elsewhere workers acquire leases as before. The header holds
the node's pid and a closed flag, so a worker stops reading a node that stopped (`node_alive`), and how many
blocks the node has on disk (a chain the index stops may go on there: the worker asks the node for it then).
"""

from __future__ import annotations

import heapq
import mmap
import os
import platform
import secrets
from collections.abc import Sequence

import numpy as np

from kvbaton.cache.hashing import namespace_tag
from kvbaton.transfer.transport_shm import map_shared_file, remove_stale_regions

SHM_DIRECTORY = "/dev/shm"
SHM_PREFIX = "kvbaton-store"
UNLEASED_READS = platform.machine() in ("x86_64", "AMD64")  # the slot index's ordering holds here (module doc)
_INDEX_MAGIC = 0x6B7669647831  # "kvidx1"
_HEADER_WORDS = 5  # magic, number of buckets, the node's pid, closed, blocks on the node's disk


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
        self.num_buckets = 1 << max(1, (2 * num_slots - 1).bit_length())  # a power of two >= 2x the slots
        index_at = -(-block_bytes * num_slots // mmap.PAGESIZE) * mmap.PAGESIZE
        index_words = _HEADER_WORDS + 3 * num_slots + self.num_buckets
        self._mmap: mmap.mmap | None = map_shared_file(path, index_at + 8 * index_words, owner, size_error=ValueError)
        whole = memoryview(self._mmap)
        self.buffer = whole[: block_bytes * num_slots]
        # [rows, slots, row bytes]
        self.rows = np.frombuffer(self.buffer, dtype=np.uint8).reshape(num_rows, num_slots, block_bytes // num_rows)
        index = whole[index_at:]
        self._index = index
        words = index.cast("q")
        self._header = words[:_HEADER_WORDS]
        self._gens = index[8 * _HEADER_WORDS : 8 * (_HEADER_WORDS + num_slots)].cast("Q")
        self._hashes = words[_HEADER_WORDS + num_slots : _HEADER_WORDS + 2 * num_slots]
        self._tags = words[_HEADER_WORDS + 2 * num_slots : _HEADER_WORDS + 3 * num_slots]
        self._buckets = words[_HEADER_WORDS + 3 * num_slots :]  # slot + 1, 0 for an empty bucket
        words_array = np.frombuffer(index, dtype=np.int64)  # the same words for numpy (a lookup's first probes)
        self._gen_array = words_array[_HEADER_WORDS : _HEADER_WORDS + num_slots].view(np.uint64)
        self._hash_array = words_array[_HEADER_WORDS + num_slots : _HEADER_WORDS + 2 * num_slots]
        self._tag_array = words_array[_HEADER_WORDS + 2 * num_slots : _HEADER_WORDS + 3 * num_slots]
        self._bucket_array = words_array[_HEADER_WORDS + 3 * num_slots :]
        del words_array
        if owner:
            self._gen_array[:] = 1  # odd: no slot holds a block yet
            self._header[1], self._header[2], self._header[3], self._header[4] = self.num_buckets, os.getpid(), 0, 0
            self._header[0] = _INDEX_MAGIC
        elif self._header[0] != _INDEX_MAGIC or self._header[1] != self.num_buckets:
            self.close()
            raise ValueError(f"{path} holds no slot index of {self.num_buckets} buckets")
        # Owner only: a min-heap, so a chain stored at once gets ascending slots, mostly consecutive ones, which a
        # worker copies out in runs (one copy per run) where its device blocks are consecutive too.
        self._free = list(range(num_slots))
        self._published = 0

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
        """The slot holds no block from now on (withdrawn from the index first when it was published)."""
        if not self._gens[slot] & 1:
            self._withdraw(slot)
        heapq.heappush(self._free, slot)

    # ---- the slot index: the node writes ---------------------------------------------------------
    def publish(self, slot: int, block_hash: int, namespace: Sequence[str]) -> None:
        """The slot's bytes (written already) are the block `block_hash` of `namespace`: readers may take it."""
        assert self._gens[slot] & 1, "a slot published twice"
        self._hashes[slot] = block_hash
        self._tags[slot] = namespace_tag(namespace)
        self._gens[slot] += 1  # even: held (after its hash and tag, which a reader checks at this generation)
        mask = self.num_buckets - 1
        bucket = block_hash & mask
        while self._buckets[bucket]:
            bucket = (bucket + 1) & mask
        self._buckets[bucket] = slot + 1
        self._published += 1

    def _withdraw(self, slot: int) -> None:
        self._gens[slot] += 1  # odd: before anything else about the slot changes
        buckets, hashes, mask = self._buckets, self._hashes, self.num_buckets - 1
        hole = hashes[slot] & mask
        while buckets[hole] != slot + 1:
            hole = (hole + 1) & mask
        probe = hole
        while True:  # backward shift: every entry after the hole that may move into it does
            probe = (probe + 1) & mask
            entry = buckets[probe]
            if not entry:
                break
            home = hashes[entry - 1] & mask
            if (probe - home) & mask >= (probe - hole) & mask:
                buckets[hole] = entry  # its home is at or before the hole: it moves up (written there before
                hole = probe           # it leaves here; a reader already past the hole may miss it: a hint)
        buckets[hole] = 0
        self._published -= 1

    @property
    def num_disk_blocks(self) -> int:
        """Blocks the node holds on disk (the node sets it): a chain past DRAM may go on there, which only an
        acquire brings back; with none, a block the index lacks is one the node lacks."""
        return self._header[4]

    @num_disk_blocks.setter
    def num_disk_blocks(self, num: int) -> None:
        self._header[4] = num

    # ---- the slot index: a worker reads -----------------------------------------------------------
    def node_alive(self) -> bool:
        """The node that owns the file has not closed it and its process runs (on this host)."""
        if self._mmap is None or self._header[3]:
            return False
        try:
            os.kill(self._header[2], 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # alive, another user's (it would not share its file: 0600)
        return True

    def lookup(self, block_hashes: Sequence[int], namespace: Sequence[str]) -> tuple[list[int], list[int]]:
        """(slots, generations) of the leading blocks of the chain the index has in slots under `namespace`."""
        return self._lookup(block_hashes, namespace_tag(namespace))

    def _lookup(self, block_hashes: Sequence[int], tag: int) -> tuple[list[int], list[int]]:
        """The chain's first block found by a probe of the table; then, since a chain stored by one prefill lands in
        consecutive slots (the node assigns them lowest first, in chain order), the slots after it checked at once
        for the blocks after it (generations read first, then hashes and tags: those these generations published),
        a handful of numpy operations, what a load right after copying megabytes (its caches cold) waits on; from
        the first block that run does not hold on, the general probe (`_probe_chain`)."""
        num = len(block_hashes)
        if not num:
            return [], []
        first = self._probe(block_hashes[0])
        if first < 0:
            return [], []
        wanted = np.array(block_hashes, dtype=np.int64)
        end = min(num, self.num_slots - first)
        generations = self._gen_array[first : first + end].copy()  # read before the hashes and tags
        good = (((generations & 1) == 0) & (self._hash_array[first : first + end] == wanted[:end])
                & (self._tag_array[first : first + end] == tag))
        run = end if good.all() else int(np.argmin(good))
        slots, held = list(range(first, first + run)), generations[:run].tolist()
        if run < num:
            more, more_held = self._probe_chain(wanted[run:], tag)
            slots += more
            held += more_held
        return slots, held

    def _probe(self, block_hash: int) -> int:
        """The slot the table names for `block_hash` (a hint: its generation, hash and tag are checked after), or -1."""
        buckets, hashes, num_slots, mask = self._buckets, self._hashes, self.num_slots, self.num_buckets - 1
        bucket = block_hash & mask
        for _ in range(self.num_buckets):
            entry = buckets[bucket]
            if entry <= 0 or entry > num_slots:
                return -1
            if hashes[entry - 1] == block_hash:
                return entry - 1
            bucket = (bucket + 1) & mask
        return -1

    def _probe_chain(self, wanted: np.ndarray, tag: int) -> tuple[list[int], list[int]]:
        """The general lookup, the whole chain probed at once, a round per bucket step, each round over the blocks
        not settled yet: a block is found (its hash in the bucket's slot) or missing (an empty bucket first); then
        the slots found are checked at their generations, and the chain is the leading run of good ones."""
        num = len(wanted)
        mask, num_slots = self.num_buckets - 1, self.num_slots
        slots = np.full(num, -1, dtype=np.int64)
        position = wanted & mask
        pending = np.arange(num)
        for _ in range(self.num_buckets):
            entries = self._bucket_array[position[pending]]
            empty = (entries <= 0) | (entries > num_slots)
            candidates = np.where(empty, 0, entries - 1)
            hit = ~empty & (self._hash_array[candidates] == wanted[pending])
            slots[pending[hit]] = candidates[hit]
            pending = pending[~empty & ~hit]
            if not pending.size:
                break
            position[pending] = (position[pending] + 1) & mask
        found = slots >= 0
        chosen = np.where(found, slots, 0)
        generations = self._gen_array[chosen]  # then the hashes and tags again: those these generations published
        found &= ((generations & 1) == 0) & (self._hash_array[chosen] == wanted) & (self._tag_array[chosen] == tag)
        run = num if found.all() else int(np.argmin(found))
        return slots[:run].tolist(), generations[:run].tolist()

    def still_held(self, slots: Sequence[int], generations: Sequence[int]) -> int:
        """How many leading `slots` are at `generations` still (read after copying them: those copies are good)."""
        if not slots:
            return 0
        first, num = slots[0], len(slots)
        if slots[-1] == first + num - 1 and list(slots) == list(range(first, first + num)):
            now = self._gen_array[first : first + num]  # consecutive (the common case): a slice, no gather
        else:
            now = self._gen_array[np.asarray(slots, dtype=np.intp)]
        same = now == np.asarray(generations, dtype=np.uint64)
        return num if same.all() else int(np.argmin(same))

    def check_index(self, held: dict[int, int]) -> None:
        """The index publishes exactly `held` (block hash -> slot), each findable from its hash (owner's check)."""
        published = {self._hashes[s]: s for s in range(self.num_slots) if not self._gens[s] & 1}
        assert published == held, "the slot index and the node's slots disagree"
        assert self._published == len(held) == sum(1 for b in self._buckets if b), "the slot index miscounts"
        for block_hash, slot in held.items():
            assert self._lookup([block_hash], self._tags[slot])[0] == [slot], "an entry is unreachable"

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
        if self.owner:
            self._header[3] = 1  # closed: workers stop reading it
        del self.rows, self._gen_array, self._hash_array, self._tag_array, self._bucket_array
        for view in (self._header, self._gens, self._hashes, self._tags, self._buckets, self._index, self.buffer):
            try:
                view.release()
            except BufferError:
                pass  # exported still (a torch tensor over the slots): it goes with the mapping, below
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
