"""The handoff messages' hot-path constructors build exactly what the dataclass constructors build."""

from __future__ import annotations

from dataclasses import fields

from kvbaton.transfer import destination
from kvbaton.transfer.destination import AdoptedKV
from kvbaton.transfer.fast_messages import (
    make_ack,
    make_first_token,
    make_layer_chunk,
    make_outgoing,
    make_reserve_granted,
    make_reserve_request,
    make_source_done,
    make_transfer_id,
)
from kvbaton.transfer.layout import KVLayout
from kvbaton.transfer.messages import (
    Ack,
    FirstToken,
    LayerChunk,
    Outgoing,
    ReserveGranted,
    ReserveRequest,
    SourceDone,
    TransferId,
)

LAYOUT = KVLayout(model_revision="m", dtype="float16", block_size=4, num_layers=2, num_kv_heads=1, head_dim=8)


def _same(built: object, expected: object) -> bool:
    return (type(built) is type(expected) and built == expected and hash(built) == hash(expected)
            and repr(built) == repr(expected)
            and [getattr(built, f.name) for f in fields(built)] == [getattr(expected, f.name) for f in fields(built)])


def test_each_builder_equals_its_constructor() -> None:
    tid = TransferId("r1", 0)
    first = FirstToken(9, -0.5, ((9, -0.5),), 4)
    src, dst = (1, 2), (7, 8)
    assert _same(make_transfer_id("r1"), tid) and make_transfer_id("r1", 2) == TransferId("r1", 2)
    assert make_transfer_id("a") < make_transfer_id("b")  # order=True still holds
    assert _same(make_first_token(9, -0.5, first.top_logprobs, 4), first)
    assert make_first_token(3, 0.0) == FirstToken(3, 0.0)
    assert _same(make_reserve_request(tid, LAYOUT, 8), ReserveRequest(tid, LAYOUT, 8))
    assert _same(make_layer_chunk(tid, LAYOUT, 1, 0, 8, src, dst), LayerChunk(tid, LAYOUT, 1, 0, 8, src, dst))
    assert _same(make_source_done(tid, 8, first), SourceDone(tid, 8, first))
    assert _same(make_reserve_granted(tid, dst), ReserveGranted(tid, dst))
    assert _same(make_ack(tid), Ack(tid))
    ack = Ack(tid)
    assert _same(make_outgoing("d0", ack), Outgoing("d0", ack))
    assert _same(destination._make_adopted(tid, dst, 8, first), AdoptedKV(tid, dst, 8, first))
