"""Several live KV store nodes, one per host (two on 127.0.0.1, the first claiming another host's id): worker A writes
through to its own node, worker B (its own node the second) loads A's prefix from A's node over TCP with the same
greedy output; a dead own node drops the saves while loads still reach the other; with both nodes dead B recomputes
within a bounded time; every block, lease and save is accounted for on each path."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import pytest

from kvbaton.core.cluster_secret import ClusterSecret
from kvbaton.core.config import CacheConfig, EngineConfig, SchedulerConfig
from kvbaton.core.sampling import SamplingParams
from kvbaton.core.step import TokenDelta
from kvbaton.engine.engine import Engine
from kvbaton.model.registry import load_model
from kvbaton.server.store_client import KnownStoreNodes, StoreNodes
from kvbaton.server.store_node import StoreNodeState
from tests.store_nodes import RunningNode, wait_unpinned

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_thread")]

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
BLOCK = 16
SECRET = ClusterSecret(b"n" * 32)
ROWS = 4  # tiny-random: 2 layers, K and V
NUM_FULL = 199 // BLOCK  # a 200-token prompt's blocks a load can bring (all but the last token's)


@pytest.fixture(scope="module")
def loaded():  # noqa: ANN201 - LoadedModel
    return load_model("tiny-random", "float32", "cpu")


def _config() -> EngineConfig:
    return EngineConfig(model="tiny-random", dtype="float32", cache=CacheConfig(block_size=BLOCK, num_blocks=256),
                        scheduler=SchedulerConfig(max_num_batched_tokens=512))


def _prompt(seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 200) for _ in range(200)]


def _run(engine: Engine, prompt: list[int]) -> list[TokenDelta]:
    rid = engine.add_request(prompt, GREEDY)
    outputs: list[TokenDelta] = []
    deadline = time.monotonic() + 60
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "a request hangs"
        outputs += [out for out in engine.step() if out.request_id == rid]
    return outputs


def _tokens(outputs: list[TokenDelta]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def _wait_blocks(node: RunningNode, num_blocks: int) -> None:
    deadline = time.monotonic() + 30
    while node.state.store.num_blocks < num_blocks:
        assert time.monotonic() < deadline, f"the node holds {node.state.store.num_blocks} of {num_blocks} blocks"
        time.sleep(0.01)


@pytest.fixture
def nodes(loaded, store_node) -> Iterator[tuple[RunningNode, RunningNode]]:  # noqa: ANN001
    kv = loaded.config
    block_bytes = kv.num_layers * 2 * BLOCK * kv.num_kv_heads * kv.head_dim * 4
    assert kv.num_layers * 2 == ROWS
    first = store_node(StoreNodeState(block_bytes, BLOCK, 64, block_rows=ROWS), SECRET, host_id="host-1/boot")
    second = store_node(StoreNodeState(block_bytes, BLOCK, 64, block_rows=ROWS), SECRET)
    yield first, second


def _link(local: RunningNode, nodes: tuple[RunningNode, ...]):  # noqa: ANN202
    addresses = [node.address for node in nodes]
    return lambda: StoreNodes(local.address, addresses, SECRET, timeout_s=0.5, retry_after_s=0.5)


@pytest.fixture(scope="module")
def reference(loaded) -> list[int]:  # noqa: ANN001
    return _tokens(_run(Engine(_config(), loaded), _prompt()))


def test_b_loads_a_prefix_from_a_node_on_another_host_and_writes_to_its_own(loaded, nodes,  # noqa: ANN001
                                                                             reference: list[int]) -> None:
    first, second = nodes
    a = Engine(_config(), loaded, create_store_link=_link(first, nodes))
    b = Engine(_config(), loaded, create_store_link=_link(second, nodes))
    try:
        out_a = _run(a, _prompt())
        assert _tokens(out_a) == reference and out_a[-1].num_cached_tokens == 0
        _wait_blocks(first, 200 // BLOCK)
        assert second.state.store.num_blocks == 0  # written through to A's own node only
        assert a.store_io.transport == "tcp"  # its node claims another host: no mapping of its slots
        reads = first.server.tcp.num_reads  # A's own ask (it found nothing) is one
        out_b = _run(b, _prompt())
        assert _tokens(out_b) == reference and out_b[-1].num_cached_tokens == NUM_FULL * BLOCK
        assert b.store_io.transport == "shm" and b.store_io.num_loaded_blocks == NUM_FULL
        assert first.server.tcp.num_reads == reads + 1  # from A's node, over its TCP port
        assert b.store_io.num_saved_blocks == 0  # what it loaded it does not write again
        _run(b, _prompt(seed=5))  # a prompt of its own: written to its own node
        _wait_blocks(second, 200 // BLOCK)
        assert first.state.store.num_blocks == 200 // BLOCK
        for engine in (a, b):
            engine.check_invariants()
        for node in nodes:
            wait_unpinned(node.server)
    finally:
        a.close()
        b.close()


def test_a_chain_split_over_two_nodes_loads_from_both(loaded, nodes, reference: list[int]) -> None:  # noqa: ANN001
    """A's prompt is on A's node; B extends it (a longer prompt): its new blocks go to B's node. C, on B's host,
    loads the first part from A's node and the rest from its own."""
    first, second = nodes
    a = Engine(_config(), loaded, create_store_link=_link(first, nodes))
    b = Engine(_config(), loaded, create_store_link=_link(second, nodes))
    c = Engine(_config(), loaded, create_store_link=_link(second, nodes))
    longer = _prompt() + _prompt(seed=9)[:120]
    try:
        _run(a, _prompt())
        _wait_blocks(first, 200 // BLOCK)
        out_b = _run(b, longer)
        assert out_b[-1].num_cached_tokens == NUM_FULL * BLOCK
        _wait_blocks(second, 320 // BLOCK - NUM_FULL)
        expected = _tokens(_run(Engine(_config(), loaded), longer))
        out_c = _run(c, longer)
        assert _tokens(out_c) == expected and out_c[-1].num_cached_tokens == (319 // BLOCK) * BLOCK
        assert c.store_io.num_loaded_blocks == 319 // BLOCK
        for engine in (a, b, c):
            engine.check_invariants()
        for node in nodes:
            wait_unpinned(node.server)
    finally:
        for engine in (a, b, c):
            engine.close()


def test_dead_nodes_drop_saves_and_loads_fail_over_to_recompute(loaded, nodes, reference: list[int]) -> None:  # noqa: ANN001
    first, second = nodes
    a = Engine(_config(), loaded, create_store_link=_link(first, nodes))
    try:
        _run(a, _prompt())
        _wait_blocks(first, 200 // BLOCK)
    finally:
        a.close()
    second.stop()  # B's own node dies: its saves are dropped, its loads still reach A's node
    b = Engine(_config(), loaded, create_store_link=_link(second, nodes))
    try:
        started = time.monotonic()
        out = _run(b, _prompt())
        assert _tokens(out) == reference and out[-1].num_cached_tokens == NUM_FULL * BLOCK
        assert time.monotonic() - started < 10
        _run(b, _prompt(seed=7))  # its own blocks: for a node that is gone, never sent to another
        assert first.state.store.num_blocks == 200 // BLOCK
        b.check_invariants()
        first.stop()  # and now A's node: nothing to load from anywhere
        started = time.monotonic()
        out = _run(b, _prompt(seed=3))
        assert out[-1].num_cached_tokens == 0 and time.monotonic() - started < 10
        b.check_invariants()
        assert b.store_loads.num_loading == 0 and b.store_loads.num_held_blocks == 0
    finally:
        b.close()


def test_a_node_a_router_names_later_is_read_from_the_next_load_on(loaded, nodes) -> None:  # noqa: ANN001
    """B starts knowing its own node only (no --kv-store-nodes); once its router names A's node (`KnownStoreNodes.add`,
    what `rpc.StoreNodesKnown` does), B's next load reads A's blocks from there over TCP."""
    first, second = nodes
    a = Engine(_config(), loaded, create_store_link=_link(first, nodes))
    try:
        _run(a, _prompt())
        _run(a, _prompt(seed=5))
        _wait_blocks(first, 2 * (200 // BLOCK))
    finally:
        a.close()
    known = KnownStoreNodes([second.address])
    b = Engine(_config(), loaded, create_store_link=lambda: StoreNodes(second.address, known, SECRET, timeout_s=0.5,
                                                                       retry_after_s=0.5))
    try:
        assert _run(b, _prompt())[-1].num_cached_tokens == 0  # A's node unknown: B recomputes
        assert known.add([second.address, first.address]) and not known.add([first.address])
        assert _run(b, _prompt(seed=5))[-1].num_cached_tokens == NUM_FULL * BLOCK
        b.check_invariants()
        assert b.store_loads.num_loading == 0 and b.store_loads.num_held_blocks == 0
    finally:
        b.close()
    wait_unpinned(first.server)


def test_a_load_short_of_free_blocks_still_goes_on_to_the_other_nodes(loaded, nodes,  # noqa: ANN001
                                                                      reference: list[int]) -> None:
    """B's pool is full of its own cached blocks, so its load takes the split path (acquire, then blocks, then copy):
    its own node holds none of A's prompt, A's node says it holds the whole chain, and the copy goes on to A's node
    for it, into blocks the pool evicted cached ones for. A prompt no node holds evicts nothing."""
    first, second = nodes
    small = EngineConfig(model="tiny-random", dtype="float32", cache=CacheConfig(block_size=BLOCK, num_blocks=20),
                         scheduler=SchedulerConfig(max_num_batched_tokens=512))
    a = Engine(_config(), loaded, create_store_link=_link(first, nodes))
    b = Engine(small, loaded, create_store_link=_link(second, nodes))
    try:
        _run(a, _prompt())
        _wait_blocks(first, 200 // BLOCK)
        _run(b, _prompt(seed=5))  # 13 of B's 20 blocks now cached: fewer free than the 12 a load of A's needs
        assert b.pool.num_free_blocks < NUM_FULL
        asked: list[int] = []  # the blocks each load asks the pool for (evicting cached ones as need be)
        allocate = b.store_loads._allocate
        b.store_loads._allocate = lambda num: asked.append(num) or allocate(num)
        _run(b, _prompt(seed=6))  # held by no node: its load asks for no block, so it evicts nothing
        assert asked == [] and b.store_io.num_loaded_blocks == 0
        _run(b, _prompt(seed=5))  # the pool as full as before (B's own prompt cached again, part from its node)
        assert b.pool.num_free_blocks < NUM_FULL
        asked.clear()
        loaded_before = b.store_io.num_loaded_blocks
        out_b = _run(b, _prompt())
        assert _tokens(out_b) == reference and out_b[-1].num_cached_tokens == NUM_FULL * BLOCK
        assert asked == [NUM_FULL] and b.store_io.num_loaded_blocks - loaded_before == NUM_FULL  # A's node's
        b.check_invariants()
        for node in nodes:
            wait_unpinned(node.server)
    finally:
        a.close()
        b.close()


def test_a_prefix_read_across_twice_is_copied_to_the_readers_node(loaded, nodes,  # noqa: ANN001
                                                                   reference: list[int]) -> None:
    """The replication rule live: A's prompt lives on A's node; B, on the second node's host, reads it across once
    (no copy), C, on that host too, a second time: A's node grants the second node a copy, which C writes there as
    a replica; D, on that host, then loads it from its own node's shared memory, no read across."""
    first, second = nodes
    engines = [Engine(_config(), loaded, create_store_link=_link(node, nodes)) for node in (first, *[second] * 3)]
    a, b, c, d = engines
    try:
        _run(a, _prompt())
        _wait_blocks(first, 200 // BLOCK)
        assert _tokens(_run(b, _prompt())) == reference
        assert b.store_io.num_saved_blocks == 0 and second.state.store.num_blocks == 0
        assert _tokens(_run(c, _prompt())) == reference
        _wait_blocks(second, NUM_FULL)
        assert c.store_io.num_saved_blocks == NUM_FULL
        entries = second.state.store.nodes[StoreNodeState.NODE].entries
        assert len(entries) == NUM_FULL and all(entry.replica for entry in entries.values())
        reads = first.server.tcp.num_reads
        out_d = _run(d, _prompt())
        assert _tokens(out_d) == reference and out_d[-1].num_cached_tokens == NUM_FULL * BLOCK
        assert d.store_io.num_loaded_blocks == NUM_FULL and first.server.tcp.num_reads == reads
        assert d.store_io.num_saved_blocks == 0
        for engine in engines:
            engine.check_invariants()
        for node in nodes:
            wait_unpinned(node.server)
            node.state.check_invariants()
    finally:
        for engine in engines:
            engine.close()
