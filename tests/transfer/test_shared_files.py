"""`transport_shm.map_shared_file`, the one mapping of a shared-memory file behind the handoff's KV region
(`ShmKVRegion`) and the KV store's DRAM slots (`StoreSlots`): the owner creates the file for this user only and
sizes it, another process maps the same bytes, a wrong size is refused with each caller's own error, and a failed
owner leaves no file while an existing one is never touched."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kvbaton.transfer.base import TransportError
from kvbaton.transfer.layout import KVLayout
from kvbaton.transfer.store_slots import StoreSlots
from kvbaton.transfer.transport_shm import ShmKVRegion, map_shared_file

LAYOUT = KVLayout("rev", "float32", 4, 2, 2, 8)


def test_the_owner_creates_a_private_file_that_another_mapping_sees_written(tmp_path: Path) -> None:
    path = str(tmp_path / "shared")
    owner = map_shared_file(path, 8192, owner=True)
    try:
        mode = os.stat(path).st_mode
        assert stat.S_IMODE(mode) == 0o600 and os.stat(path).st_size == 8192
        other = map_shared_file(path, 8192, owner=False, populate=True)
        owner[100:104] = b"kvba"
        assert other[100:104] == b"kvba"  # MAP_SHARED: the same pages
        other.close()
    finally:
        owner.close()


def test_a_wrong_size_is_refused_with_each_callers_error_and_the_file_stays(tmp_path: Path) -> None:
    region = ShmKVRegion.create(LAYOUT, 8, directory=str(tmp_path))
    slots = StoreSlots.create(1024, 4, num_rows=2, directory=str(tmp_path))
    try:
        with pytest.raises(TransportError, match="expected"):
            ShmKVRegion.attach(region.path, LAYOUT, 9)
        # the slots' bytes, then their index (a page on, and 8 bytes a word): 4 slots' file, 5 asked for
        with pytest.raises(ValueError, match=f"{slots.path} holds {4096 + 8 * (5 + 3 * 4 + 8)} bytes, expected "
                                             f"{8192 + 8 * (5 + 3 * 5 + 16)}"):
            StoreSlots.attach(slots.path, 1024, 5, num_rows=2)
        assert os.path.exists(region.path) and os.path.exists(slots.path)  # only an owner removes its file
        attached = StoreSlots.attach(slots.path, 1024, 4, num_rows=2)
        slots.write(3, bytes(range(256)) * 4)
        assert attached.read(3) == bytes(range(256)) * 4
        attached.close()
    finally:
        region.close()
        slots.close()
    assert os.listdir(tmp_path) == []


def test_a_failed_owner_leaves_no_file_and_an_existing_file_is_not_touched(tmp_path: Path) -> None:
    path = tmp_path / "taken"
    path.write_bytes(b"someone else's")
    with pytest.raises(FileExistsError):
        map_shared_file(str(path), 4096, owner=True)
    assert path.read_bytes() == b"someone else's"
    with pytest.raises(ValueError):  # mmap refuses an empty mapping, after the file was created
        map_shared_file(str(tmp_path / "empty"), 0, owner=True)
    assert not (tmp_path / "empty").exists()
