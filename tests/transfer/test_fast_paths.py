"""The handoff hot path's shortcuts give exactly what the plain code gives: block runs, merged copies, framing."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbaton.transfer import LayerChunk, SourceDone, TransferId
from kvbaton.transfer.base import copy_chunk, copy_chunks, storage_dtype
from kvbaton.transfer.block_runs import flat_runs
from kvbaton.transfer.codec import FrameError, decode, encode
from kvbaton.transfer.framing import split_frames
from tests.transfer.helpers import FIRST, LAYOUT

TID = TransferId("req-3", 0)
NUM_BLOCKS = 12


def _slow_flat_runs(block_ids: tuple[int, ...], first: int, num: int, block_size: int) -> list[tuple[int, int]]:
    """Reference: one slot per position, merged when consecutive."""
    runs: list[tuple[int, int]] = []
    base = first - first % block_size
    for position in range(first, first + num):
        slot = block_ids[(position - base) // block_size] * block_size + position % block_size
        if runs and runs[-1][0] + runs[-1][1] == slot:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((slot, 1))
    return runs


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 7), st.integers(1, 20), st.integers(0, 5), st.booleans(), st.data())
def test_flat_runs_matches_a_slot_by_slot_reference(first: int, num: int, start_block: int, contiguous: bool,
                                                    data: st.DataObject) -> None:
    num_blocks = LAYOUT.num_blocks_for(first + num) - first // LAYOUT.block_size
    block_ids = (tuple(range(start_block, start_block + num_blocks)) if contiguous else
                 tuple(data.draw(st.permutations(range(num_blocks + 3)))[:num_blocks]))
    assert flat_runs(block_ids, first, num, LAYOUT.block_size) == _slow_flat_runs(
        block_ids, first, num, LAYOUT.block_size)


@pytest.mark.parametrize("block_ids", [(), (5,), (0, 1, 2, 3), (3, 4, 9, 10, 11, 2), (7, 7, 8), (9, 3, 1)])
def test_codec_round_trips_block_tables_as_runs(block_ids: tuple[int, ...]) -> None:
    chunk = LayerChunk(TID, LAYOUT, 1, 0, 4 * max(len(block_ids), 1), block_ids, block_ids)
    assert decode(encode(chunk)) == chunk


def test_a_contiguous_table_costs_the_same_bytes_whatever_its_length() -> None:
    short, long = (LayerChunk(TID, LAYOUT, 0, 0, 4 * n, tuple(range(n)), tuple(range(100, 100 + n))) for n in (2, 100))
    # Each table is one (first, count) run; only num_valid_tokens grows (8 -> 400: 1 -> 3 msgpack bytes).
    assert len(encode(long)) - len(encode(short)) == 2


def test_malformed_block_runs_are_frame_errors() -> None:
    good = encode(LayerChunk(TID, LAYOUT, 0, 0, 8, (4, 5), (6, 7)))
    for bad_runs in (b"\x93\x04\x02\x01", b"\x92\x04\x00"):  # odd length; a run of zero blocks
        with pytest.raises(FrameError):
            decode(good.replace(b"\x92\x04\x02", bad_runs, 1))


def _chunks(draw_ids: list[tuple[int, ...]], first: int, num: int) -> list[LayerChunk]:
    return [LayerChunk(TID, LAYOUT, layer, first, num, draw_ids[0], draw_ids[1]) for layer in range(LAYOUT.num_layers)]


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 7), st.integers(1, 16), st.booleans(), st.sampled_from([0, 2]), st.data())
def test_copy_chunks_merged_equals_one_copy_per_chunk(first: int, num: int, contiguous: bool, extra_dst_blocks: int,
                                                      data: st.DataObject) -> None:
    num_blocks = LAYOUT.num_blocks_for(first + num) - first // LAYOUT.block_size
    tables = [tuple(range(num_blocks)) if contiguous else
              tuple(data.draw(st.permutations(range(NUM_BLOCKS)))[:num_blocks]) for _ in range(2)]
    rng = np.random.default_rng(0)
    source = rng.integers(1, 1000, LAYOUT.storage_shape(NUM_BLOCKS)).astype(storage_dtype(LAYOUT))
    # Same-sized storages make consecutive planes adjacent on both sides (pieces merge across them).
    merged = np.zeros(LAYOUT.storage_shape(NUM_BLOCKS + extra_dst_blocks), storage_dtype(LAYOUT))
    one_by_one = np.zeros_like(merged)
    chunks = _chunks(tables, first, num)
    copy_chunks(chunks, source, merged)
    for chunk in chunks:
        copy_chunk(chunk, source, one_by_one)
    np.testing.assert_array_equal(merged, one_by_one)
    assert np.count_nonzero(merged) == LAYOUT.num_layers * 2 * num * LAYOUT.num_kv_heads * LAYOUT.head_dim


def test_split_frames_keeps_a_partial_frame_for_the_next_read() -> None:
    frames = [LayerChunk(TID, LAYOUT, 0, 0, 8, (1, 2), (3, 4)), SourceDone(TID, 8, FIRST)]
    wire = b"".join(struct.pack("<I", len(header)) + header for header in map(encode, frames))
    data, split = bytearray(wire[:-3]), []
    split_frames(data, split)
    assert split == frames[:1] and data == wire[4 + len(encode(frames[0])):-3]
    data += wire[-3:]
    split_frames(data, split)
    assert split == frames and data == bytearray()


def test_split_frames_keeps_the_frames_before_a_malformed_one() -> None:
    good = encode(SourceDone(TID, 8, FIRST))
    data, split = bytearray(struct.pack("<I", len(good)) + good + struct.pack("<I", 1 << 30)), []
    with pytest.raises(FrameError):
        split_frames(data, split)
    assert split == [SourceDone(TID, 8, FIRST)]

@pytest.mark.parametrize("num_dst_blocks", [3, 4])
def test_copy_chunks_merges_whole_planes_only_when_both_sides_are_adjacent(num_dst_blocks: int) -> None:
    # Tables covering every slot of a 3-block source: its planes follow each other in storage, and
    # the destination's do too only when it also holds exactly 3 blocks.
    source = np.arange(np.prod(LAYOUT.storage_shape(3))).astype(storage_dtype(LAYOUT)).reshape(
        LAYOUT.storage_shape(3)) + 1
    merged = np.zeros(LAYOUT.storage_shape(num_dst_blocks), storage_dtype(LAYOUT))
    one_by_one = np.zeros_like(merged)
    chunks = _chunks([(0, 1, 2), (0, 1, 2)], 0, 3 * LAYOUT.block_size)
    copy_chunks(chunks, source, merged)
    for chunk in chunks:
        copy_chunk(chunk, source, one_by_one)
    np.testing.assert_array_equal(merged, one_by_one)
    np.testing.assert_array_equal(merged[:, :, :3], source)
    assert not merged[:, :, 3:].any()
