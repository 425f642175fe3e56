"""`cached_tokens` only ever counts blocks of the caller's own tenant and salt: a property test through the real
LocalScheduler, BlockManager, RadixCache and host tier, driven by tenants that send identical prompts.

The fake executor writes each position's KV as (tenant salt, the token prefix up to it), so a block names who
computed it and for which prefix. Before a chunk runs, every position it attends to (its context: cached or
computed earlier) must hold the KV of the request's own namespace and prefix; so a cache hit, from the device
or the host tier, that crossed a namespace fails here, and so does a reported `num_cached_tokens` that
counts such blocks (they are the context of the first chunk).

Why it holds, through the code: the tenant salt of a request is `tenant_salt(key tenant, client tenant, cache
salt)`, injective (tests/server/test_auth_tenants.py); `BlockManager` looks every request up under
`cache_key.with_tenant(request.tenant)`; the radix cache keeps one tree per `CacheKey`, found by equality
of the whole key, and walks it by token tuples; the host tier continues a match only on blocks demoted
from an equal key. No step compares a hash alone, so no hash collision can join two namespaces.
"""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvbaton.cache.hashing import CacheKey, tenant_salt
from kvbaton.cache.radix_cache import RadixCache
from kvbaton.core.step import StepPlan
from kvbaton.scheduler.local_scheduler import LocalScheduler
from tests.scheduler.helpers import BLOCK_SIZE, make_request
from tests.scheduler.test_host_tier_scheduler import FakeKV, Harness

# (key tenant, client tenant, cache salt) triples whose parts look alike: the old "\x1f"-joined encoding made
# the first two one namespace.
TRIPLES = [("", "a\x1fsalt:b", ""), ("", "a", "b"), ("a", "", ""), ("", "a", ""), ("a", "", "b"), ("", "", "")]
NAMESPACES = [tenant_salt(*triple) for triple in TRIPLES]
# Prompts that share whole blocks, so different tenants send the very same tokens.
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [1, 2, 3, 4, 5, 6, 7, 8, 20, 21],
           [1, 2, 3, 4, 30, 31, 32, 33, 34, 35, 36, 37, 38], [40, 41, 42, 43, 44, 45, 46, 47, 48]]


class TenantKV(FakeKV):
    """A position's KV is (the request's tenant salt, its token prefix); what a chunk reads is checked first."""

    def execute(self, sched: LocalScheduler, plan: StepPlan) -> None:
        for chunk in plan.chunks:
            request = sched.get_request(chunk.request_id)
            assert request is not None
            tokens = request.all_token_ids
            for pos in range(chunk.start_pos):  # the context this chunk attends to
                block_id, slot = chunk.block_ids[pos // BLOCK_SIZE], pos % BLOCK_SIZE
                held = self.device.get(block_id, {}).get(slot)
                assert held == (request.tenant, tuple(tokens[: pos + 1])), (
                    f"{request.request_id} (tenant {request.tenant!r}) reads position {pos} holding {held}")
            for pos in range(chunk.start_pos, chunk.end_pos):
                block_id, slot = chunk.block_ids[pos // BLOCK_SIZE], pos % BLOCK_SIZE
                if slot == 0:
                    self.device[block_id] = {}
                self.device[block_id][slot] = (request.tenant, tuple(tokens[: pos + 1]))  # type: ignore[assignment]

    def check_cached(self, cache: RadixCache, sequences: list[tuple[CacheKey, list[int]]]) -> None:
        for key, tokens in sequences:
            for index, block_id in enumerate(cache.match_prefix(key, tokens, touch=False).block_ids):
                start = index * BLOCK_SIZE
                expected = {slot: (key.tenant_salt, tuple(tokens[: start + slot + 1])) for slot in range(BLOCK_SIZE)}
                assert self.device.get(block_id) == expected, f"block {block_id} under {key}"


def tenant_harness(num_blocks: int, num_host_blocks: int) -> Harness:
    harness = Harness(num_blocks, num_host_blocks, budget=16, max_num_seqs=4)
    harness.kv = TenantKV()
    if harness.tier is not None:
        harness.tier.io = harness.kv  # demotions and promotions copy the tenant-tagged KV
    return harness


@settings(max_examples=150, deadline=None, derandomize=True)
@given(arrivals=st.lists(st.tuples(st.sampled_from(range(len(NAMESPACES))), st.sampled_from(range(len(PROMPTS))),
                                   st.integers(0, 3)), min_size=1, max_size=24),
       num_host_blocks=st.sampled_from([0, 6, 32]))
def test_cached_tokens_only_count_the_callers_own_namespace(arrivals: list[tuple[int, int, int]],
                                                            num_host_blocks: int) -> None:
    harness = tenant_harness(12, num_host_blocks)  # a small pool: eviction (and demotion) happens
    requests = []
    for i, (namespace, prompt, steps_before) in enumerate(arrivals):
        request = make_request(f"r{i}", PROMPTS[prompt], max_tokens=2, tenant=NAMESPACES[namespace])
        requests.append(harness.add(request, seeded=i % 2 == 0))
        for _ in range(steps_before):
            if harness.sched.has_unfinished_requests():
                harness.step()
    harness.drain()
    triple_of = {f"r{i}": TRIPLES[namespace] for i, (namespace, _, _) in enumerate(arrivals)}
    for request in requests:
        # What the answer reports: never more than the longest block-aligned prefix computed before it for an
        # equal (key tenant, client tenant, cache salt) triple (the KV check above proved each counted block
        # was computed under the request's own salt).
        earlier = [r for r in requests[: requests.index(request)]
                   if triple_of[r.request_id] == triple_of[request.request_id]]
        best = max((_shared_blocks(request.prompt_token_ids, r.all_token_ids) for r in earlier), default=0)
        assert request.num_cached_tokens <= best * BLOCK_SIZE
        if request.num_cached_tokens:
            event("a cache hit within one namespace")
    harness.check_released()


def _shared_blocks(a: list[int], b: list[int]) -> int:
    shared = 0
    for x, y in zip(a, b):
        if x != y:
            break
        shared += 1
    return min(shared, len(a) - 1) // BLOCK_SIZE


def test_the_same_prompt_hits_only_its_own_namespace_on_the_device_and_from_the_host_tier() -> None:
    harness = tenant_harness(8, 32)
    prompt = PROMPTS[0]
    first = harness.run(make_request("a1", prompt, tenant=NAMESPACES[0]))
    others = [harness.run(make_request(f"o{i}", prompt, tenant=ns)) for i, ns in enumerate(NAMESPACES[1:])]
    again = harness.run(make_request("a2", prompt, tenant=NAMESPACES[0]))
    assert first.num_cached_tokens == 0 and [r.num_cached_tokens for r in others] == [0] * len(others)
    assert again.num_cached_tokens == 12  # its own blocks, back from the host tier after the others evicted them
    assert harness.tier is not None and harness.tier.num_loaded_blocks >= 3
    harness.check_released()
