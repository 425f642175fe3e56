"""Every transport moves exactly the chunk's KV into the reserved blocks and carries the protocol end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbaton.transfer import (
    Abort,
    AbortCause,
    Ack,
    DestinationState,
    LayerChunk,
    Outcome,
    ReserveGranted,
    ReserveRefused,
    ReserveRequest,
    SourceDone,
    TransferId,
)
from kvbaton.transfer.base import LayoutRejectedError, PeerLost, TransportError
from kvbaton.transfer.block_runs import flat_runs, paired_runs
from kvbaton.transfer.codec import Hello, decode, encode
from kvbaton.transfer.driver import send_all
from kvbaton.transfer.transport_shm import ShmKVRegion, remove_stale_regions
from kvbaton.transfer.transport_tcp import TcpKVSender
from tests.transfer.transport_helpers import (
    FIRST,
    KINDS,
    LAYOUT,
    NUM_BLOCKS,
    SECRET,
    assert_kv_equal,
    make_handoff,
    open_link,
    shm_files,
    wait_until,
)

TID = TransferId("req-7", 1)


@pytest.fixture(autouse=True)
def no_leaked_shm() -> Iterator[None]:
    before = shm_files()
    yield
    assert shm_files() == before, "a shared-memory segment was left in /dev/shm"


def test_flat_runs_merge_consecutive_blocks_and_pair_across_fragmentation() -> None:
    assert flat_runs((3, 4, 9), 2, 9, 4) == [(14, 6), (36, 3)]  # positions 2..10: slots 14..19, 36..38
    assert paired_runs([(14, 6), (36, 3)], [(0, 3), (40, 6)]) == [(14, 0, 3), (17, 40, 3), (36, 43, 3)]


def test_codec_round_trips_every_frame() -> None:
    frames = [ReserveRequest(TID, LAYOUT, 9), LayerChunk(TID, LAYOUT, 2, 4, 5, (3, 1), (8, 0)),
              SourceDone(TID, 9, replace(FIRST, top_logprobs=((7, -0.25), (1, -2.0)))),
              ReserveGranted(TID, (5, 2, 7)), ReserveRefused(TID, "full"), Ack(TID),
              Abort(TID, AbortCause.EXPIRED, "late"), Hello("p0", LAYOUT)]
    assert [decode(encode(frame)) for frame in frames] == frames


@pytest.mark.parametrize("kind", KINDS)
def test_full_handoff_lands_exact_kv_in_fragmented_blocks(kind: str) -> None:
    with open_link(kind) as link:
        handoff = make_handoff(link)
        src_blocks = tuple(handoff.src_pool.allocate(LAYOUT.num_blocks_for(11)))
        handoff.reserve(TID, 11)
        dst_blocks = handoff.source.dst_block_ids(TID)
        assert len(dst_blocks) == 3 and dst_blocks != tuple(range(dst_blocks[0], dst_blocks[0] + 3))
        for layer in range(LAYOUT.num_layers):  # chunked prefill: [0, 6) then [6, 11), mid-block
            handoff.stream_layer(TID, layer, 0, 6, src_blocks)
            handoff.stream_layer(TID, layer, 6, 5, src_blocks)
        send_all(link.sender, handoff.source.finish(TID, FIRST, handoff.now))
        wait_until(lambda: handoff.source.outcome(TID) is Outcome.COMPLETED, handoff.pump)
        assert handoff.destination.state(TID) is DestinationState.COMPLETE
        assert_kv_equal(handoff, src_blocks, dst_blocks, 11, range(LAYOUT.num_layers))
        untouched = sorted(set(range(NUM_BLOCKS)) - set(dst_blocks))
        assert not link.dst_kv[:, :, untouched].any(), "bytes landed outside the reserved blocks"
        adopted = handoff.destination.adopt(TID, handoff.now)
        assert adopted.first_token == FIRST and adopted.block_ids == dst_blocks
        handoff.src_pool.release(src_blocks)
        handoff.dst_pool.release(adopted.block_ids)
        assert handoff.src_pool.num_used_blocks == 0 and handoff.dst_pool.num_used_blocks == 0


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_mismatched_layout_is_refused_at_registration(kind: str) -> None:
    with open_link(kind) as link:
        other = TcpKVSender("p1", replace(LAYOUT, head_dim=16), secret=SECRET)
        address = link.receiver.address
        with pytest.raises(LayoutRejectedError, match="head_dim 16 != expected 8"):
            other.connect(address)
        other.close()


def test_shm_region_is_shared_between_mappings_and_viewable_as_torch() -> None:
    region = ShmKVRegion.create(LAYOUT, 2)
    attached = ShmKVRegion.attach(region.path, LAYOUT, 2)
    try:
        attached.kv[1, 0, 1, 2] = 3.0
        assert region.kv[1, 0, 1, 2, 0, 0] == 3.0
        tensor = region.torch_view()
        assert tuple(tensor.shape) == LAYOUT.storage_shape(2) and float(tensor[1, 0, 1, 2, 1, 7]) == 3.0
        del tensor
    finally:
        attached.close()
        region.close()


@pytest.mark.parametrize("kind", KINDS)
def test_disconnect_reports_peer_lost_on_both_ends_and_sends_then_fail(kind: str) -> None:
    with open_link(kind) as link:
        link.sender.disconnect(link.peer)
        lost_at_receiver = []
        wait_until(lambda: lost_at_receiver, lambda: lost_at_receiver.extend(link.receiver.poll(0.05)))
        assert lost_at_receiver == [PeerLost("p0", lost_at_receiver[0].reason)]
        assert [type(e) for e in link.sender.poll(0.0)] == [PeerLost]
        with pytest.raises(TransportError):
            link.sender.send(link.peer, Ack(TID))


def test_tcp_chunk_with_unplaceable_handles_is_consumed_and_refused_by_the_protocol() -> None:
    with open_link("tcp") as link:
        handoff = make_handoff(link)
        src_blocks = tuple(handoff.src_pool.allocate(2))
        handoff.reserve(TID, 8)
        bogus = LayerChunk(TID, LAYOUT, 0, 0, 8, src_blocks, (NUM_BLOCKS + 3, NUM_BLOCKS + 4))
        link.sender.send(link.peer, bogus, handoff.src_kv)
        wait_until(lambda: handoff.source.outcome(TID) is Outcome.FAILED, handoff.pump)
        assert "not the reserved ones" in handoff.destination.reason(TID)
        # fenced until the source's answer to the abort arrives (it may have been writing into the blocks)
        assert handoff.destination.num_fenced_blocks == handoff.dst_pool.num_used_blocks == 2
        wait_until(lambda: handoff.destination.num_fenced_blocks == 0, handoff.pump)
        assert handoff.dst_pool.num_used_blocks == 0 and not np.any(link.dst_kv)
        handoff.src_pool.release(src_blocks)
        # the stream is still in step: a new transfer on the same link works
        handoff.reserve(TransferId("req-8"), 4)
        assert handoff.source.state(TransferId("req-8")).value == "streaming"


@pytest.mark.parametrize("kind", KINDS)
def test_send_many_delivers_every_layer_and_the_done_in_one_write(kind: str) -> None:
    with open_link(kind) as link:
        handoff = make_handoff(link, seed=3)
        src_blocks = tuple(handoff.src_pool.allocate(2))
        handoff.reserve(TID, 7)
        messages = [handoff.source.stream(TID, layer, 0, 7, src_blocks, 0.0).message
                    for layer in range(LAYOUT.num_layers)]
        messages.append(handoff.source.finish(TID, FIRST, 0.0).message)
        link.sender.send_many(link.peer, messages, handoff.src_kv)
        wait_until(lambda: handoff.source.outcome(TID) is Outcome.COMPLETED, handoff.pump)
        assert_kv_equal(handoff, src_blocks, handoff.source.dst_block_ids(TID), 7, range(LAYOUT.num_layers))
        handoff.src_pool.release(src_blocks)
        handoff.dst_pool.release(handoff.destination.adopt(TID, 0.0).block_ids)


def test_regions_left_by_a_killed_decode_worker_are_removed(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    stale = tmp_path / f"kvbaton-kv-{dead.pid}-0a1b2c3d"
    live = tmp_path / f"kvbaton-kv-{os.getpid()}-0a1b2c3d"
    stale.write_bytes(b"")
    live.write_bytes(b"")
    assert remove_stale_regions(str(tmp_path)) == [stale.name]
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name]


def _slot_by_slot(block_ids: tuple[int, ...], first: int, num: int, block_size: int) -> list[int]:
    return [block_ids[p // block_size - first // block_size] * block_size + p % block_size
            for p in range(first, first + num)]


@settings(max_examples=200, deadline=None)
@given(data=st.data(), block_size=st.sampled_from([1, 2, 4, 16]), first=st.integers(0, 40),
       num=st.integers(1, 60))
def test_runs_cover_exactly_the_slots_of_the_positions(data: st.DataObject, block_size: int, first: int,
                                                       num: int) -> None:
    num_blocks = -(-(first + num) // block_size) - first // block_size
    ids = st.lists(st.integers(0, 3 * num_blocks), min_size=num_blocks, max_size=num_blocks, unique=True)
    src, dst = tuple(data.draw(ids)), tuple(data.draw(ids))
    src_runs, dst_runs = flat_runs(src, first, num, block_size), flat_runs(dst, first, num, block_size)
    assert [s + i for s, n in src_runs for i in range(n)] == _slot_by_slot(src, first, num, block_size)
    assert all(a + n != b for (a, n), (b, _) in zip(src_runs, src_runs[1:])), "adjacent runs were not merged"
    pieces = paired_runs(src_runs, dst_runs)
    assert [(s + i, d + i) for s, d, n in pieces for i in range(n)] == list(
        zip(_slot_by_slot(src, first, num, block_size), _slot_by_slot(dst, first, num, block_size)))
