"""Regressions found by bug hunting: the block manager and the LocalScheduler's admission paths.

Each test failed on the code it was written against; the fix it guards is named in its comment.
"""

from __future__ import annotations

from kvbaton.cache.events import KVEventKind
from kvbaton.core.request import RequestStatus
from kvbaton.scheduler.local_scheduler import LocalScheduler
from tests.scheduler.helpers import chunk_spans, make_request, make_scheduler, step

WARM_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]  # two full blocks of 4 tokens


def _two_cached_blocks_and_one_free() -> LocalScheduler:
    """A 5-block pool: `warm` finished, leaving its 2 prompt blocks cached and unlocked; `run` (5 tokens) runs on 2
    blocks of its own (the first one cached, locked); 1 block is free, so 3 can be had by evicting."""
    sched = make_scheduler(num_blocks=5, prefix_cache=True)
    sched.add_request(make_request("warm", WARM_PROMPT, max_tokens=1))
    step(sched)
    sched.add_request(make_request("run", [20, 21, 22, 23, 24], max_tokens=50))
    step(sched)
    cache, pool = sched.blocks.cache, sched.blocks.pool
    assert (cache.num_cached_blocks, cache.num_evictable_blocks, pool.num_free_blocks) == (3, 2, 1)
    cache.take_events()
    return sched


def _evicted_hashes(sched: LocalScheduler) -> list[int]:
    return [h for e in sched.blocks.cache.take_events() if e.kind is not KVEventKind.STORED for h in e.block_hashes]


def test_a_refused_handoff_admission_evicts_nothing() -> None:
    # Was a bug (scheduler/block_manager.py `try_grow`): short of blocks, it evicted cached ones before knowing
    # whether the eviction could cover the shortfall, so `admit_prefilled` returned False ("changing nothing") after
    # flushing the prefix cache, again at every retry of a backpressured handoff. Fixed: `try_grow` evicts only
    # when the evictable blocks cover the shortfall, and otherwise fails with the cache as it was.
    sched = _two_cached_blocks_and_one_free()
    handed_off = make_request("handed", [30 + i for i in range(13)], max_tokens=4)
    handed_off.output_token_ids.append(7)
    assert not sched.admit_prefilled(handed_off, 13, 1.0)  # 4 blocks: 1 free + 2 evictable do not cover them
    assert sched.blocks.cache.num_cached_blocks == 3 and sched.blocks.pool.num_free_blocks == 1
    assert _evicted_hashes(sched) == []
    sched.check_invariants()


def test_a_waiting_request_that_does_not_fit_yet_leaves_the_cache_alone() -> None:
    # Was a bug (scheduler/block_manager.py `try_grow`, called by `_admit_waiting`): the head of the queue, too big
    # for the blocks left, evicted every unlocked cached block at each step's admission attempt and was then refused
    # anyway, so the prefix cache was flushed (EVICTED events to the router included) while it waited for running
    # requests to finish, and a request sharing a cached prefix that came next found nothing. Fixed as above.
    sched = _two_cached_blocks_and_one_free()
    sched.add_request(make_request("big", [40 + i for i in range(16)], max_tokens=1))  # one 16-token chunk: 4 blocks
    plan, _ = step(sched, 1.0)
    assert chunk_spans(plan) == [("run", 5, 6, True)]
    assert sched.get_request("big").status is RequestStatus.WAITING
    assert sched.blocks.cache.num_cached_blocks == 3 and _evicted_hashes(sched) == []
    assert sched.blocks.peek_cached_tokens(make_request("again", WARM_PROMPT + [9], max_tokens=1)) == 8
