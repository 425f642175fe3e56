"""Regressions found by bug hunting the KV transfer layer: malformed frames, dead links, unmappable regions.

Each test failed on the code it was written against; the fix it guards is named in its comment.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest

from kvbaton.transfer import Ack, LayerChunk, Outcome, TransferId
from kvbaton.transfer.base import LayoutRejectedError, PeerLost, TransportError
from kvbaton.transfer.codec import FrameError, decode, encode
from kvbaton.transfer.driver import pump_destination
from kvbaton.transfer.faults import FaultAction, FaultRule, FaultyTransport
from kvbaton.transfer.transport_inproc import create_inproc_pair
from kvbaton.transfer.transport_shm import ShmKVReceiver, ShmKVRegion, ShmKVSender
from tests.transfer.transport_helpers import LAYOUT, SECRET, Handoff, make_handoff, open_link, shm_files, wait_until

pytestmark = pytest.mark.timeout(30)

TID = TransferId("req-19", 0)
LAYOUT_FIELDS = ["rev-1", "float16", 4, 3, 2, 8]  # LAYOUT as the codec packs it


@pytest.fixture(autouse=True)
def no_leaked_shm() -> Iterator[None]:
    before = shm_files()
    yield
    assert shm_files() == before, "a shared-memory segment was left in /dev/shm"


def _send_raw(handoff: Handoff, frame: LayerChunk | list, payload_bytes: int) -> None:
    """Write one frame (a message, or raw msgpack fields) and a zero payload straight onto the prefill end's link."""
    sock = handoff.link.sender._links[handoff.link.peer].sock  # type: ignore[attr-defined]
    header = encode(frame) if isinstance(frame, LayerChunk) else msgpack.packb(frame, use_bin_type=True)
    sock.sendall(len(header).to_bytes(4, "little") + header + bytes(payload_bytes))


def _assert_link_still_serves(handoff: Handoff) -> None:
    """The receiver's reader thread is alive: a reservation over the link is still granted."""
    assert handoff.link.receiver._thread.is_alive()  # type: ignore[attr-defined]
    handoff.reserve(TransferId("after", 0), 4)
    assert handoff.source.state(TransferId("after", 0)).value == "streaming"


def test_tcp_receiver_refuses_a_chunk_for_a_layer_out_of_range_and_keeps_serving() -> None:
    # Was a bug (transfer/transport_tcp.py `TcpKVReceiver._receive_payload`): a chunk's layer index was not part of
    # "placeable", so a chunk for layer >= num_layers indexed the KV storage out of range inside the reader thread.
    # The IndexError killed the thread: every link of the decode worker went silent (no frame, no PeerLost), its
    # reservations sat until their leases ran out and no prefill worker could link again.
    # Fixed: such a chunk is consumed without placing its bytes and the protocol refuses it.
    with open_link("tcp") as link:
        handoff = make_handoff(link)
        src_blocks = tuple(handoff.src_pool.allocate(2))
        handoff.reserve(TID, 8)
        dst_blocks = handoff.source.dst_block_ids(TID)
        bad = LayerChunk(TID, LAYOUT, LAYOUT.num_layers, 0, 8, src_blocks, dst_blocks)
        _send_raw(handoff, bad, LAYOUT.chunk_bytes(8))
        wait_until(lambda: handoff.source.outcome(TID) is Outcome.FAILED, handoff.pump)
        assert handoff.destination.outcome(TID) is Outcome.FAILED
        assert "layer 3 out of range" in handoff.destination.reason(TID)
        # the source's answer to the abort is on its way: until it arrives, the blocks stay fenced
        assert handoff.destination.num_fenced_blocks == handoff.dst_pool.num_used_blocks == 2
        wait_until(lambda: handoff.destination.num_fenced_blocks == 0, handoff.pump)
        assert handoff.dst_pool.num_used_blocks == 0 and not np.any(link.dst_kv)
        _assert_link_still_serves(handoff)
        handoff.src_pool.release(src_blocks)


_TID = ["req-19", 0]
_CHUNK = ["chunk", _TID, LAYOUT_FIELDS, 0, 0, 4, [0, 1], [2, 1]]


@pytest.mark.parametrize("fields", [
    ["chunk", _TID, LAYOUT_FIELDS, "0", 0, 4, [0, 1], [2, 1]],  # layer index a string
    ["chunk", _TID, LAYOUT_FIELDS, 0, 0.0, 4, [0, 1], [2, 1]],  # first position a float
    ["chunk", _TID, LAYOUT_FIELDS, 0, 0, True, [0, 1], [2, 1]],  # token count a bool
    ["chunk", _TID, LAYOUT_FIELDS, 0, 0, 8, ["a", 1, "b", 1], [2, 1]],  # fragmented table of strings
    ["chunk", _TID, ["rev-1", "float16", 4.0, 3, 2, 8], 0, 0, 4, [0, 1], [2, 1]],  # block size a float
    ["chunk", [["req-19"], 0], LAYOUT_FIELDS, 0, 0, 4, [0, 1], [2, 1]],  # request id a list (unhashable)
    ["ack", [19, 0]],  # request id an int
    ["ack", ["req-19", "0"]],  # sample index a string
    ["reserve", _TID, LAYOUT_FIELDS, 8.0],  # token count a float
    ["reserve", _TID, [7, "float16", 4, 3, 2, 8], 8],  # model revision an int
    ["grant", _TID, "abc"],  # block table a string
    ["grant", _TID, [1, "2"]],
    ["done", _TID, "8", [7, -0.25, [], 0]],
    ["refuse", _TID, ["full"]],
    ["abort", _TID, "failed", None],
    ["hello", ["p0"], LAYOUT_FIELDS],
    ["welcome", "d0", "16", ""],
])
def test_decode_rejects_fields_of_the_wrong_type(fields: list) -> None:
    # Was a bug (transfer/codec.py `decode`): the docstring says decode rejects malformed fields, but only the tag,
    # the arity and the block runs were checked. A frame with a field of the wrong type decoded "fine" and crashed
    # whoever used it: a TypeError in the tcp receiver's reader thread (killing every link of the decode worker), or
    # in a protocol leg (an unhashable transfer id, a float block count) on the worker's own loop.
    # Fixed: every scalar field must have its exact type, block ids must be integers.
    assert decode(msgpack.packb(_CHUNK, use_bin_type=True)) == LayerChunk(
        TransferId("req-19", 0), LAYOUT, 0, 0, 4, (0,), (2,))
    with pytest.raises(FrameError):
        decode(msgpack.packb(fields, use_bin_type=True))


def test_tcp_receiver_drops_a_link_that_sends_a_mistyped_chunk_and_keeps_serving() -> None:
    # Same bug, end to end: a chunk whose first position is a string raised TypeError in the reader thread.
    # Fixed: the frame is malformed, so the link is dropped (PeerLost fails its legs at once) and the rest goes on.
    with open_link("tcp") as link:
        handoff = make_handoff(link)
        handoff.reserve(TID, 8)
        _send_raw(handoff, ["chunk", _TID, LAYOUT_FIELDS, 0, "0", 8, [0, 2], [2, 2]], LAYOUT.chunk_bytes(8))
        wait_until(lambda: handoff.destination.outcome(TID) is Outcome.FAILED, handoff.pump)
        assert "lost the link" in handoff.destination.reason(TID) and handoff.dst_pool.num_used_blocks == 0
        wait_until(lambda: handoff.source.outcome(TID) is Outcome.FAILED, handoff.pump)
        assert link.receiver._thread.is_alive()  # type: ignore[attr-defined]
        # the prefill worker links again and hands off as before
        link.sender.connect(link.receiver.address)  # type: ignore[attr-defined]
        _assert_link_still_serves(handoff)


def test_faulty_transport_loses_a_delayed_message_whose_link_died() -> None:
    # Was a bug (transfer/faults.py `FaultyTransport.flush`): a delayed message is sent by the first send/poll after
    # its due time; if its link had died meanwhile, the inner TransportError escaped from `poll` (which reports a
    # dead link as PeerLost and never raises), crashing the prefill worker's loop (server/worker_kv.PrefillLinks),
    # and from `send` of an unrelated message, which was then never sent.
    # Fixed: the held message is lost with its link, as a message in flight on a real link is.
    now = [0.0]
    src_end, dst_end = create_inproc_pair("p0", "d0", np.zeros(LAYOUT.storage_shape(2), np.float16))
    faulty = FaultyTransport(src_end, [FaultRule(FaultAction.DELAY, Ack, delay_s=1.0)], clock=lambda: now[0])
    faulty.send("d0", Ack(TID))
    faulty.disconnect("d0")
    now[0] = 2.0
    assert faulty.poll(0.0) == [PeerLost("d0", "link dropped")]
    assert dst_end.poll(0.0) == [PeerLost("p0", "link dropped")]
    with pytest.raises(TransportError, match="no link to d0"):
        faulty.send("d0", Ack(TID))
    faulty.close()
    dst_end.close()


def test_shm_sender_reports_an_unmappable_region_as_a_transport_error() -> None:
    # Was a bug (transfer/transport_shm.py `ShmKVSender._on_welcome`): when the region a decode worker offers cannot
    # be opened here (the decode worker runs on another host, or the file is gone), `connect` raised the raw
    # FileNotFoundError. Its callers (server/worker_kv.PrefillLinks.connect, engine/handoff_prefill
    # `PrefillHandoffs.submit`) catch TransportError only, so one misrouted handoff crashed the prefill worker.
    # Fixed: it is a TransportError like every other link failure (the handoff is reported failed).
    region = ShmKVRegion.create(LAYOUT, 4)
    receiver = ShmKVReceiver("d0", region, secret=SECRET)
    sender = ShmKVSender("p0", LAYOUT, secret=SECRET)
    try:
        os.unlink(region.path)  # as seen from a prefill worker that does not share this /dev/shm
        with pytest.raises(TransportError, match="cannot map d0's region") as caught:
            sender.connect(receiver.address)
        assert not isinstance(caught.value, LayoutRejectedError)
        assert sender.poll(0.0) == []
    finally:
        sender.close()
        receiver.close()
        region.close()


def test_a_mistyped_reservation_drops_the_link_instead_of_crashing_the_decode_loop() -> None:
    # The shm end of the codec fix: a reservation whose token count is a float reached
    # HandoffDestination._on_reserve and raised TypeError (from BlockPool.allocate) out of the decode worker's loop.
    # Fixed: the frame is malformed, the link is dropped and nothing is reserved.
    with open_link("shm") as link:
        handoff = make_handoff(link)
        _send_raw(handoff, ["reserve", _TID, LAYOUT_FIELDS, 8.0], 0)
        wait_until(lambda: not link.receiver._links,  # type: ignore[attr-defined]
                   lambda: pump_destination(link.receiver, handoff.destination, 0.0, 0.05))
        assert not handoff.destination.knows(TID) and handoff.dst_pool.num_used_blocks == 0
