"""The store's disk tier: block files round-trip, and a corrupt, truncated, foreign or missing file is a miss."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbaton.transfer.store_disk import HEADER_BYTES, DiskBlockFiles

pytestmark = pytest.mark.timeout(30)

NS = ("rev", "layout", "")
PAYLOAD = bytes(range(256)) * 4


def _disk(tmp_path: Path) -> DiskBlockFiles:
    disk = DiskBlockFiles(tmp_path / "kv", capacity_blocks=8)
    disk.open()
    return disk


def test_round_trip_and_remove(tmp_path: Path) -> None:
    disk = _disk(tmp_path)
    disk.write(-5, NS, PAYLOAD)
    assert disk.num_files() == 1 and disk.path_of(-5).stat().st_size == HEADER_BYTES + len(PAYLOAD)
    assert disk.read(-5, NS, len(PAYLOAD)) == PAYLOAD
    disk.remove(-5)
    assert disk.num_files() == 0 and disk.num_corrupt_blocks == 0


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend"])
def test_damaged_file_is_a_miss_and_removed(tmp_path: Path, damage: str) -> None:
    disk = _disk(tmp_path)
    disk.write(7, NS, PAYLOAD)
    path = disk.path_of(7)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[HEADER_BYTES + 100] ^= 0x01
    elif damage == "truncate":
        del data[-10:]
    else:
        data += b"x"
    path.write_bytes(bytes(data))
    assert disk.read(7, NS, len(PAYLOAD)) is None
    assert not path.exists() and disk.num_corrupt_blocks == 1


def test_other_key_or_length_is_a_miss(tmp_path: Path) -> None:
    disk = _disk(tmp_path)
    disk.write(7, NS, PAYLOAD)
    assert disk.read(7, ("rev", "layout", "tenant-b"), len(PAYLOAD)) is None  # another tenant, same hash
    disk.write(7, NS, PAYLOAD)
    assert disk.read(7, NS, len(PAYLOAD) - 1) is None
    assert disk.read(8, NS, len(PAYLOAD)) is None  # never written
    assert disk.num_corrupt_blocks == 3


def test_open_empties_what_a_previous_node_left(tmp_path: Path) -> None:
    disk = _disk(tmp_path)
    disk.write(1, NS, PAYLOAD)
    (disk.directory / "0000000000000002.tmp").write_bytes(b"half")
    (disk.directory / "notes.txt").write_text("kept")
    _disk(tmp_path)
    assert sorted(p.name for p in disk.directory.iterdir()) == ["notes.txt"]
    assert disk.directory.stat().st_mode & 0o077 == 0
