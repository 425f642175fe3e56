"""The store's DRAM slots' helpers: the host id that decides who maps them, and the streaming-copy environment a
worker with a store runs under, and the sweep of slots a killed node left."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from kvbaton.transfer.store_slots import STREAMING_COPIES, StoreSlots, host_id, with_streaming_copies

LOADER = "/lib64/ld-linux-x86-64.so.2"


def test_the_host_id_is_the_same_in_every_process_of_this_host() -> None:
    child = subprocess.run([sys.executable, "-c", "from kvbaton.transfer.store_slots import host_id; print(host_id())"],
                           capture_output=True, text=True, timeout=60, check=True,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert child.stdout.strip() == host_id() and host_id().startswith(os.uname().nodename + "/")


def test_streaming_copies_join_the_tunables_without_overriding_a_threshold_set() -> None:
    assert with_streaming_copies({})["GLIBC_TUNABLES"] == STREAMING_COPIES
    joined = with_streaming_copies({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "X": "1"})
    assert joined == {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{STREAMING_COPIES}", "X": "1"}
    own = {"GLIBC_TUNABLES": "glibc.cpu.x86_non_temporal_threshold=0x100000"}
    assert with_streaming_copies(own) == own


@pytest.mark.skipif(platform.machine() != "x86_64" or not Path(LOADER).exists(), reason="glibc's x86-64 loader")
def test_glibc_applies_the_threshold_in_a_process_started_with_them() -> None:
    """glibc's loader lists the tunables it would run a program with: 256 KiB with them, its own default without (on
    this host 0x28e0000, 43 MB: a load's 768 KB rows would copy with ordinary stores)."""
    def threshold(environment: dict[str, str]) -> str:
        listed = subprocess.run([LOADER, "--list-tunables"], capture_output=True, text=True, timeout=60,
                                env=environment).stdout
        return next(line for line in listed.splitlines() if "x86_non_temporal_threshold" in line).split()[1]
    plain = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    assert threshold(with_streaming_copies(plain)) == "0x40000"
    assert threshold(plain) != "0x40000"


def test_a_new_node_removes_the_slots_a_killed_node_left(tmp_path: Path) -> None:
    """A node killed before it could unlink its DRAM file (SIGKILL) leaves it in /dev/shm, memory no one frees; the
    next node created on the host removes it, and leaves the live ones (this process's) and the KV links' alone."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    stale = tmp_path / f"kvbaton-store-{dead.pid}-0a1b2c3d"
    live = tmp_path / f"kvbaton-store-{os.getpid()}-0a1b2c3d"
    other = tmp_path / f"kvbaton-kv-{dead.pid}-0a1b2c3d"  # a KV link's: its own sweep's
    for path in (stale, live, other):
        path.write_bytes(b"")
    slots = StoreSlots.create(64, 4, directory=str(tmp_path))
    try:
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name, Path(slots.path).name])
    finally:
        slots.close()
