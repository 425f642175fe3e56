"""`cached_tokens` only ever counts blocks of the caller's own tenant and salt: a property test through the real
LocalScheduler, BlockManager, RadixCache and the KV store as its tier (`StoreTier`), driven by tenants that send
identical prompts.

The fake executor writes each position's KV as (tenant salt, the token prefix up to it), and the store's fake IO
copies it to and from the store's blocks, so a block names who computed it and for which prefix. Before a chunk
runs, every position it attends to (its context: cached, loaded or computed earlier) must hold the KV of the
request's own namespace and prefix; so a cache hit, on the device or from the store, that crossed a namespace fails
here, and so does a reported `num_cached_tokens` that counts such blocks (they are the context of the first chunk).

Why it holds, through the code: the tenant salt of a request is `tenant_salt(key tenant, client tenant, cache
salt)`, injective (tests/server/test_auth_tenants.py); `BlockManager` looks every request up under
`cache_key.with_tenant(request.tenant)`; the radix cache keeps one tree per `CacheKey`, found by equality
of the whole key, and walks it by token tuples; the store keeps each block's key beside its hash and matches
both. No step compares a hash alone, so no hash collision can join two namespaces.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvbaton.cache.hashing import hash_block_tokens, tenant_salt
from tests.scheduler.helpers import BLOCK_SIZE, CACHE_KEY, make_request
from tests.scheduler.store_harness import FakeKV, Harness

# (key tenant, client tenant, cache salt) triples whose parts look alike: the old "\x1f"-joined encoding made
# the first two one namespace.
TRIPLES = [("", "a\x1fsalt:b", ""), ("", "a", "b"), ("a", "", ""), ("", "a", ""), ("a", "", "b"), ("", "", "")]
NAMESPACES = [tenant_salt(*triple) for triple in TRIPLES]
# Prompts that share whole blocks, so different tenants send the very same tokens.
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [1, 2, 3, 4, 5, 6, 7, 8, 20, 21],
           [1, 2, 3, 4, 30, 31, 32, 33, 34, 35, 36, 37, 38], [40, 41, 42, 43, 44, 45, 46, 47, 48]]


class TenantKV(FakeKV):
    """A position's KV is (the tenant salt it was computed for, its token prefix)."""

    def kv_at(self, tenant: str, tokens: Sequence[int], pos: int) -> tuple:
        return tenant, tuple(tokens[: pos + 1])


def tenant_harness(num_blocks: int, num_dram_blocks: int, num_disk_blocks: int = 0) -> Harness:
    """The harness with the tenant-tagged KV, which its store IO copies to and from the store's blocks."""
    return Harness(num_blocks, num_dram_blocks, num_disk_blocks, budget=16, max_num_seqs=4, kv=TenantKV())


@settings(max_examples=150, deadline=None, derandomize=True)
@given(arrivals=st.lists(st.tuples(st.sampled_from(range(len(NAMESPACES))), st.sampled_from(range(len(PROMPTS))),
                                   st.integers(0, 3)), min_size=1, max_size=24),
       store_blocks=st.sampled_from([(0, 0), (6, 0), (2, 4), (32, 0)]))  # (DRAM, disk); (0, 0): no store
def test_cached_tokens_only_count_the_callers_own_namespace(arrivals: list[tuple[int, int, int]],
                                                            store_blocks: tuple[int, int]) -> None:
    harness = tenant_harness(6, *store_blocks)  # a small pool: the device evicts, the store loads back
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
        # equal (key tenant, client tenant, cache salt) triple (the executor's check of each chunk's context proved
        # each counted block was computed under the request's own salt).
        earlier = [r for r in requests[: requests.index(request)]
                   if triple_of[r.request_id] == triple_of[request.request_id]]
        best = max((_shared_blocks(request.prompt_token_ids, r.all_token_ids) for r in earlier), default=0)
        assert request.num_cached_tokens <= best * BLOCK_SIZE
        if request.num_cached_tokens:
            event("a cache hit within one namespace")
    if harness.tier is not None and harness.tier.num_loaded_blocks:
        event("loaded from the store")
    harness.check_released()


def _shared_blocks(a: list[int], b: list[int]) -> int:
    shared = 0
    for x, y in zip(a, b):
        if x != y:
            break
        shared += 1
    return min(shared, len(a) - 1) // BLOCK_SIZE


def test_the_same_prompt_hits_only_its_own_namespace_on_the_device_and_from_the_store() -> None:
    harness = tenant_harness(8, 32)
    prompt = PROMPTS[0]
    first = harness.run(make_request("a1", prompt, tenant=NAMESPACES[0]))
    others = [harness.run(make_request(f"o{i}", prompt, tenant=ns)) for i, ns in enumerate(NAMESPACES[1:])]
    # Each of the six computed its 16 positions and wrote its 4 blocks through under its own key; the 8-block pool
    # kept only the last two.
    assert harness.tier is not None and harness.tier.num_cached_blocks == 24
    assert harness.device_blocks(prompt, CACHE_KEY.with_tenant(NAMESPACES[0])) == 0
    again = harness.run(make_request("a2", prompt, tenant=NAMESPACES[0]))
    assert first.num_cached_tokens == 0 and [r.num_cached_tokens for r in others] == [0] * len(others)
    # Its own 3 full prompt blocks, back from the store; it is the only request that loaded any.
    assert again.num_cached_tokens == 12 and harness.tier.num_loaded_blocks == 3
    harness.check_released()


def test_a_store_block_of_another_namespace_never_loads_even_under_an_equal_hash() -> None:
    harness = tenant_harness(8, 32)
    prompt = PROMPTS[0]
    owner, caller = (CACHE_KEY.with_tenant(ns) for ns in NAMESPACES[:2])
    # As if the caller's block hashes collided with the owner's: the store holds the owner's KV under the caller's
    # hashes, kept under the owner's key.
    hashes = hash_block_tokens(caller, prompt, BLOCK_SIZE)
    store, io = harness.store, harness.io
    assert store is not None and io is not None
    assert store.put("n0", hashes, caller.root_hash, owner, 0, lambda depth: 1.0) == [0, 1, 2]
    io.store_kv.update((block_hash, harness.kv.block_contents(owner, prompt, index))
                       for index, block_hash in enumerate(hashes))
    waiting = harness.add(make_request("c", prompt, tenant=NAMESPACES[1]))
    assert harness.sched.blocks.peek_cached_tokens(waiting) == 0
    harness.drain()
    assert waiting.num_cached_tokens == 0 and harness.tier is not None and harness.tier.num_loaded_blocks == 0
    harness.check_released()
