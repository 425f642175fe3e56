"""KV links authenticate both ends before any byte can reach a block: a sender without the cluster secret, one that
skips the handshake and streams a chunk at once, a forged or replayed proof, a fake receiver, and a peer that
connects and stalls are each refused, while real links go on working (tcp and shm)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from kvbaton.core.cluster_secret import ClusterSecret
from kvbaton.transfer import TransferId
from kvbaton.transfer import transport_socket
from kvbaton.transfer.base import LinkAuthError, TransportError, storage_dtype
from kvbaton.transfer.codec import Challenge, Hello, Rejected, Welcome, decode, encode, layout_to_wire
from kvbaton.transfer.link_auth import LinkKey, new_nonce
from kvbaton.transfer.messages import LayerChunk
from kvbaton.transfer.transport_shm import ShmKVReceiver, ShmKVRegion, ShmKVSender
from kvbaton.transfer.framing import recv_frame, send_frame, send_frames
from kvbaton.transfer.transport_socket import SocketKVReceiver
from kvbaton.transfer.transport_tcp import TcpKVReceiver, TcpKVSender
from tests.transfer.transport_helpers import LAYOUT, NUM_BLOCKS, SECRET, wait_until

KINDS = ("tcp", "shm")


@contextmanager
def receiver_of(kind: str) -> Iterator[SocketKVReceiver]:
    """A decode end holding SECRET, its storage zeroed (so any byte that lands shows)."""
    if kind == "tcp":
        receiver: SocketKVReceiver = TcpKVReceiver("d0", LAYOUT, np.zeros(LAYOUT.storage_shape(NUM_BLOCKS),
                                                                         storage_dtype(LAYOUT)), secret=SECRET)
        region = None
    else:
        region = ShmKVRegion.create(LAYOUT, NUM_BLOCKS)
        receiver = ShmKVReceiver("d0", region, secret=SECRET)
    try:
        yield receiver
    finally:
        receiver.close()
        if region is not None:
            region.close()


def sender_of(kind: str, secret: ClusterSecret, name: str = "p0") -> TcpKVSender | ShmKVSender:
    return (TcpKVSender if kind == "tcp" else ShmKVSender)(name, LAYOUT, secret=secret)


def untouched(receiver: SocketKVReceiver) -> bool:
    return not receiver.kv.any() and receiver.poll(0.0) == [] and not receiver._links  # type: ignore[attr-defined]


def raw_connect(receiver: SocketKVReceiver) -> tuple[socket.socket, Challenge]:
    sock = socket.create_connection(receiver.address, timeout=5.0)
    challenge = recv_frame(sock)
    assert isinstance(challenge, Challenge) and len(challenge.nonce) == 16
    return sock, challenge


def closed_by_peer(sock: socket.socket, timeout_s: float = 5.0) -> bool:
    """Whether the other end closed (reads of what it sent first, e.g. a Rejected, are skipped)."""
    sock.settimeout(timeout_s)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass  # it closed with our bytes unread
    return True


def chunk_frame() -> LayerChunk:
    return LayerChunk(TransferId("stolen", 0), LAYOUT, 0, 0, 4, (0,), (0,))


@pytest.mark.parametrize("kind", KINDS)
def test_a_sender_without_the_secret_is_refused_and_a_real_one_links(kind: str) -> None:
    with receiver_of(kind) as receiver:
        intruder = sender_of(kind, ClusterSecret.generate(), "p-intruder")
        with pytest.raises(LinkAuthError, match="did not prove the cluster secret"):
            intruder.connect(receiver.address)
        wait_until(lambda: receiver.num_refused_links == 1, lambda: None)
        assert untouched(receiver)
        real = sender_of(kind, SECRET)
        try:
            assert real.connect(receiver.address) == "d0"
        finally:
            real.close()
            intruder.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_peer_that_skips_the_handshake_and_streams_kv_reaches_no_block(kind: str) -> None:
    with receiver_of(kind) as receiver:
        sock, _ = raw_connect(receiver)
        payload = [memoryview(np.full(LAYOUT.chunk_bytes(4), 0x7F, np.uint8))]  # a tcp chunk's bytes follow it
        send_frames(sock, [(chunk_frame(), payload)])
        assert closed_by_peer(sock)  # not a Hello: the link is closed, unread
        sock.close()
        wait_until(lambda: receiver.num_refused_links == 1, lambda: None)
        assert untouched(receiver)


@pytest.mark.parametrize("kind", KINDS)
def test_a_forged_or_replayed_proof_is_refused(kind: str) -> None:
    with receiver_of(kind) as receiver:
        fields = ["p-forger", *layout_to_wire(LAYOUT)]
        # Forged: a proof of the right length under no secret at all.
        sock, challenge = raw_connect(receiver)
        send_frame(sock, Hello("p-forger", LAYOUT, new_nonce(), bytes(32)))
        reply = recv_frame(sock)
        assert isinstance(reply, Rejected) and reply.kind == "auth"
        sock.close()
        # Replayed: a proof that was valid for another link's challenge.
        old_nonce, nonce_s = new_nonce(), new_nonce()
        recorded = LinkKey(SECRET).proof("hello", old_nonce, nonce_s, fields)
        sock, challenge = raw_connect(receiver)
        assert challenge.nonce != old_nonce
        send_frame(sock, Hello("p-forger", LAYOUT, nonce_s, recorded))
        reply = recv_frame(sock)
        assert isinstance(reply, Rejected) and reply.kind == "auth"
        sock.close()
        # Tampered: a valid proof, then another worker id or layout in the Hello it is sent with.
        sock, challenge = raw_connect(receiver)
        proof = LinkKey(SECRET).proof("hello", challenge.nonce, nonce_s, fields)
        send_frame(sock, Hello("p-other", LAYOUT, nonce_s, proof))
        reply = recv_frame(sock)
        assert isinstance(reply, Rejected) and reply.kind == "auth"
        sock.close()
        wait_until(lambda: receiver.num_refused_links == 3, lambda: None)
        assert untouched(receiver)


def test_a_sender_streams_nothing_to_a_receiver_that_cannot_prove_the_secret() -> None:
    """A fake decode end (it answers the handshake but holds no secret) is refused by the sender, which then
    cannot send it a single frame: no KV leaves for a listener that merely took the port."""
    listener = socket.create_server(("127.0.0.1", 0))
    sender = sender_of("tcp", SECRET)
    try:
        sender_thread_error: list[BaseException] = []
        import threading

        def fake_receiver() -> None:
            conn, _ = listener.accept()
            with conn:
                send_frame(conn, Challenge(new_nonce()))
                recv_frame(conn)
                send_frame(conn, Welcome("d0", NUM_BLOCKS, "", bytes(32)))
                conn.settimeout(2.0)
                try:
                    assert conn.recv(1) == b""  # the sender hung up without sending anything more
                except BaseException as exc:  # noqa: BLE001 - handed to the test thread
                    sender_thread_error.append(exc)

        thread = threading.Thread(target=fake_receiver)
        thread.start()
        with pytest.raises(LinkAuthError, match="did not prove the cluster secret"):
            sender.connect(listener.getsockname()[:2])
        thread.join(10.0)
        assert not sender_thread_error
        with pytest.raises(TransportError, match="no link to d0"):
            sender.send("d0", chunk_frame(), np.zeros(LAYOUT.storage_shape(1), storage_dtype(LAYOUT)))
    finally:
        sender.close()
        listener.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_peer_that_connects_and_stalls_is_dropped_without_holding_up_real_links(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transport_socket, "HANDSHAKE_TIMEOUT_S", 0.5)
    with receiver_of(kind) as receiver:
        silent, _ = raw_connect(receiver)  # says nothing after the challenge
        partial, _ = raw_connect(receiver)
        partial.sendall(b"\x40\x00\x00\x00\x92")  # a Hello header that never ends: the read waits for it
        oversized, _ = raw_connect(receiver)
        oversized.sendall(b"\x00\x00\x00\x10" + b"\x00" * 64)  # 256 MiB announced: refused at once
        started = time.monotonic()
        real = sender_of(kind, SECRET)
        try:
            assert real.connect(receiver.address) == "d0"
        finally:
            real.close()
        for sock in (silent, partial, oversized):
            assert closed_by_peer(sock)
            sock.close()
        assert time.monotonic() - started < 4.0
        wait_until(lambda: receiver.num_refused_links == 3, lambda: None)
        assert not receiver.kv.any()


def test_handshake_frames_round_trip() -> None:
    frames = [Challenge(b"n" * 16), Hello("p0", LAYOUT, b"s" * 16, b"p" * 32),
              Welcome("d0", 4, "/dev/shm/x", b"q" * 32), Rejected("no", "auth")]
    assert [decode(encode(frame)) for frame in frames] == frames
