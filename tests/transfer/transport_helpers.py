"""Factories for transport tests: linked sender/receiver pairs of each kind, KV storage, a handoff runner."""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from kvbaton.cache.block_pool import BlockPool
from kvbaton.core.cluster_secret import ClusterSecret
from kvbaton.transfer import FirstToken, HandoffDestination, HandoffSource, KVLayout, TransferId
from kvbaton.transfer.base import KVTransport, storage_dtype
from kvbaton.transfer.driver import pump_destination, pump_source, send_all
from kvbaton.transfer.transport_inproc import create_inproc_pair
from kvbaton.transfer.transport_shm import SHM_DIRECTORY, SHM_PREFIX, ShmKVReceiver, ShmKVRegion, ShmKVSender
from kvbaton.transfer.transport_tcp import TcpKVReceiver, TcpKVSender

SECRET = ClusterSecret(b"kvbaton transfer tests' secret!")  # what both ends of a test link hold
LAYOUT = KVLayout("rev-1", "float16", block_size=4, num_layers=3, num_kv_heads=2, head_dim=8)
NUM_BLOCKS = 16
KINDS = ("inproc", "tcp", "shm")
FIRST = FirstToken(7, -0.25)


def random_kv(layout: KVLayout, num_blocks: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal(layout.storage_shape(num_blocks)).astype(storage_dtype(layout))


def shm_files() -> set[str]:
    return set(glob.glob(os.path.join(SHM_DIRECTORY, f"{SHM_PREFIX}-{os.getpid()}-*")))


@dataclass
class Link:
    sender: KVTransport
    receiver: KVTransport
    dst_kv: np.ndarray
    peer: str  # the receiver's id, as the sender addresses it


@contextmanager
def open_link(kind: str, layout: KVLayout = LAYOUT, num_blocks: int = NUM_BLOCKS) -> Iterator[Link]:
    """A connected (prefill "p0", decode "d0") pair; everything it opened is closed afterwards."""
    region = None
    if kind == "inproc":
        dst_kv = np.zeros(layout.storage_shape(num_blocks), storage_dtype(layout))
        sender, receiver = create_inproc_pair("p0", "d0", dst_kv)
    elif kind == "tcp":
        dst_kv = np.zeros(layout.storage_shape(num_blocks), storage_dtype(layout))
        receiver = TcpKVReceiver("d0", layout, dst_kv, secret=SECRET)
        sender = TcpKVSender("p0", layout, secret=SECRET)
        sender.connect(receiver.address)
    else:
        region = ShmKVRegion.create(layout, num_blocks)
        dst_kv = region.kv
        receiver = ShmKVReceiver("d0", region, secret=SECRET)
        sender = ShmKVSender("p0", layout, secret=SECRET)
        sender.connect(receiver.address)
    try:
        yield Link(sender, receiver, dst_kv, "d0")
    finally:
        sender.close()
        receiver.close()
        if region is not None:
            del dst_kv
            region.close()


def wait_until(condition: Callable[[], bool], step: Callable[[], object], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        step()


@dataclass
class Handoff:
    """Both protocol legs of one link plus their pools and the prefill worker's KV."""

    link: Link
    source: HandoffSource
    destination: HandoffDestination
    src_pool: BlockPool
    dst_pool: BlockPool
    src_kv: np.ndarray
    now: float = 0.0

    def pump(self, timeout_s: float = 0.01) -> None:
        pump_destination(self.link.receiver, self.destination, self.now, timeout_s)
        pump_source(self.link.sender, self.source, self.now, timeout_s)

    def reserve(self, tid: TransferId, num_tokens: int) -> None:
        send_all(self.link.sender, self.source.start(tid, self.link.peer, num_tokens, self.now))
        wait_until(lambda: self.source.state(tid).value != "reserving", self.pump)

    def stream_layer(self, tid: TransferId, layer: int, first: int, num: int, src_blocks: tuple[int, ...]) -> None:
        blocks = LAYOUT.block_range(first, num)
        chunk = self.source.stream(tid, layer, first, num, src_blocks[blocks.start:blocks.stop], self.now)
        self.link.sender.send(chunk.peer, chunk.message, self.src_kv)


def make_handoff(link: Link, lease_s: float = 5.0, seed: int = 0) -> Handoff:
    src_pool, dst_pool = BlockPool(NUM_BLOCKS), BlockPool(NUM_BLOCKS)
    rng = np.random.default_rng(seed)
    for pool in (src_pool, dst_pool):  # scramble both free queues: block tables are fragmented
        held = pool.allocate(NUM_BLOCKS)
        pool.release([int(b) for b in rng.permutation(held)])
    return Handoff(link, HandoffSource(LAYOUT, src_pool, lease_s), HandoffDestination(LAYOUT, dst_pool, lease_s),
                   src_pool, dst_pool, random_kv(LAYOUT, NUM_BLOCKS, seed + 1))


def assert_kv_equal(handoff: Handoff, src_blocks: tuple[int, ...], dst_blocks: tuple[int, ...],
                    num_tokens: int, layers: range) -> None:
    """The destination holds exactly the source's KV at every valid position of `layers`."""
    for layer in layers:
        for position in range(num_tokens):
            block, slot = divmod(position, LAYOUT.block_size)
            expected = handoff.src_kv[layer, :, src_blocks[block], slot]
            np.testing.assert_array_equal(handoff.link.dst_kv[layer, :, dst_blocks[block], slot], expected)
