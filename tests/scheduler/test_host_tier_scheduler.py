"""A LocalScheduler whose prefix cache has a host tier, run against a fake executor that keeps "KV" per block.

The fake KV of a position is the token prefix up to it, so a block's contents name its whole prefix: a save
or load that copies the wrong block, or a promoted block placed at the wrong position, shows up as cached
blocks whose contents disagree with their path in the tree.
"""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvbaton.cache.block_pool import BlockPool
from kvbaton.cache.hashing import CacheKey, hash_prompt
from kvbaton.cache.host_tier import EvictedBlock, HostTier
from kvbaton.cache.radix_cache import RadixCache
from kvbaton.core.config import SchedulerConfig
from kvbaton.core.request import Request, RequestStatus
from kvbaton.core.step import SampledToken, StepPlan, StepResult
from kvbaton.scheduler.local_scheduler import LocalScheduler
from tests.scheduler.helpers import BLOCK_SIZE, CACHE_KEY, make_request

Contents = dict[int, tuple[int, ...]]  # slot in the block -> the token prefix up to that position


class FakeKV:
    """The executor's side: block contents on the device and in host blocks. A `TierIO` (copies, not aliases)."""

    def __init__(self) -> None:
        self.device: dict[int, Contents] = {}
        self.host: dict[int, Contents] = {}
        self.num_saves = 0
        self.num_loads = 0

    def save(self, device_block_ids: list[int], host_block_ids: list[int]) -> None:
        assert len(device_block_ids) == len(host_block_ids) == len(set(host_block_ids)) == len(set(device_block_ids))
        for device_block_id, host_block_id in zip(device_block_ids, host_block_ids):
            contents = self.device[device_block_id]
            assert len(contents) == BLOCK_SIZE, f"device block {device_block_id} saved before it was full"
            self.host[host_block_id] = dict(contents)
        self.num_saves += 1

    def load(self, host_block_ids: list[int], device_block_ids: list[int]) -> None:
        assert len(device_block_ids) == len(host_block_ids) == len(set(host_block_ids)) == len(set(device_block_ids))
        for host_block_id, device_block_id in zip(host_block_ids, device_block_ids):
            self.device[device_block_id] = dict(self.host[host_block_id])
        self.num_loads += 1

    def execute(self, sched: LocalScheduler, plan: StepPlan) -> None:
        """Write the KV of every position the plan computes into the chunk's block table."""
        for chunk in plan.chunks:
            request = sched.get_request(chunk.request_id)
            assert request is not None
            tokens = request.all_token_ids
            for pos in range(chunk.start_pos, chunk.end_pos):
                block_id, slot = chunk.block_ids[pos // BLOCK_SIZE], pos % BLOCK_SIZE
                if slot == 0:
                    self.device[block_id] = {}  # a fresh use of the block: no stale slots
                self.device[block_id][slot] = tuple(tokens[: pos + 1])

    def check_cached(self, cache: RadixCache, sequences: list[tuple[CacheKey, list[int]]]) -> None:
        """Every block on the cached device path of each sequence holds that sequence's KV."""
        for key, tokens in sequences:
            match = cache.match_prefix(key, tokens, touch=False)
            for index, block_id in enumerate(match.block_ids):
                start = index * BLOCK_SIZE
                expected = {slot: tuple(tokens[: start + slot + 1]) for slot in range(BLOCK_SIZE)}
                assert self.device.get(block_id) == expected, f"block {block_id} at block {index} of {tokens}"


class Harness:
    """A scheduler over a small pool, its cache and (optionally) host tier, and the fake executor."""

    def __init__(self, num_blocks: int, num_host_blocks: int, *, budget: int = 64, max_num_seqs: int = 8,
                 policy: str = "fcfs") -> None:
        self.kv = FakeKV()
        self.pool = BlockPool(num_blocks)
        self.tier = HostTier(num_host_blocks, self.kv) if num_host_blocks else None
        self.cache = RadixCache(self.pool, BLOCK_SIZE, self.tier)
        config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, queue_policy=policy)
        self.sched = LocalScheduler(config, BLOCK_SIZE, self.pool, self.cache, CACHE_KEY)
        self.sequences: list[tuple[CacheKey, list[int]]] = []  # prompts, then finished requests' whole sequences
        self.finished: list[Request] = []
        self.now = 0.0

    def add(self, request: Request, *, seeded: bool = False) -> Request:
        """Queue `request`; `seeded`: with its prompt already hashed, as the simulator passes it."""
        key = CACHE_KEY.with_tenant(request.tenant)
        self.sched.add_request(request, hash_prompt(key, request.prompt_token_ids, BLOCK_SIZE) if seeded else None)
        self.sequences.append((key, list(request.prompt_token_ids)))
        return request

    def schedule(self) -> StepPlan:
        self.now += 1.0
        plan = self.sched.schedule(self.now)
        self.kv.execute(self.sched, plan)
        return plan

    def update(self, plan: StepPlan, token_id: int = 7) -> None:
        sampled = {c.request_id: SampledToken(token_id) for c in plan.chunks if c.samples}
        self.sched.update(plan, StepResult(plan.step_id, sampled), self.now)
        self.take_finished()
        self.check()

    def step(self, token_id: int = 7) -> StepPlan:
        plan = self.schedule()
        self.update(plan, token_id)
        return plan

    def take_finished(self) -> None:
        for request in self.sched.take_finished():
            self.finished.append(request)
            self.sequences.append((CACHE_KEY.with_tenant(request.tenant), request.all_token_ids))

    def run(self, request: Request, max_steps: int = 50) -> Request:
        self.add(request)
        self.drain(max_steps)
        return request

    def drain(self, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("requests never finished")

    def check(self) -> None:
        self.sched.check_invariants()  # and BlockManager.check_invariants(running)
        self.pool.check_invariants()
        self.cache.check_invariants()  # and the tier's
        self.kv.check_cached(self.cache, self.sequences)

    def check_released(self) -> None:
        """Nothing runs: only the cache holds device blocks, and clearing it frees every device and host block."""
        assert not self.sched.has_unfinished_requests()
        assert self.pool.num_used_blocks == self.cache.num_cached_blocks
        assert all(self.pool.ref_count(b) in (0, 1) for b in range(self.pool.num_blocks))
        self.check()
        self.cache.clear()
        assert self.pool.num_free_blocks == self.pool.num_blocks
        if self.tier is not None:
            assert self.tier.num_cached_blocks == 0
            # A host block still taken for a promotion survives `clear`: filling the whole tier would drop one.
            self.kv.device.update({-1 - i: {slot: (i,) for slot in range(BLOCK_SIZE)}
                                   for i in range(self.tier.num_blocks)})
            fillers = [EvictedBlock(hash((0, (i,))), (i,), 0, -1 - i) for i in range(self.tier.num_blocks)]
            assert self.tier.demote(fillers) == []
            self.tier.check_invariants(set())


def prompt(group: int, suffix: int, num_prefix_blocks: int = 3) -> list[int]:
    """A shared prefix of `group` (whole blocks), then two tokens of its own."""
    return [100 * (group + 1) + i for i in range(num_prefix_blocks * BLOCK_SIZE)] + [9000 + suffix, 9100 + suffix]


def request_of(group: int, suffix: int, max_tokens: int = 2) -> Request:
    return make_request(f"g{group}-{suffix}", prompt(group, suffix), max_tokens=max_tokens)


ROUNDS = [0, 1, 2, 3, 0, 1, 2, 3, 0]  # four groups of 3 cached blocks each; the pool caches two


def run_rounds(num_host_blocks: int) -> tuple[Harness, list[Request], list[int]]:
    """The requests of ROUNDS one after another; also how many blocks each loaded from the tier."""
    harness = Harness(8, num_host_blocks)
    requests: list[Request] = []
    num_loaded: list[int] = []
    for i, group in enumerate(ROUNDS):
        before = harness.tier.num_loaded_blocks if harness.tier else 0
        requests.append(harness.run(request_of(group, i)))
        num_loaded.append((harness.tier.num_loaded_blocks if harness.tier else 0) - before)
    return harness, requests, num_loaded


# ---- fixed scenarios --------------------------------------------------------------------------------


def test_a_prefix_evicted_from_the_device_comes_back_from_the_tier() -> None:
    harness, requests, num_loaded = run_rounds(num_host_blocks=16)
    # After round one each group's prefix is gone from the device, and all 3 blocks come back from the host.
    assert [r.num_cached_tokens for r in requests] == [0, 0, 0, 0, 12, 12, 12, 12, 12]
    assert num_loaded == [0, 0, 0, 0, 3, 3, 3, 3, 3]
    tier = harness.tier
    assert tier is not None and tier.num_dropped_blocks == 0 and harness.kv.num_loads == 5
    harness.check_released()


def test_a_smaller_tier_or_none_hits_less_on_the_same_stream() -> None:
    tiered, _, _ = run_rounds(num_host_blocks=16)
    small, small_requests, _ = run_rounds(num_host_blocks=4)
    plain, plain_requests, _ = run_rounds(num_host_blocks=0)
    assert [h.sched.stats().prefix_cache_hits_tokens for h in (tiered, small, plain)] == [60, 40, 0]
    # A 4-block tier keeps the first two blocks of each chain: tails are dropped before heads.
    assert [r.num_cached_tokens for r in small_requests] == [0, 0, 0, 0, 8, 8, 8, 8, 8]
    assert [r.num_cached_tokens for r in plain_requests] == [0] * len(ROUNDS)  # LRU thrash: each group is gone
    for harness in (tiered, small, plain):
        harness.check_released()


def test_peek_counts_tier_blocks_without_moving_them() -> None:
    harness = Harness(8, 16)
    for i, group in enumerate([0, 1, 2, 3]):
        harness.run(request_of(group, i))
    tier = harness.tier
    assert tier is not None
    stored = tier.stored()
    waiting = harness.add(request_of(0, 10))
    assert harness.cache.match_prefix(CACHE_KEY, waiting.prompt_token_ids, touch=False).num_blocks == 0
    assert harness.sched.blocks.peek_cached_tokens(waiting) == 12
    assert tier.stored() == stored and tier.num_loaded_blocks == 0
    harness.drain()
    assert waiting.num_cached_tokens == 12
    harness.check_released()


def test_abort_right_after_a_promoted_admission_leaves_the_blocks_cached() -> None:
    harness = Harness(8, 16)
    for i, group in enumerate([0, 1, 2, 3]):
        harness.run(request_of(group, i))
    assert harness.cache.match_prefix(CACHE_KEY, prompt(0, 0), touch=False).num_blocks == 0
    request = harness.add(request_of(0, 10))
    plan = harness.schedule()
    assert request.status is RequestStatus.RUNNING and request.num_cached_tokens == 12
    assert [(c.request_id, c.start_pos, c.end_pos) for c in plan.chunks] == [(request.request_id, 12, 14)]
    harness.sched.abort_request(request.request_id, harness.now)
    harness.update(plan)  # the aborted request's chunk is ignored
    assert request.block_ids == [] and harness.finished[-1] is request
    # The promoted blocks stay on the device (cached, unlocked); the tier gave them up.
    assert harness.cache.match_prefix(CACHE_KEY, prompt(0, 0), touch=False).num_blocks == 3
    assert harness.pool.num_used_blocks == harness.cache.num_cached_blocks == harness.cache.num_evictable_blocks
    again = harness.run(request_of(0, 11))
    assert again.num_cached_tokens == 12
    harness.check_released()


def test_a_pool_too_small_for_the_whole_host_chain_loads_part_and_puts_the_rest_back() -> None:
    harness = Harness(8, 16)
    harness.run(request_of(0, 0))  # 3 cached blocks; 5 free
    long_runner = harness.add(make_request("long", [50 + i for i in range(21)], max_tokens=3))  # 6 blocks
    short = harness.add(make_request("short", [60, 61, 62], max_tokens=1))  # 1 block, done after one step
    harness.step()  # admitting both evicts group 0's last two blocks into the tier
    assert short.status is RequestStatus.FINISHED and long_runner.status is RequestStatus.RUNNING
    tier = harness.tier
    assert tier is not None and tier.num_cached_blocks == 2 and harness.pool.num_free_blocks == 1
    assert harness.cache.match_prefix(CACHE_KEY, prompt(0, 0), touch=False).num_blocks == 1
    request = harness.add(request_of(0, 10), seeded=True)  # the tier continues from the device's hashes
    harness.step()
    # One block on the device, two in the tier, one free device block: the second block was loaded, the third
    # put back; the rest of the prompt did not fit, so the request waits holding nothing.
    assert request.status is RequestStatus.WAITING and request.block_ids == []
    assert tier.num_cached_blocks == 1 and tier.num_loaded_blocks == 1
    assert harness.cache.match_prefix(CACHE_KEY, prompt(0, 0), touch=False).num_blocks == 2
    assert tier.match(harness.cache.match_prefix(CACHE_KEY, prompt(0, 0), touch=False).block_hashes[-1],
                      [tuple(prompt(0, 0)[8:12])], namespace=CACHE_KEY) == 1
    harness.drain()
    assert request.num_cached_tokens == 12  # two blocks from the device, the third from the tier
    harness.check_released()


def test_a_preempted_request_with_a_promoted_prefix_gets_it_back() -> None:
    harness = Harness(5, 16)
    for i, group in enumerate([0, 1, 2]):
        harness.run(request_of(group, i))
    assert harness.cache.match_prefix(CACHE_KEY, prompt(0, 0), touch=False).num_blocks == 0
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
    # Its promoted blocks stay cached on the device, unlocked; `first` growing demotes the deepest one.
    assert harness.cache.match_prefix(CACHE_KEY, prompt(0, 0), touch=False).num_blocks == 3
    tier = harness.tier
    assert tier is not None and tier.num_loaded_blocks == 3
    harness.drain()
    assert tier.num_loaded_blocks == 4  # the re-admission loaded it back
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
    st.sampled_from(["", "", "t2"]),  # tenant: its own namespace in both tiers
)
step_op = st.tuples(st.just("step"), st.integers(1, 9))  # the sampled token
abort_op = st.tuples(st.just("abort"), st.integers(0, 30), st.booleans())  # mid-step (after schedule)?


@settings(max_examples=80, deadline=None, derandomize=True)
@given(
    ops=st.lists(st.one_of(add_op, step_op, step_op, abort_op), min_size=20, max_size=60),
    num_blocks=st.integers(4, 8),
    num_host_blocks=st.integers(2, 8),
    budget=st.sampled_from([5, 16, 64]),
    policy=st.sampled_from(["fcfs", "lpm"]),
    max_num_seqs=st.integers(1, 4),
)
def test_random_streams_keep_both_tiers_consistent(
    ops: list[tuple], num_blocks: int, num_host_blocks: int, budget: int, policy: str, max_num_seqs: int,
) -> None:
    harness = Harness(num_blocks, num_host_blocks, budget=budget, policy=policy, max_num_seqs=max_num_seqs)
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
    tier = harness.tier
    assert tier is not None
    event(f"promoted={tier.num_loaded_blocks > 0}")
    event(f"dropped={tier.num_dropped_blocks > 0}")
    event(f"preempted={sched.stats().num_preemptions > 0}")
    harness.check_released()
