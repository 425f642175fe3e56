"""`add_request(request, prompt_blocks)`: a prompt hashed once by the caller (the simulator's router
step) changes nothing the scheduler plans or its prefix cache stores and emits.

Two schedulers with prefix caches run the same random additions (prompts sharing prefixes, two
tenants), steps and aborts; one is handed `hash_prompt` of every prompt (sometimes under a wrong
key, which it must ignore), the other hashes itself. Plans, outputs, request states, cache
events and snapshots must be identical.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvbaton.cache.hashing import CacheKey, hash_prompt
from kvbaton.core.step import SampledToken, StepResult
from kvbaton.scheduler.local_scheduler import LocalScheduler
from tests.scheduler.helpers import BLOCK_SIZE, CACHE_KEY, make_request, make_scheduler, scheduler_state

EOS = 2
add_op = st.tuples(st.just("add"), st.integers(1, 14), st.integers(1, 9), st.sampled_from(["", "t"]),
                   st.sampled_from(["right", "right", "wrong-key", "wrong-size"]))
step_op = st.tuples(st.just("step"), st.integers(0, 9))
abort_op = st.tuples(st.just("abort"), st.integers(0, 20))


def _state(sched: LocalScheduler, request_ids: list[str]) -> list[tuple]:
    cache = sched.blocks.cache
    assert cache is not None
    events = [(e.seq, e.kind, e.block_hashes, e.parent_hash) for e in cache.take_events()]
    return scheduler_state(sched, request_ids) + [("events", tuple(events)), ("snapshot", tuple(cache.snapshot()))]


@settings(max_examples=100, deadline=None, derandomize=True)
@given(ops=st.lists(st.one_of(add_op, step_op, step_op, step_op, abort_op), min_size=10, max_size=60),
       num_blocks=st.integers(6, 24), budget=st.sampled_from([4, 16, 64]))
def test_seeded_prompt_blocks_change_nothing(ops: list[tuple], num_blocks: int, budget: int) -> None:
    seeded, plain = (make_scheduler(num_blocks, prefix_cache=True, max_num_batched_tokens=budget, max_num_seqs=3)
                     for _ in range(2))
    ids: list[str] = []
    now = 0.0
    for op in ops:
        results = []
        for sched in (seeded, plain):
            if op[0] == "add":
                _, length, max_tokens, tenant, variant = op
                prompt = [10 + (i % 4) for i in range(length)]  # shared prefixes: cache hits and splits
                request = make_request(f"r{len(ids)}", prompt, max_tokens=max_tokens, eos_token_id=EOS, tenant=tenant)
                key = CACHE_KEY.with_tenant(tenant)
                if variant == "wrong-key":
                    key = CacheKey("other-model", "other-layout", tenant)
                blocks = hash_prompt(key, prompt, 2 if variant == "wrong-size" else BLOCK_SIZE)
                sched.add_request(request, blocks if sched is seeded else None)
            elif op[0] == "abort" and ids:
                sched.abort_request(ids[op[1] % len(ids)], now)
            elif op[0] == "step":
                plan = sched.schedule(now)
                sampled = {c.request_id: SampledToken(EOS if (op[1] + c.end_pos) % 7 == 0 else 5)
                           for c in plan.chunks if c.samples}
                results.append((plan, sched.update(plan, StepResult(plan.step_id, sampled), now)))
            results.append([r.request_id for r in sched.take_finished()])
            sched.check_invariants()
            sched.blocks.cache.check_invariants()  # type: ignore[union-attr]
        if op[0] == "add":
            ids.append(f"r{len(ids)}")
        now += 1.0
        half = len(results) // 2
        assert results[:half] == results[half:]
        assert _state(seeded, ids) == _state(plain, ids)


def test_seed_is_used_and_dropped_with_the_request() -> None:
    sched = make_scheduler(32, prefix_cache=True, max_num_batched_tokens=64)
    prompt = list(range(100, 111))  # 2 full blocks of 4 and a partial one
    sched.add_request(make_request("a", prompt, max_tokens=2), hash_prompt(CACHE_KEY, prompt, BLOCK_SIZE))
    assert sched.blocks._prompt_hashes["a"] == hash_prompt(CACHE_KEY, prompt, BLOCK_SIZE).block_hashes
    sched.add_request(make_request("b", prompt, max_tokens=2, tenant="x"), hash_prompt(CACHE_KEY, prompt, BLOCK_SIZE))
    assert "b" not in sched.blocks._prompt_hashes  # hashed under the wrong tenant: ignored
    for n in range(4):
        plan = sched.schedule(float(n))
        sched.update(plan, StepResult(plan.step_id, {c.request_id: SampledToken(5) for c in plan.chunks
                                                     if c.samples}), float(n))
    assert not sched.has_unfinished_requests() and not sched.blocks._prompt_hashes
    sched.check_invariants()
