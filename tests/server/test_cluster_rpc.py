"""Round trips of every router <-> worker message, and rejection of malformed frames."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbaton.core.step import SampledToken
from kvbaton.cache.events import KVEvent, KVEventKind
from kvbaton.core.sampling import SamplingParams
from kvbaton.engine.structured import grammar_for
from kvbaton.server import rpc
from kvbaton.server.base import TokenDelta
from kvbaton.server.identity import ClusterIdentity, incompatibility, tokenizer_probe_hash

STORED = KVEvent(3, KVEventKind.STORED, (11, -22), parent_hash=-5, block_size=16).to_wire()
EVICTED = KVEvent(4, KVEventKind.EVICTED, (-22,), block_size=16).to_wire()

MESSAGES: list[rpc.Message] = [
    rpc.Register("w0", "mixed", "tiny-random", "rev1", "llama-L2-bs16", 16, 512, "abcd", 1234),
    rpc.TokenDeltas("w0", (
        TokenDelta("r1", (5, 6), "hi", False, None, 7, 3, (SampledToken(5, -0.5, ((5, -0.5), (9, -1.25))),
                                                           SampledToken(6, -0.1)), "", "w0"),
        TokenDelta("r2", (), "", True, "error", 4, 0, (), "no room", "w0", {"transfer_bytes": 10.0}),
    )),
    rpc.Stats("w0", 1, 2, 30, 40, 50, 6, 700, 300, 0, 99, 12.5, ""),
    rpc.Stats("w1", 0, 0, 0, 8, 56, 8, 0, 0, 0, 0, 0.0, "idle engine holds 9 blocks"),
    rpc.KVEvents("w0", (STORED, EVICTED)),
    rpc.Heartbeat(rpc.KVEvents("w0", (STORED, EVICTED)), rpc.Stats("w0", 1, 2, 30, 40, 50, 6, 700, 300, 0, 99, 12.5)),
    rpc.SnapshotResponse("w0", 4, (STORED,)),
    rpc.SnapshotResponse("w0", 0, ()),
    rpc.Goodbye("w0", "shutdown: bye"),
    rpc.AddRouter("tcp://127.0.0.1:5599"),
    rpc.StoreNodesKnown("tcp://127.0.0.1:6001,tcp://10.0.0.2:6001"),
    rpc.RegisterAck("w0", "preble", 0.05),
    rpc.RegisterRefuse("w0", "KV layout differs"),
    rpc.RegisterAgain("w0"),
    rpc.AddRequest("r1", (1, 2, 3), SamplingParams(max_tokens=4, temperature=0.0, stop=("x",), seed=7, logprobs=2),
                   "tenant-a", "gold"),
    rpc.AddRequest("r2", (9,), SamplingParams()),
    rpc.AddRequest("r5", (9,), SamplingParams(presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.2,
                                              logit_bias=((3, -100.0), (7, 2.5)), min_p=0.05, min_tokens=3,
                                              grammar=grammar_for("regex", "[ab]+"), priority=-3)),
    rpc.AddRequest("r3", (9, 8), SamplingParams(), "", "default", "", "d0", "shm://127.0.0.1:5601", "fail"),
    rpc.AddRequest("r4", (9, 8), SamplingParams(), "", "default", "p0", "", "", "recompute"),
    rpc.HandoffEnded("p0", "r3", "d0", "refused", "need 4 KV blocks, 1 free"),
    rpc.HandoffFailed("r3", "lost the link to d0", False),
    rpc.Register("d0", "decode", "tiny-random", "rev1", "llama-L2-bs16", 16, 512, "abcd", 99, "shm://127.0.0.1:5601"),
    rpc.Register("p1", "prefill", "tiny-random", "rev1", "llama-L2-bs16", 16, 512, "abcd", 98, "", "host-a", 2, 3),
    rpc.Stats("p0", 0, 0, 0, 8, 56, 8, 0, 0, 0, 0, 0.0, "", 3, 2, 1, 1, 0, 0, 4096, 0.25, 0.01, 1, 4),
    rpc.Abort(("r1", "r2")),
    rpc.SnapshotRequest("kv event seq gap"),
    rpc.ResetPrefixCache("reset requested through the API"),
    rpc.Ping(3.25),
    rpc.Alive("w0"),
    rpc.Shutdown("router shutting down"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message: rpc.Message) -> None:
    decoded = rpc.decode(rpc.encode(message))
    assert decoded == message
    assert type(decoded) is type(message)


def test_every_message_type_is_covered() -> None:
    assert {type(m) for m in MESSAGES} == set(rpc._BY_TAG.values())


def test_kv_events_survive_the_wire() -> None:
    decoded = rpc.decode(rpc.encode(rpc.KVEvents("w0", (STORED, EVICTED))))
    assert isinstance(decoded, rpc.KVEvents)
    assert [KVEvent.from_wire(e) for e in decoded.events] == [
        KVEvent(3, KVEventKind.STORED, (11, -22), -5, 16), KVEvent(4, KVEventKind.EVICTED, (-22,), None, 16)]


@pytest.mark.parametrize("payload, match", [
    (b"\xc1", "not msgpack"),
    (msgpack.packb({"tag": "ping"}), "non-empty array"),
    (msgpack.packb(["teleport", 1]), "unknown message tag"),
    (msgpack.packb(["ping"]), "ping has 0 fields"),
    (msgpack.packb(["add", "r1", [1], [0, 1.0, 1.0, 0, None, [], [], False, None, 1], "", "default"]),
     "malformed add"),
    (msgpack.packb(["deltas", "w0", [["r1"]]]), "malformed deltas"),
])
def test_malformed_frames_are_rejected(payload: bytes, match: str) -> None:
    with pytest.raises(rpc.ProtocolError, match=match):
        rpc.decode(payload)


@settings(max_examples=60, deadline=None)
@given(
    token_ids=st.lists(st.integers(0, 2**33), max_size=40),  # beyond uint32 too: the array fallback
    text=st.text(max_size=30),
    max_tokens=st.integers(1, 4096),
    temperature=st.floats(0.0, 2.0),
    seed=st.none() | st.integers(-(2**63), 2**63 - 1),
    stop=st.lists(st.text(min_size=1, max_size=5), max_size=3),
)
def test_add_and_delta_round_trip_any_values(token_ids: list[int], text: str, max_tokens: int, temperature: float,
                                             seed: int | None, stop: list[str]) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, stop=tuple(stop))
    add = rpc.AddRequest("r", tuple(token_ids) or (0,), params, text)
    assert rpc.decode(rpc.encode(add)) == add
    delta = TokenDelta("r", tuple(token_ids), text, True, "stop", len(token_ids), 0)
    assert rpc.decode(rpc.encode(rpc.TokenDeltas("w", (delta,)))) == rpc.TokenDeltas("w", (delta,))


def test_prompt_ids_travel_as_uint32_bytes_and_fall_back_to_an_array() -> None:
    sampling = SamplingParams(max_tokens=4)
    packed = msgpack.unpackb(rpc.encode(rpc.AddRequest("r", (1, 2**32 - 1, 49151), sampling)))
    assert packed[2] == (1).to_bytes(4, "little") + (2**32 - 1).to_bytes(4, "little") + (49151).to_bytes(4, "little")
    for ids in [(2**32, 5), (-1, 5)]:  # outside uint32: a plain array, same ids back
        add = rpc.AddRequest("r", ids, sampling)
        assert msgpack.unpackb(rpc.encode(add))[2] == list(ids)
        assert rpc.decode(rpc.encode(add)) == add
    with pytest.raises(rpc.ProtocolError, match="multiple of 4"):
        rpc.decode(msgpack.packb(["add", "r", b"\x01\x00\x00", rpc.sampling_to_wire(sampling), "", "default", "",
                                  "", "", "recompute"]))


class _SplitEncoder:
    def __init__(self, split_digits: bool) -> None:
        self.split_digits = split_digits

    def encode(self, text: str) -> list[int]:
        ids = [ord(c) for c in text]
        return [i for i in ids if not (self.split_digits and 48 <= i <= 57)]


def test_probe_hash_tells_tokenizers_apart() -> None:
    assert tokenizer_probe_hash(_SplitEncoder(False)) == tokenizer_probe_hash(_SplitEncoder(False))
    assert tokenizer_probe_hash(_SplitEncoder(False)) != tokenizer_probe_hash(_SplitEncoder(True))


def test_incompatibility_names_the_difference() -> None:
    base = ClusterIdentity("rev", "layout-a", 16, "h1")
    assert incompatibility(base, base) == ""
    assert "KV layout" in incompatibility(base, ClusterIdentity("rev", "layout-b", 16, "h1"))
    assert "revision" in incompatibility(base, ClusterIdentity("rev2", "layout-a", 16, "h1"))
    assert "block size" in incompatibility(base, ClusterIdentity("rev", "layout-a", 32, "h1"))
    assert "tokenize" in incompatibility(base, ClusterIdentity("rev", "layout-a", 16, "h2"))
    assert incompatibility(ClusterIdentity("rev", "layout-a", 16, ""), ClusterIdentity("rev", "layout-a", 16, "h2")) == ""
