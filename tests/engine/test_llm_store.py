"""An offline `LLM` with a KV store node of its own (`kv_store_gb`): a prefix its KV pool evicted is loaded back from
the node's DRAM (or disk) with the same greedy outputs as a pool that never evicts; `reset_prefix_cache` empties the
node too (unless told not to); `close` stops it; every device block and store lease is accounted for afterwards."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvbaton import LLM, SamplingParams
from kvbaton.core.errors import InvalidRequestError
from kvbaton.engine import store_io
from kvbaton.transfer.store_slots import SHM_PREFIX
from tests.store_nodes import wait_unpinned

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_thread")]

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
NUM_GROUPS = 6
STORE_GB = 0.01  # tiny-random's 16-token float32 block is 8 KiB: ~1,200 blocks, every prefix of the run
BLOCK_BYTES = 8192


def _prompts() -> list[list[int]]:
    """Six 200-token prefixes (12 full blocks each), taken in turn three times: 40 device blocks hold about three."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(1, 200) for _ in range(200)] for _ in range(NUM_GROUPS)]
    return [prefixes[i % NUM_GROUPS] + [rng.randrange(1, 200) for _ in range(10)] for i in range(3 * NUM_GROUPS)]


def _run(llm: LLM) -> list[list[int]]:
    outputs = [llm.generate([prompt], GREEDY)[0].outputs[0].token_ids for prompt in _prompts()]
    llm.engine.check_invariants()
    return outputs


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    with LLM("tiny-random", dtype="float32", num_blocks=2000) as llm:
        return _run(llm)


def _check_at_rest(llm: LLM) -> None:
    """Nothing runs: the device pool is held by the cache alone, and the node holds no lease."""
    stats = llm.engine.stats()
    assert stats.num_used_blocks == stats.num_cached_blocks
    assert llm.store_node is not None
    wait_unpinned(llm.store_node.server)


def test_a_prefix_the_pool_evicted_comes_back_from_the_store_with_the_same_outputs(reference: list[list[int]]) -> None:
    with LLM("tiny-random", dtype="float32", num_blocks=40, kv_store_gb=STORE_GB) as llm:
        assert llm.store_node is not None and llm.store_node.server.state.block_bytes == BLOCK_BYTES
        outputs = _run(llm)
        assert outputs == reference
        # Every prefix after the first round came back from the store (the device pool holds about three of six).
        assert llm.engine.store_io.num_loaded_blocks >= 2 * NUM_GROUPS * 12 - 3 * 12
        assert llm.engine.stats().prefix_cache_hits_tokens >= 2 * NUM_GROUPS * 12 * 16
        _check_at_rest(llm)
        node = llm.store_node.server
    assert not any(thread.name == "kv-store-node" and thread.is_alive() for thread in threading.enumerate())
    assert not Path(node.state.slots.path).exists(), "the node's shared memory outlived close()"


def test_without_a_store_the_small_pool_recomputes(reference: list[list[int]]) -> None:
    with LLM("tiny-random", dtype="float32", num_blocks=40) as llm:
        assert _run(llm) == reference
        assert llm.engine.stats().prefix_cache_hits_tokens < 2 * NUM_GROUPS * 12 * 16 / 4


def test_wrong_kv_from_the_store_changes_the_outputs(reference: list[list[int]],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The equality above can fail: loads that bring back altered KV change greedy outputs."""
    copy_runs = store_io._copy_runs

    def zeroed(pool, node, runs, first_row, end_row):  # noqa: ANN001, ANN202 - store_io._copy_runs's
        copy_runs(pool, node, runs, first_row, end_row)
        for _, first, num in runs:
            pool[first_row:end_row, first : first + num] = 0

    monkeypatch.setattr(store_io, "_copy_runs", zeroed)
    with LLM("tiny-random", dtype="float32", num_blocks=40, kv_store_gb=STORE_GB) as llm:
        outputs = _run(llm)
        assert llm.engine.store_io.num_loaded_blocks > 0
    assert outputs != reference


def test_a_prefix_comes_back_from_the_nodes_disk_after_its_dram_evicted_it(reference: list[list[int]],
                                                                            tmp_path: Path) -> None:
    # 64 DRAM blocks hold about five of the run's prefixes at once; the disk takes what DRAM evicts.
    with LLM("tiny-random", dtype="float32", num_blocks=40, kv_store_gb=64 * BLOCK_BYTES / 1e9,
             kv_store_disk=f"{tmp_path}:0.05") as llm:
        assert _run(llm) == reference
        state = llm.store_node.server.state
        assert state.disk is not None and state.disk.num_read_blocks > 0
        assert llm.engine.stats().prefix_cache_hits_tokens >= 2 * NUM_GROUPS * 12 * 16
        _check_at_rest(llm)


def test_reset_prefix_cache_empties_the_store_node_too_unless_told_to_keep_it() -> None:
    with LLM("tiny-random", dtype="float32", num_blocks=40, kv_store_gb=STORE_GB) as llm:
        prompts = _prompts()[:NUM_GROUPS]
        for prompt in prompts:
            llm.generate([prompt], GREEDY)
        # The same 210-token prompt again: its 13 full blocks, from the store (the pool evicted them)
        assert llm.generate([prompts[0]], GREEDY)[0].num_cached_tokens == 208
        held = llm.store_node.server.state.store.num_blocks
        llm.reset_prefix_cache(clear_store=False)  # the pool only: the store keeps its blocks and loads them back
        assert llm.engine.prefix_cache.num_cached_blocks == 0
        assert llm.store_node.server.state.store.num_blocks == held > 0
        assert llm.generate([prompts[0]], GREEDY)[0].num_cached_tokens == 208
        llm.reset_prefix_cache()
        assert llm.store_node.server.state.store.num_blocks == 0
        assert llm.generate([prompts[0]], GREEDY)[0].num_cached_tokens == 0
        _check_at_rest(llm)


def test_a_store_too_small_for_one_block_or_a_disk_without_dram_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="holds no KV block"):
        LLM("tiny-random", dtype="float32", kv_store_gb=1e-9)
    with pytest.raises(InvalidRequestError, match="kv_store_disk needs it"):
        LLM("tiny-random", dtype="float32", kv_store_disk="/tmp:1")


def test_a_process_that_never_closes_its_llm_leaves_no_shared_memory_behind(tmp_path: Path) -> None:
    code = ("from kvbaton import LLM, SamplingParams\n"
            "llm = LLM('tiny-random', dtype='float32', num_blocks=40, kv_store_gb=0.01)\n"
            "llm.generate([list(range(40))], SamplingParams(max_tokens=2))\n"
            "print(llm.store_node.server.state.slots.path, flush=True)\n")  # and exits without close()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    path = Path(proc.stdout.strip())
    assert path.name.startswith(SHM_PREFIX), path
    assert not path.exists(), "an unclosed LLM's store node left its DRAM file in /dev/shm"
