"""The live KV store under real engines: a prompt computed on worker A is loaded by worker B from the store node (over
its authenticated socket and shared-memory slots), with the same greedy output as recomputing it; disk, corruption,
aborts mid-load and a dead store node end with every block accounted for."""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbaton.cache.hashing import hash_block_tokens
from kvbaton.core.cluster_secret import ClusterSecret
from kvbaton.core.config import CacheConfig, EngineConfig, SchedulerConfig
from kvbaton.core.request import FinishReason
from kvbaton.core.sampling import SamplingParams
from kvbaton.core.step import TokenDelta
from kvbaton.engine import store_io as store_io_module
from kvbaton.engine.engine import LOAD_WAIT_S, Engine
from kvbaton.engine.store_io import WorkerStoreIO
from kvbaton.model.registry import load_model
from kvbaton.server.store_client import StoreClient
from kvbaton.server.store_node import StoreNodeState
from kvbaton.transfer import store_tcp
from kvbaton.transfer.store_disk import DiskBlockFiles
from tests.store_nodes import RunningNode, wait_unpinned

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_thread")]

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
BLOCK = 16
SECRET = ClusterSecret(b"s" * 32)
ROWS = 4  # tiny-random: 2 layers, K and V


@pytest.fixture(scope="module")
def loaded():  # noqa: ANN201 - LoadedModel
    return load_model("tiny-random", "float32", "cpu")


def _config(num_blocks: int = 256) -> EngineConfig:
    return EngineConfig(model="tiny-random", dtype="float32",
                        cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
                        scheduler=SchedulerConfig(max_num_batched_tokens=512))


class _Store(RunningNode):
    def __init__(self, block_bytes: int, tmp_path: Path, dram_blocks: int, disk_blocks: int, lease_s: float,
                 port: int = 0) -> None:
        disk = DiskBlockFiles(tmp_path / "disk", disk_blocks) if disk_blocks else None
        super().__init__(StoreNodeState(block_bytes, BLOCK, dram_blocks, disk, lease_s, block_rows=ROWS), SECRET,
                         port=port)

    def link(self, timeout_s: float = 2.0, transport: str = "auto") -> Callable[[], StoreClient]:
        """A worker's link: "auto" maps the node's slots (same host), "tcp" reads them over the node's TCP port, as
        a worker on another host does."""
        return lambda: StoreClient(self.address, SECRET, timeout_s=timeout_s, retry_after_s=0.5,
                                   transport=transport)


@pytest.fixture
def make_store(loaded, tmp_path: Path) -> Iterator[Callable[..., _Store]]:  # noqa: ANN001
    stores: list[_Store] = []
    kv = loaded.config
    block_bytes = kv.num_layers * 2 * BLOCK * kv.num_kv_heads * kv.head_dim * 4
    assert kv.num_layers * 2 == ROWS

    def make(dram_blocks: int = 64, disk_blocks: int = 0, lease_s: float = 30.0) -> _Store:
        stores.append(_Store(block_bytes, tmp_path, dram_blocks, disk_blocks, lease_s))
        return stores[-1]
    yield make
    for store in stores:
        store.stop()


def _prompt(seed: int = 0, num_tokens: int = 200) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 200) for _ in range(num_tokens)]


def _run(engine: Engine, prompt: list[int], tenant: str = "", abort_after_steps: int = -1) -> list[TokenDelta]:
    rid = engine.add_request(prompt, GREEDY, tenant=tenant)
    outputs: list[TokenDelta] = []
    deadline = time.monotonic() + 60
    steps = 0
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "a request hangs"
        if steps == abort_after_steps:
            engine.abort_request(rid)
        outputs += [out for out in engine.step() if out.request_id == rid]
        steps += 1
    return outputs


def _tokens(outputs: list[TokenDelta]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def _wait_saved(store: _Store, num_blocks: int) -> None:
    deadline = time.monotonic() + 30
    while store.state.store.num_blocks < num_blocks:
        assert time.monotonic() < deadline, f"the store holds {store.state.store.num_blocks} of {num_blocks} blocks"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def reference(loaded) -> list[int]:  # noqa: ANN001
    engine = Engine(_config(), loaded)
    return _tokens(_run(engine, _prompt()))


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_prompt_computed_on_a_is_loaded_by_b(loaded, make_store, reference: list[int],  # noqa: ANN001
                                               transport: str) -> None:
    store = make_store()
    a = Engine(_config(), loaded, create_store_link=store.link())
    b = Engine(_config(), loaded, create_store_link=store.link(transport=transport))
    try:
        out_a = _run(a, _prompt())
        assert _tokens(out_a) == reference and out_a[-1].num_cached_tokens == 0
        _wait_saved(store, 200 // BLOCK)  # write-through of the prompt's 12 full blocks (and no more)
        out_b = _run(b, _prompt())
        assert _tokens(out_b) == reference
        assert out_b[-1].num_cached_tokens == (199 // BLOCK) * BLOCK  # all but the last token's block
        assert b.store_io.num_loaded_blocks == 199 // BLOCK and b.store_io.num_saved_blocks == 0
        assert b.store_io.transport == ("tcp" if transport == "tcp" else "shm")
        assert store.server.tcp.num_reads == (1 if transport == "tcp" else 0)
        # same host: copied straight from the slots the node's index shows, no lease taken; the node hears of the uses
        assert b.store_io.num_unleased_blocks == (0 if transport == "tcp" else 199 // BLOCK)
        deadline = time.monotonic() + 10
        while store.state.num_loaded_blocks < 199 // BLOCK:
            assert time.monotonic() < deadline, "the node never counted the load's uses"
            time.sleep(0.01)
        # what the router measures the link from: the bytes loaded, the time they took (acquire + copy, or the TCP
        # trip), the loads, and of that time their round trips' (the acquire's answer, or the TCP header's)
        loaded_bytes, load_s, num_loads, round_trip_s = b.store_io.load_totals
        kv = b.store_io.kv_cache
        assert loaded_bytes == (199 // BLOCK) * kv[:, :, 0].numel() * kv.element_size() and num_loads == 1
        assert 0 < round_trip_s < load_s
        assert a.store_io.load_totals == (0, 0.0, 0, 0.0)
        for engine in (a, b):
            engine.check_invariants()
        store.check()
        assert store.state.num_leases == 0
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_wrong_kv_loaded_changes_the_output(loaded, make_store, reference: list[int],  # noqa: ANN001
                                           monkeypatch: pytest.MonkeyPatch, transport: str) -> None:
    """The equality above can fail: a load that brings back altered KV changes the greedy output."""
    load = WorkerStoreIO._acquire_copy  # the path of a load with room in the pool, over shm and tcp alike

    def scaled_load(self: WorkerStoreIO, link, job) -> None:  # noqa: ANN001
        load(self, link, job)
        for block_id in job.device_block_ids[: job.num_copied]:
            self.kv_cache[:, :, block_id] *= 3.0

    monkeypatch.setattr(WorkerStoreIO, "_acquire_copy", scaled_load)
    store = make_store()
    a = Engine(_config(), loaded, create_store_link=store.link())
    b = Engine(_config(), loaded, create_store_link=store.link(transport=transport))
    try:
        _run(a, _prompt())
        _wait_saved(store, 12)
        out = _run(b, _prompt())
        assert out[-1].num_cached_tokens > 0 and _tokens(out) != reference
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("moved_from", [0, 5])
def test_blocks_the_node_moves_during_an_unleased_copy_are_never_used(loaded, make_store, reference: list[int],  # noqa: ANN001
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       moved_from: int) -> None:
    """While B copies the prefix from the slots unleased, the node drops its blocks from `moved_from` on and fills their
    slots with another prompt's: the slots' generations moved, so B keeps only the leading blocks copied before
    them, asks the node for the rest (gone: recomputed) and its output is the reference's."""
    store = make_store(dram_blocks=24)
    a = Engine(_config(), loaded, create_store_link=store.link())
    b = Engine(_config(), loaded, create_store_link=store.link())
    copy_rows = WorkerStoreIO._copy_rows

    def racing_copy(self: WorkerStoreIO, slots, block_ids, threads: int = 1) -> None:  # noqa: ANN001
        copy_rows(self, slots, block_ids, threads)
        with store.server.locked():
            state = store.state
            for block_hash in hashes[moved_from:]:
                state.store.discard(state.NODE, block_hash)
            state._apply({}, namespace)
            other = hash_block_tokens(a.cache_key, _prompt(seed=9), BLOCK)
            state.put(namespace, 0, other, [bytes([7]) * state.block_bytes] * len(other))  # into the freed slots
        copy_rows(self, slots, block_ids, threads)  # what a copy racing those writes would have read: the new bytes

    try:
        _run(a, _prompt())
        _wait_saved(store, 12)
        key = a.cache_key
        namespace = (key.model_revision, key.kv_layout, "")
        hashes = hash_block_tokens(key, _prompt(), BLOCK)
        monkeypatch.setattr(WorkerStoreIO, "_copy_rows", racing_copy)
        out = _run(b, _prompt())
        assert _tokens(out) == reference and out[-1].num_cached_tokens == moved_from * BLOCK
        assert b.store_io.num_unleased_blocks == moved_from
        b.check_invariants()
        wait_unpinned(store.server)
    finally:
        a.close()
        b.close()


def test_an_idle_engine_loads_on_its_own_thread_and_a_busy_one_on_the_io_thread(loaded, make_store,  # noqa: ANN001
                                                                                 reference: list[int]) -> None:
    """With nothing else to step or load, B reads the stored prefix on its engine thread as it admits the request
    (`copy_now`: no hand-off); with another request decoding, the load goes to the store IO thread, so no step of
    that request waits on the copy. Same output both ways, the node told of every use, every block accounted."""
    store = make_store()
    a = Engine(_config(), loaded, create_store_link=store.link())
    b = Engine(_config(), loaded, create_store_link=store.link())
    try:
        _run(a, _prompt())
        _run(a, _prompt(seed=4))
        _wait_saved(store, 2 * 12)
        _run(b, _prompt(seed=4, num_tokens=40))  # B maps the node's slots (its first load goes to the IO thread)
        loads_now = b.store_io.num_loads_now
        out = _run(b, _prompt())
        assert _tokens(out) == reference and out[-1].num_cached_tokens == 192
        assert b.store_io.num_loads_now == loads_now + 1  # idle: read on the engine thread
        busy = b.add_request(_prompt(seed=5, num_tokens=20), SamplingParams(max_tokens=40, temperature=0.0,
                                                                            ignore_eos=True))
        b.step()  # its one block is a miss in the slot index, told on the engine thread too
        assert busy in b.scheduler.requests
        loads_now = b.store_io.num_loads_now
        b.reset_prefix_cache()
        out = _run(b, _prompt())  # `busy` decodes meanwhile: this load goes to the IO thread
        assert _tokens(out) == reference and out[-1].num_cached_tokens == 192
        assert b.store_io.num_loads_now == loads_now
        while b.has_unfinished_requests():
            b.step()
        b.check_invariants()
        deadline = time.monotonic() + 10
        while store.state.num_loaded_blocks < b.store_io.num_loaded_blocks:  # the touches, sent after the results
            assert time.monotonic() < deadline, "the node never counted the loads' uses"
            time.sleep(0.01)
        wait_unpinned(store.server)
    finally:
        a.close()
        b.close()


def test_an_idle_engines_large_load_is_split_over_its_copy_threads(loaded, make_store, reference: list[int],  # noqa: ANN001
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A `copy_now` load of at least SPLIT_COPY_BYTES (here any) copies its rows in `copy_threads` even parts, the
    engine thread's and the helpers' at once: every row is copied once (a part left out would change the output, as
    a wrong load does), the output is the reference's, and a load on the IO thread stays on one thread."""
    monkeypatch.setattr(store_io_module, "SPLIT_COPY_BYTES", 0)
    parts: list[tuple[int, int, str]] = []
    copy_runs = store_io_module._copy_runs

    def recorded(pool, node, runs, first_row: int, end_row: int) -> None:  # noqa: ANN001
        parts.append((first_row, end_row, threading.current_thread().name))
        copy_runs(pool, node, runs, first_row, end_row)

    monkeypatch.setattr(store_io_module, "_copy_runs", recorded)
    store = make_store()
    a = Engine(_config(), loaded, create_store_link=store.link())
    b = Engine(_config(), loaded, create_store_link=store.link())
    b.store_io.copy_threads = 3
    try:
        _run(a, _prompt())
        _run(a, _prompt(seed=4))
        _wait_saved(store, 2 * 12)
        _run(b, _prompt(seed=4, num_tokens=40))  # B maps the node's slots (its first load goes to the IO thread)
        assert {name for _, _, name in parts} == {"kv-store-io"}
        parts.clear()
        loads_now = b.store_io.num_loads_now
        out = _run(b, _prompt())
        assert _tokens(out) == reference and out[-1].num_cached_tokens == 192
        assert b.store_io.num_loads_now == loads_now + 1
        assert sorted(first for first, _, _ in parts) == [0, 1, 2] and sum(e - f for f, e, _ in parts) == ROWS
        assert sorted(name.startswith("kv-store-copy") for _, _, name in parts) == [False, True, True]
        b.check_invariants()
        wait_unpinned(store.server)
    finally:
        a.close()
        b.close()


def test_another_tenant_never_loads(loaded, make_store, reference: list[int]) -> None:  # noqa: ANN001
    store = make_store()
    a = Engine(_config(), loaded, create_store_link=store.link())
    b = Engine(_config(), loaded, create_store_link=store.link())
    try:
        _run(a, _prompt(), tenant="alice")
        _wait_saved(store, 200 // BLOCK)
        out = _run(b, _prompt(), tenant="bob")
        assert out[-1].num_cached_tokens == 0 and b.store_io.num_loaded_blocks == 0
        b.check_invariants()
    finally:
        a.close()
        b.close()


def test_from_disk_after_dram_is_emptied_and_a_corrupt_block_recomputes(loaded, make_store,  # noqa: ANN001
                                                                        reference: list[int]) -> None:
    store = make_store(dram_blocks=12, disk_blocks=64)
    a = Engine(_config(), loaded, create_store_link=store.link())
    b = Engine(_config(), loaded, create_store_link=store.link())
    try:
        _run(a, _prompt())
        _wait_saved(store, 12)
        _run(a, _prompt(seed=1))  # 12 more blocks: DRAM's first 12 move to disk
        _wait_saved(store, 24)
        disk = store.state.disk
        with store.server.locked():
            assert disk.num_files() == 12
        out = _run(b, _prompt())
        assert _tokens(out) == reference and out[-1].num_cached_tokens == (199 // BLOCK) * BLOCK  # back from disk
        store.check()
        # Now corrupt a block of the second prompt (on disk after that load) and ask for it on a fresh worker.
        with store.server.locked():
            victims = sorted(store.state._on_disk)
            assert victims
        c = Engine(_config(), loaded, create_store_link=store.link())
        try:
            paths = [disk.path_of(h) for h in victims]
            for path in paths:
                data = bytearray(path.read_bytes())
                data[-3] ^= 0x40
                path.write_bytes(bytes(data))
            reference_1 = _tokens(_run(Engine(_config(), loaded), _prompt(seed=1)))
            out = _run(c, _prompt(seed=1))
            assert _tokens(out) == reference_1  # recomputed what failed its checksum: same output
            assert disk.num_corrupt_blocks >= 1 and out[-1].num_cached_tokens < (199 // BLOCK) * BLOCK
            c.check_invariants()
            store.check()
        finally:
            c.close()
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("abort_after_steps", [0, 1, 2])
def test_abort_during_a_load_frees_every_block(loaded, make_store, abort_after_steps: int) -> None:  # noqa: ANN001
    store = make_store()
    a = Engine(_config(), loaded, create_store_link=store.link())
    b = Engine(_config(), loaded, create_store_link=store.link())
    try:
        _run(a, _prompt())
        _wait_saved(store, 12)
        out = _run(b, _prompt(), abort_after_steps=abort_after_steps)
        assert out[-1].finished
        b.check_invariants()
        assert b.store_loads.num_loading == 0 and b.pool.num_used_blocks == b.prefix_cache.num_cached_blocks
        deadline = time.monotonic() + 10
        while store.state.num_leases:
            assert time.monotonic() < deadline, "a lease is left pinned"
            time.sleep(0.01)
        store.check()
        if abort_after_steps == 0:
            assert out[-1].finish_reason == FinishReason.ABORT and not out[-1].new_token_ids
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_dead_store_node_fails_over_to_recompute(loaded, make_store, reference: list[int],  # noqa: ANN001
                                                   transport: str) -> None:
    store = make_store()
    a = Engine(_config(), loaded, create_store_link=store.link(timeout_s=0.5, transport=transport))
    try:
        _run(a, _prompt(seed=3))
        store.stop()
        started = time.monotonic()
        out = _run(a, _prompt())  # the store is gone: the load times out once and the request recomputes
        assert _tokens(out) == reference and time.monotonic() - started < 10
        assert a.store_loads.num_failed_requests == 1
        a.check_invariants()
    finally:
        a.close()


@pytest.mark.parametrize("fault", ["dies", "stalls"])
def test_a_store_node_that_dies_or_stalls_mid_tcp_read_fails_over_to_recompute(  # noqa: ANN001
        loaded, make_store, reference: list[int], monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    """The node sends a read's header and part of its bytes, then its link closes (the node died) or nothing more
    comes (it hangs): the load fails within the link's timeout, the request recomputes with the same output, and
    its device blocks and the lease all go back."""
    store = make_store()
    a = Engine(_config(), loaded, create_store_link=store.link())
    b = Engine(_config(), loaded, create_store_link=store.link(timeout_s=0.5, transport="tcp"))
    stalled = threading.Event()
    send = store_tcp.send_message

    def broken_send(sock: socket.socket, message: dict, payload: Sequence[memoryview] = ()) -> None:
        send(sock, message, payload[:1])  # a read's header and its first run only
        if payload and fault == "dies":
            sock.shutdown(socket.SHUT_RDWR)
        elif payload:
            stalled.wait(5)

    try:
        _run(a, _prompt())
        _wait_saved(store, 12)
        monkeypatch.setattr(store_tcp, "send_message", broken_send)
        started = time.monotonic()
        out = _run(b, _prompt())
        assert _tokens(out) == reference and out[-1].num_cached_tokens == 0 and time.monotonic() - started < 10
        assert b.store_loads.num_failed_requests == 1 and b.store_io.num_failed_loads == 1
        b.check_invariants()
        stalled.set()
        deadline = time.monotonic() + 10
        while store.state.num_leases:  # released by the worker; the read's end lets the node unpin it
            assert time.monotonic() < deadline, "a lease is left pinned"
            time.sleep(0.01)
        store.check()
    finally:
        stalled.set()
        a.close()
        b.close()


def test_leases_of_a_dead_worker_expire(loaded, make_store) -> None:  # noqa: ANN001
    store = make_store(lease_s=0.3)
    client = StoreClient(store.server.address, SECRET)
    a = Engine(_config(), loaded, create_store_link=store.link())
    try:
        _run(a, _prompt())
        _wait_saved(store, 12)
        lease, slots, _ = client.acquire(("tiny", "x", ""), [1])
        assert (lease, slots) == (0, [])
        key = a.cache_key
        hashes = hash_block_tokens(key, _prompt(), BLOCK)
        lease, slots, _ = client.acquire((key.model_revision, key.kv_layout, ""), hashes)
        assert lease and len(slots) == 12
        client.close()  # the "worker" dies holding the lease
        deadline = time.monotonic() + 10
        while store.state.num_leases:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert store.state.num_expired_leases == 1
        store.check()
    finally:
        a.close()


def test_a_peer_without_the_secret_is_refused(make_store) -> None:  # noqa: ANN001
    store = make_store()
    client = StoreClient(store.server.address, ClusterSecret(b"x" * 32), timeout_s=0.5)
    try:
        with pytest.raises(Exception, match="did not answer"):
            client.hello()
    finally:
        client.close()


def test_a_restarted_store_node_is_remapped_never_read_stale(loaded, tmp_path: Path) -> None:  # noqa: ANN001
    """A node restarted on the same address keeps its slots in a new file: a worker that mapped the old one must not
    copy from it (its slot numbers now name other blocks)."""
    kv = loaded.config
    block_bytes = kv.num_layers * 2 * BLOCK * kv.num_kv_heads * kv.head_dim * 4
    first = _Store(block_bytes, tmp_path / "one", 64, 0, 30.0)
    port = int(first.server.address.rsplit(":", 1)[1])
    a = Engine(_config(), loaded, create_store_link=first.link())
    b = Engine(_config(), loaded, create_store_link=first.link())
    second = None
    try:
        _run(a, _prompt(0))
        _wait_saved(first, 12)
        _run(b, _prompt(0))  # B maps the first node's slots
        first.stop()
        second = _Store(block_bytes, tmp_path / "two", 64, 0, 30.0, port=port)
        reference = _tokens(_run(Engine(_config(), loaded), _prompt(5)))
        a.reset_prefix_cache()
        deadline = time.monotonic() + 30
        while second.state.store.num_blocks < 12:  # A's saves reach the new node once its link reconnects
            assert time.monotonic() < deadline, "saves never reached the restarted node"
            a.reset_prefix_cache()
            _run(a, _prompt(5))
        out = _run(b, _prompt(5))
        assert _tokens(out) == reference and out[-1].num_cached_tokens > 0
        b.check_invariants()
    finally:
        a.close()
        b.close()
        if second is not None:
            second.stop()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=st.lists(st.tuples(st.integers(0, 3), st.one_of(st.none(), st.integers(0, 4))), min_size=1, max_size=5),
       kill_store_at=st.one_of(st.none(), st.integers(0, 6)), transport=st.sampled_from(["auto", "tcp"]))
def test_random_loads_aborts_and_a_store_death_keep_every_block_accounted(loaded, tmp_path: Path,  # noqa: ANN001
                                                                           plan: list[tuple[int, int | None]],
                                                                           kill_store_at: int | None,
                                                                           transport: str) -> None:
    """Requests over four prompts some other worker computed, some aborted at a random step, the store node maybe
    killed mid-way: every step keeps the engine's invariants, and at the end only the cache holds blocks."""
    kv = loaded.config
    block_bytes = kv.num_layers * 2 * BLOCK * kv.num_kv_heads * kv.head_dim * 4
    store = _Store(block_bytes, tmp_path, 48, 0, 30.0)
    a = Engine(_config(), loaded, create_store_link=store.link(timeout_s=0.5))
    b = Engine(_config(num_blocks=64), loaded, create_store_link=store.link(timeout_s=0.5, transport=transport))
    try:
        for seed in range(4):
            _run(a, _prompt(seed, 120))
        ids = [(b.add_request(_prompt(seed, 120), GREEDY), abort_at) for seed, abort_at in plan]
        deadline = time.monotonic() + 60
        step = 0
        while b.has_unfinished_requests():
            assert time.monotonic() < deadline, "a request hangs"
            for rid, abort_at in ids:
                if abort_at == step:
                    b.abort_request(rid)
            if kill_store_at == step:
                store.stop()
            b.step()
            b.check_invariants()
            step += 1
        assert b.pool.num_used_blocks == b.prefix_cache.num_cached_blocks and b.store_loads.num_loading == 0
        if kill_store_at is None or kill_store_at >= step:
            deadline = time.monotonic() + 10
            while store.state.num_leases:
                assert time.monotonic() < deadline, "a lease is left pinned"
                time.sleep(0.01)
            store.check()
    finally:
        a.close()
        b.close()
        store.stop()


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_load_short_of_free_blocks_takes_them_from_the_cache(loaded, make_store,  # noqa: ANN001
                                                               reference: list[int], transport: str) -> None:
    """With fewer free blocks than the prefix needs, the load asks first and then evicts cached blocks for what the
    node has (the two-trip path): same output, the load counted, every block accounted for."""
    store = make_store()
    a = Engine(_config(), loaded, create_store_link=store.link())
    b = Engine(_config(num_blocks=20), loaded, create_store_link=store.link(transport=transport))
    try:
        _run(a, _prompt())
        _wait_saved(store, 12)
        _run(b, _prompt(seed=7))  # 13 of B's 20 blocks now cached: 7 free for a 12-block load
        assert b.pool.num_free_blocks < 12
        out = _run(b, _prompt())
        assert _tokens(out) == reference and out[-1].num_cached_tokens == (199 // BLOCK) * BLOCK
        assert b.store_loads.num_loaded_requests == 1
        b.check_invariants()
    finally:
        a.close()
        b.close()


class _GatedClient(StoreClient):
    """A worker's link whose first acquire waits for `gate`: the loads after it queue up behind it meanwhile. Every
    load acquires (no unleased reads, which no gate would hold)."""

    def __init__(self, gate: threading.Event, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, unleased_reads=False, **kwargs)
        self._gate = gate

    def acquire(self, namespace, block_hashes):  # noqa: ANN001, ANN201
        assert self._gate.wait(30), "the gate never opened"
        return super().acquire(namespace, block_hashes)


def test_a_burst_of_loads_sends_each_acquire_while_the_load_before_it_copies(loaded, make_store) -> None:  # noqa: ANN001
    """Three requests whose prefixes are in the store arrive together: the IO thread acquires the first, and sends
    each next one's acquire before it copies the one in hand, so the burst waits on one round trip. Every output is
    the one A computed, and every lease and block goes back."""
    store = make_store()
    prompts = [_prompt(seed) for seed in (21, 22, 23)]
    a = Engine(_config(), loaded, create_store_link=store.link())
    gate = threading.Event()
    b = Engine(_config(), loaded,
               create_store_link=lambda: _GatedClient(gate, store.address, SECRET, timeout_s=2.0, retry_after_s=0.5))
    try:
        expected = [_tokens(_run(a, prompt)) for prompt in prompts]
        _wait_saved(store, 3 * (200 // BLOCK))
        rids = [b.add_request(prompt, GREEDY) for prompt in prompts]
        outputs: dict[str, list[TokenDelta]] = {rid: [] for rid in rids}
        b.step()  # the three loads go to the IO thread; the first waits at the gate
        gate.set()
        deadline = time.monotonic() + 60
        while b.has_unfinished_requests():
            assert time.monotonic() < deadline, "a request hangs"
            for out in b.step():
                outputs[out.request_id].append(out)
        assert [_tokens(outputs[rid]) for rid in rids] == expected
        assert all(outputs[rid][-1].num_cached_tokens == 192 for rid in rids)  # 12 full blocks each, from the store
        assert b.store_io.num_prefetched_acquires == 2
        b.check_invariants()
        wait_unpinned(store.server)
    finally:
        a.close()
        b.close()


def test_a_prefetched_acquire_is_kept_past_other_calls_and_asked_again_when_its_link_broke(make_store) -> None:  # noqa: ANN001
    store = make_store(lease_s=0.5)
    ns = ("rev", "layout", "")
    hashes = [5000 + i for i in range(3)]
    with store.server.locked():
        store.state.put(ns, 0, hashes, [bytes(store.state.block_bytes)] * 3)
    client = StoreClient(store.address, SECRET, timeout_s=2.0, retry_after_s=0.0)
    try:
        client.hello()
        assert client.begin_acquire(ns, hashes) is None  # no TCP link up yet: the load acquires as usual
        lease, slots, _ = client.acquire(ns, hashes)  # the TCP link is up now
        client.release(lease)
        token = client.begin_acquire(ns, hashes)
        other, other_slots, _ = client.acquire(ns, hashes[:1])  # a call between: the earlier answer is kept
        lease, slots, _ = client.end_acquire(token)
        assert len(other_slots) == 1 and lease and lease != other and len(slots) == 3
        client.release(other)
        client.release(lease)
        wait_unpinned(store.server)
        token = client.begin_acquire(ns, hashes)
        client._tcp._sock.close()  # the link dies before the answer is read
        lease, slots, _ = client.end_acquire(token)  # asked again on a fresh link
        assert lease and len(slots) == 3
        client.release(lease)
        wait_unpinned(store.server, timeout_s=5.0)  # the lost answer's pin expired with its lease
        assert store.state.num_expired_leases == 1
    finally:
        client.close()


def test_an_engine_with_only_loads_in_flight_waits_for_them_instead_of_spinning(loaded, make_store) -> None:  # noqa: ANN001
    """While its only request loads from the store, a step waits for the load (at most LOAD_WAIT_S, the GIL let
    go) rather than returning at once: an empty step loop would hold the interpreter the store IO thread needs to
    finish the load. A request with something to compute meanwhile is never made to wait."""
    store = make_store()
    a = Engine(_config(), loaded, create_store_link=store.link())
    gate = threading.Event()
    b = Engine(_config(), loaded,
               create_store_link=lambda: _GatedClient(gate, store.address, SECRET, timeout_s=2.0, retry_after_s=0.5))
    try:
        expected = _tokens(_run(a, _prompt(31)))
        _wait_saved(store, 200 // BLOCK)
        rid = b.add_request(_prompt(31), GREEDY)
        started, num_steps = time.monotonic(), 0
        while time.monotonic() - started < 0.3:
            assert b.step() == []
            num_steps += 1
        assert rid in b.store_loads and num_steps <= 0.3 / LOAD_WAIT_S + 10, num_steps  # spinning: thousands
        other = b.add_request(_prompt(32, num_tokens=8), GREEDY)  # too short to load: straight to the scheduler
        b.step()
        assert b.last_plan.chunks and other in b.scheduler.requests  # computed at once, not gated behind the load
        gate.set()
        outputs: list[TokenDelta] = []
        deadline = time.monotonic() + 60
        while b.has_unfinished_requests():
            assert time.monotonic() < deadline, "a request hangs"
            outputs += [out for out in b.step() if out.request_id == rid]
        assert _tokens(outputs) == expected and outputs[-1].num_cached_tokens == 192
        b.check_invariants()
        wait_unpinned(store.server)
    finally:
        a.close()
        b.close()
