"""The wire's framing: `u32 little-endian header length | msgpack header | payload`, read and written with few syscalls.

Shared by both ends of the tcp and shm links (`transport_socket.py`) and their handshake: gathering and
scattering writes and reads of many buffers, one frame or a burst of them, and splitting a received burst
into whole frames. A header longer than its reader's limit is a FrameError, never an allocation.
"""

from __future__ import annotations

import socket
import struct

from kvbaton.transfer.codec import Frame, FrameError, decode, encode

HEADER_LENGTH = struct.Struct("<I")
MAX_HEADER_BYTES = 1 << 24
_MAX_IOVECS = 512  # buffers per sendmsg/recvmsg_into call, under every platform's IOV_MAX


def send_buffers(sock: socket.socket, buffers: list[memoryview]) -> None:
    """Write the buffers in order with gathering `sendmsg` calls (one syscall for many block runs)."""
    index = 0
    while index < len(buffers):
        num_sent = sock.sendmsg(buffers[index:index + _MAX_IOVECS])
        while index < len(buffers) and num_sent >= len(buffers[index]):
            num_sent -= len(buffers[index])
            index += 1
        if num_sent:
            buffers[index] = buffers[index][num_sent:]


def recv_into_buffers(sock: socket.socket, buffers: list[memoryview]) -> bool:
    """Fill the buffers in order with scattering `recvmsg_into` calls; False if the peer closed first."""
    index = 0
    buffers = [buffer for buffer in buffers if len(buffer)]
    while index < len(buffers):
        num_received = sock.recvmsg_into(buffers[index:index + _MAX_IOVECS])[0]
        if num_received == 0:
            return False
        while index < len(buffers) and num_received >= len(buffers[index]):
            num_received -= len(buffers[index])
            index += 1
        if num_received:
            buffers[index] = buffers[index][num_received:]
    return True


def send_frames(sock: socket.socket, frames: list[tuple[Frame, list[memoryview]]]) -> None:
    """Write frames with their payloads (flat byte views) in gathering writes."""
    buffers: list[memoryview] = []
    for frame, payload in frames:
        header = encode(frame)
        buffers.append(memoryview(HEADER_LENGTH.pack(len(header)) + header))
        buffers += payload
    send_buffers(sock, buffers)


def send_frame(sock: socket.socket, frame: Frame) -> None:
    send_frames(sock, [(frame, [])])


def recv_exact_into(sock: socket.socket, buffer: memoryview) -> bool:
    """Fill `buffer` from the socket; False if the peer closed the link first."""
    offset, size = 0, len(buffer)
    while offset < size:
        num = sock.recv_into(buffer[offset:])
        if num == 0:
            return False
        offset += num
    return True


def split_frames(data: bytearray, frames: list[Frame | None]) -> None:
    """Decode every complete frame at the start of `data` into `frames`, removing its bytes.

    A partial frame stays in `data` for the next read. A malformed frame raises FrameError after
    the frames before it were appended, so they are still delivered ahead of the lost link.
    """
    offset = 0
    try:
        while len(data) - offset >= HEADER_LENGTH.size:
            (length,) = HEADER_LENGTH.unpack_from(data, offset)
            if length > MAX_HEADER_BYTES:
                raise FrameError(f"frame header of {length} bytes")
            end = offset + HEADER_LENGTH.size + length
            if end > len(data):
                break
            frames.append(decode(bytes(data[offset + HEADER_LENGTH.size:end])))
            offset = end
    finally:
        del data[:offset]


def recv_frame(sock: socket.socket, max_bytes: int = MAX_HEADER_BYTES) -> Frame | None:
    """The next frame header (at most `max_bytes` long), or None when the peer closed the link."""
    prefix = bytearray(HEADER_LENGTH.size)
    if not recv_exact_into(sock, memoryview(prefix)):
        return None
    (length,) = HEADER_LENGTH.unpack(prefix)
    if length > max_bytes:
        raise FrameError(f"frame header of {length} bytes")
    header = bytearray(length)
    if not recv_exact_into(sock, memoryview(header)):
        return None
    return decode(bytes(header))
