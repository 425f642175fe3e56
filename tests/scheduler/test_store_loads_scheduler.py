"""The scheduler loads a prefix the device evicted back from the KV store: LocalScheduler, BlockManager and
RadixCache with a `StoreTier` over a one-node store, against the fake executor of `store_harness`.

Prompts are `prompt(group, suffix)`: 3 blocks of the group's prefix and 2 tokens of their own (14 tokens); with
`max_tokens=2` a request computes 15 positions, so it caches (and writes through) the 3 prefix blocks and needs 4
device blocks while it runs. `ROUNDS` takes 4 groups in turn through an 8-block pool, which keeps only the last
group or two: from round 4 on, each group's prefix is gone from the device.
"""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvbaton.core.request import Request, RequestStatus
from tests.scheduler.helpers import BLOCK_SIZE, make_request
from tests.scheduler.store_harness import Harness, prompt, request_of

ROUNDS = [0, 1, 2, 3, 0, 1, 2, 3, 0]


def run_rounds(num_dram_blocks: int) -> tuple[Harness, list[Request], list[int]]:
    """The requests of ROUNDS one after another; also how many blocks each loaded from the store."""
    harness = Harness(8, num_dram_blocks)
    requests: list[Request] = []
    num_loaded: list[int] = []
    for i, group in enumerate(ROUNDS):
        before = harness.tier.num_loaded_blocks if harness.tier else 0
        requests.append(harness.run(request_of(group, i)))
        num_loaded.append((harness.tier.num_loaded_blocks if harness.tier else 0) - before)
    return harness, requests, num_loaded


def run_groups(harness: Harness, groups: list[int]) -> None:
    for i, group in enumerate(groups):
        harness.run(request_of(group, i))


# ---- fixed scenarios --------------------------------------------------------------------------------


def test_a_prefix_evicted_from_the_device_comes_back_from_the_store_with_its_kv() -> None:
    harness, requests, num_loaded = run_rounds(num_dram_blocks=16)
    # The store keeps all 12 prefix blocks; from round 4 on each group's 3 come back, one load per admission.
    assert [r.num_cached_tokens for r in requests] == [0, 0, 0, 0, 12, 12, 12, 12, 12]
    assert num_loaded == [0, 0, 0, 0, 3, 3, 3, 3, 3]
    tier, io = harness.tier, harness.io
    assert tier is not None and io is not None and io.num_loads == 5
    # Each block was written once, by the round that computed it: a loaded block is one the store holds.
    assert tier.num_saved_blocks == tier.num_cached_blocks == 12
    assert harness.sched.stats().num_store_loaded_blocks == 15
    harness.check_released()


def test_a_smaller_store_or_none_hits_less_on_the_same_stream() -> None:
    stored, _, _ = run_rounds(num_dram_blocks=16)
    small, small_requests, small_loaded = run_rounds(num_dram_blocks=11)
    plain, plain_requests, _ = run_rounds(num_dram_blocks=0)
    assert [h.sched.stats().prefix_cache_hits_tokens for h in (stored, small, plain)] == [60, 40, 0]
    # 11 blocks, one short of the stream's 12: the first eviction takes group 0's last block (every priority ties
    # and the deepest goes first); from then on each round loads its group's first two blocks, used again so they
    # outrank blocks only written, and writing its last block evicts the next group's last one.
    assert [r.num_cached_tokens for r in small_requests] == [0, 0, 0, 0, 8, 8, 8, 8, 8]
    assert small_loaded == [0, 0, 0, 0, 2, 2, 2, 2, 2]
    assert [r.num_cached_tokens for r in plain_requests] == [0] * len(ROUNDS)  # LRU thrash: each group is gone
    for harness in (stored, small, plain):
        harness.check_released()


def test_peek_counts_store_blocks_without_moving_or_pinning_them() -> None:
    harness = Harness(8, 16)
    run_groups(harness, [0, 1, 2, 3])
    waiting = harness.add(request_of(0, 10))
    assert harness.device_blocks(waiting.prompt_token_ids) == 0
    store, tier = harness.store, harness.tier
    assert store is not None and tier is not None
    entries, seq = harness.store_entries(), store.nodes["n0"].seq
    assert harness.sched.blocks.peek_cached_tokens(waiting) == 12
    # No use counted, no priority or tier changed, no pin, no event: the store is as it was.
    assert harness.store_entries() == entries and store.nodes["n0"].seq == seq
    assert tier.num_loaded_blocks == 0 and harness.num_pinned_store_blocks() == 0
    harness.drain()
    assert waiting.num_cached_tokens == 12 and tier.num_loaded_blocks == 3
    harness.check_released()


def test_abort_right_after_an_admission_that_loaded_blocks_leaves_them_cached() -> None:
    harness = Harness(8, 16)
    run_groups(harness, [0, 1, 2, 3])
    assert harness.device_blocks(prompt(0, 0)) == 0
    request = harness.add(request_of(0, 10))
    plan = harness.schedule()
    assert request.status is RequestStatus.RUNNING and request.num_cached_tokens == 12
    assert [(c.request_id, c.start_pos, c.end_pos) for c in plan.chunks] == [(request.request_id, 12, 14)]
    harness.sched.abort_request(request.request_id, harness.now)
    harness.update(plan)  # the aborted request's chunk is ignored
    assert request.block_ids == [] and harness.finished[-1] is request
    # The loaded blocks stay on the device (cached, unlocked), and the store keeps its copies, unpinned.
    assert harness.device_blocks(prompt(0, 0)) == 3
    assert harness.pool.num_used_blocks == harness.cache.num_cached_blocks == harness.cache.num_evictable_blocks
    assert harness.stored_blocks(prompt(0, 0)) == 3 and harness.num_pinned_store_blocks() == 0
    again = harness.run(request_of(0, 11))
    tier = harness.tier
    assert again.num_cached_tokens == 12 and tier is not None and tier.num_loaded_blocks == 3  # from the device
    harness.check_released()


def test_a_pool_too_small_for_the_whole_stored_chain_loads_part_and_puts_the_rest_back() -> None:
    harness = Harness(8, 16)
    harness.run(request_of(0, 0))  # 3 cached blocks; 5 free
    long_runner = harness.add(make_request("long", [50 + i for i in range(21)], max_tokens=3))  # 6 blocks
    short = harness.add(make_request("short", [60, 61, 62], max_tokens=1))  # 1 block, done after one step
    harness.step()  # admitting both evicts group 0's last two blocks from the device
    assert short.status is RequestStatus.FINISHED and long_runner.status is RequestStatus.RUNNING
    tier = harness.tier
    assert tier is not None and harness.pool.num_free_blocks == 1
    assert harness.device_blocks(prompt(0, 0)) == 1
    # Group 0's 3 blocks and the long prompt's 5 full ones were written through; the device's eviction kept them.
    assert tier.num_cached_blocks == 8 and harness.stored_blocks(prompt(0, 0)) == 3
    request = harness.add(request_of(0, 10), seeded=True)  # the store continues from the device's hashes
    harness.step()
    # One block on the device, two more in the store, one free device block and nothing evictable (the long
    # request holds its blocks): the second block was loaded and the third put back; the rest of the prompt did not
    # fit, so the request waits holding nothing.
    assert request.status is RequestStatus.WAITING and request.block_ids == []
    assert tier.num_loaded_blocks == 1 and harness.device_blocks(prompt(0, 0)) == 2
    assert harness.stored_blocks(prompt(0, 0)) == 3 and harness.num_pinned_store_blocks() == 0
    harness.drain()
    assert request.num_cached_tokens == 12  # two blocks from the device, the third from the store
    assert tier.num_loaded_blocks == 2
    harness.check_released()


def test_a_preempted_request_whose_prefix_was_loaded_gets_it_back() -> None:
    harness = Harness(5, 16)
    run_groups(harness, [0, 1, 2])
    assert harness.device_blocks(prompt(0, 0)) == 0
    first = harness.add(make_request("first", [70, 71, 72], max_tokens=10))
    victim = harness.add(request_of(0, 10, max_tokens=6))
    harness.step()
    assert victim.num_cached_tokens == 12 and harness.pool.num_free_blocks == 0
    for _ in range(10):
        plan = harness.step()
        if plan.preempted_ids:
            break
    assert plan.preempted_ids == (victim.request_id,)
    assert victim.status is RequestStatus.PREEMPTED and victim.block_ids == []
    # Its loaded blocks stay cached on the device, unlocked; `first` growing later evicts the deepest one from the
    # device, which the store still holds.
    assert harness.device_blocks(prompt(0, 0)) == 3
    tier = harness.tier
    assert tier is not None and tier.num_loaded_blocks == 3
    harness.drain()
    assert tier.num_loaded_blocks == 4  # the re-admission loaded that one back
    assert first.status is victim.status is RequestStatus.FINISHED
    assert victim.num_output_tokens == 6 and victim.num_preemptions == 1
    harness.check_released()


# ---- random streams -----------------------------------------------------------------------------------


GROUPS = 3
add_op = st.tuples(
    st.just("add"),
    st.integers(0, GROUPS - 1),
    st.sampled_from([0, 1, 2, 3, 3]),  # prefix blocks kept
    st.lists(st.integers(1, 3), max_size=6),  # suffix
    st.integers(1, 6),  # max_tokens
    st.booleans(),  # seeded with its prompt's hashes
    st.sampled_from(["", "", "t2"]),  # tenant: its own namespace on the device and in the store
)
step_op = st.tuples(st.just("step"), st.integers(1, 9))  # the sampled token
abort_op = st.tuples(st.just("abort"), st.integers(0, 30), st.booleans())  # mid-step (after schedule)?


@settings(max_examples=80, deadline=None, derandomize=True)
@given(
    ops=st.lists(st.one_of(add_op, step_op, step_op, abort_op), min_size=40, max_size=80),
    num_blocks=st.integers(4, 8),
    store_blocks=st.one_of(st.tuples(st.integers(1, 12), st.integers(0, 4)),  # (DRAM, disk) blocks
                           st.tuples(st.just(0), st.integers(1, 4))),  # disk only
    budget=st.sampled_from([5, 16, 64]),
    policy=st.sampled_from(["fcfs", "lpm"]),
    max_num_seqs=st.integers(1, 4),
)
def test_random_streams_keep_the_device_and_the_store_consistent(
    ops: list[tuple], num_blocks: int, store_blocks: tuple[int, int], budget: int, policy: str, max_num_seqs: int,
) -> None:
    harness = Harness(num_blocks, *store_blocks, budget=budget, policy=policy, max_num_seqs=max_num_seqs)
    sched = harness.sched
    added: list[str] = []
    for op in ops:
        if op[0] == "add":
            _, group, num_prefix_blocks, suffix, max_tokens, seeded, tenant = op
            tokens = prompt(group, 0, num_prefix_blocks)[: num_prefix_blocks * BLOCK_SIZE] + suffix
            if not tokens or -(-(len(tokens) + max_tokens) // BLOCK_SIZE) > num_blocks:
                continue  # could never fit
            request = make_request(f"r{len(added)}", tokens, max_tokens=max_tokens, tenant=tenant)
            added.append(harness.add(request, seeded=seeded).request_id)
        elif op[0] == "step":
            harness.step(op[1])
        elif op[2]:  # abort one of the step's requests between schedule and update
            plan = harness.schedule()
            if plan.chunks:
                sched.abort_request(plan.chunks[op[1] % len(plan.chunks)].request_id, harness.now)
            harness.update(plan)
        elif added:
            sched.abort_request(added[op[1] % len(added)], harness.now)
            harness.take_finished()
            harness.check()
    harness.drain(400)
    assert sorted(r.request_id for r in harness.finished) == sorted(added)
    tier, store, io = harness.tier, harness.store, harness.io
    assert tier is not None and store is not None and io is not None
    event(f"loaded={tier.num_loaded_blocks > 0}")
    event(f"loaded from disk={io.num_disk_loaded_blocks > 0}")
    event(f"store evicted={store.num_evicted_blocks > 0}")
    event(f"preempted={sched.stats().num_preemptions > 0}")
    harness.check_released()
