"""Regressions found by bug hunting: prefill/decode handoffs between two tiny-random engines under tight pools.

Each test failed on the code it was written against; the fixes it guards are named in its comment.
"""

from __future__ import annotations

import pytest

from kvbaton.core.config import CacheConfig, EngineConfig, SchedulerConfig
from kvbaton.core.request import FinishReason
from kvbaton.core.sampling import SamplingParams
from kvbaton.core.step import TokenDelta
from kvbaton.engine.engine import Engine
from kvbaton.engine.handoff import kv_layout_for, numpy_kv
from kvbaton.engine.handoff_decode import DecodeHandoffs
from kvbaton.engine.handoff_prefill import PrefillHandoffs
from kvbaton.model.registry import LoadedModel, load_model
from kvbaton.transfer.transport_inproc import create_inproc_pair
from tests.engine.test_handoff import PROMPTS, Clock, Pair, colocated_tokens, greedy

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random")


def test_decode_worker_prefix_cache_does_not_refuse_reservations(tiny: LoadedModel) -> None:
    # Was a bug (transfer/destination.py `HandoffDestination._on_reserve`, with server/worker.py building decode
    # workers with the prefix cache on, the default): a reservation only takes free blocks and never evicts the decode
    # worker's prefix cache. Every adopted request leaves its blocks cached there, so once the cache fills the
    # pool (15 of 16 blocks here, all evictable) every later handoff is refused, forever: disaggregation silently
    # turns into recomputing every prompt on the decode worker (after a whole lease when no router relays the
    # refusal). The router's pair choice (router/pairs.py) even counts cached blocks as room. The simulator
    # avoids it by turning the decode workers' prefix cache off (sim/cluster.py); the live worker does not.
    # Fixed: a reservation evicts what the decode worker's cache holds unused (HandoffDestination.make_room).
    pair = Pair(tiny, decode_blocks=16, lease_s=1.0)
    for i in range(6):
        request_id = f"r{i}"
        pair.submit(request_id, [10 + 20 * i + k for k in range(16)], greedy(4))  # distinct 4-block prompts
        pair.run(max_rounds=1000)
        assert not pair.p.take_reports(), (request_id, pair.decode.pool.num_free_blocks,
                                           pair.decode.prefix_cache.num_cached_blocks)
    assert pair.d.counters.num_completed == 6 and pair.d.counters.num_recomputed == 0
    pair.assert_nothing_held()


def _run_prefill_pressure(loaded: LoadedModel, prefix_cache: bool) -> tuple[dict[str, TokenDelta], float, int]:
    """Two handoffs through a 4-block prefill pool (budget 5 tokens a step): `a` has 5 prompt tokens, `c` 15 (the
    whole pool). The decode worker polls every third round, so `a`'s leg keeps its blocks a little while after its
    prefill, and `c` (admitted behind it) is preempted once. Returns the final outputs, the time they ended at and
    the prefill engine's preemptions."""
    clock = Clock()
    lease_s = 1.0
    prefill = Engine(EngineConfig(model="tiny-random", cache=CacheConfig(BLOCK_SIZE, 4, prefix_cache),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=5)), loaded=loaded, clock=clock)
    decode = Engine(EngineConfig(model="tiny-random", cache=CacheConfig(BLOCK_SIZE, 64, False),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=64)), loaded=loaded, clock=clock)
    layout = kv_layout_for(loaded, BLOCK_SIZE)
    src_end, dst_end = create_inproc_pair("p0", "d0", numpy_kv(decode.storage.kv_cache))
    p = PrefillHandoffs(prefill, layout, src_end, lambda peer, address: None, lease_s, clock)
    d = DecodeHandoffs(decode, layout, dst_end, lease_s, clock)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for request_id, prompt in (("a", list(range(100, 105))), ("c", list(range(200, 215)))):
        d.expect(request_id, prompt, params, "p0", "fail")
        p.submit(request_id, prompt, params, "d0", "inproc")
    finals: dict[str, TokenDelta] = {}
    for round_index in range(1000):
        p.poll()
        assert not p.on_outputs(prefill.step() if prefill.has_unfinished_requests() else [])
        p.poll()
        outputs: list[TokenDelta] = []
        for report in p.take_reports():  # the router relays a failed prefill leg to the decode worker
            outputs += d.on_prefill_failed(report.request_id, report.reason, report.outcome == "refused")
        if round_index % 3 == 0:  # a decode worker busy with its own steps answers a little later
            outputs += d.poll()
            if decode.has_unfinished_requests():
                outputs += decode.step()
        finals.update((out.request_id, out) for out in outputs if out.finished)
        clock.now_s += 0.01
        if not (p.num_live or d.num_live or prefill.has_unfinished_requests() or decode.has_unfinished_requests()):
            break
    prefill.check_invariants()
    return finals, clock.now_s, prefill.stats().num_preemptions


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_a_preempted_handoff_prefill_is_not_starved_by_its_own_leg(tiny: LoadedModel, prefix_cache: bool) -> None:
    # Was a bug (engine/handoff_prefill.py + transfer/source.py `HandoffSource.stream`, scheduler/step_planning.py
    # `_schedule_running`): the source leg keeps a reference on every block it streamed. When the request is
    # preempted those blocks are not freed (without a prefix cache none are reused; with one, its partial last
    # block is not), and its recompute allocates new ones, so it needs its positions twice. Alone in a pool that
    # fits it once, it preempts itself every step ("blocks are held outside the scheduler: wait for them"), but
    # the blocks it waits for are held by its own leg, which only ends when it does: nothing moves until the
    # leg's lease expires, and then the handoff fails (ERROR under the "fail" policy; a recompute on the decode
    # worker under "recompute"). The same kind as the fixed prompt-logprobs self-preemption.
    # Fixed: a preempted request's leg lets go of the blocks it streamed from (LocalScheduler.on_preempted ->
    # HandoffSource.release_held); their KV left when they were sent, and the recompute streams only what is new.
    finals, ended_at, num_preemptions = _run_prefill_pressure(tiny, prefix_cache)
    assert num_preemptions >= 1  # the scenario preempts `c` once
    assert {rid: out.finish_reason for rid, out in finals.items()} == {"a": FinishReason.LENGTH,
                                                                       "c": FinishReason.LENGTH}, finals
    assert ended_at < 0.5  # well within the 1 s lease


def test_a_handoff_with_min_tokens_runs_and_keeps_the_first_tokens_bans(tiny: LoadedModel) -> None:
    # Was a bug (engine/handoff_prefill.py `PrefillHandoffs.submit`): the prefill leg's one-token params were
    # `replace(params, max_tokens=1, ...)`, which SamplingParams refuses when min_tokens > 1, and the error escaped
    # the worker's message loop: one request with min_tokens >= 2 (every `kvbaton bench` request sends min_tokens =
    # max_tokens) killed the prefill worker, and the router sent everything after to the decode worker alone.
    # With min_tokens 1 the leg cleared the stop tokens, so its first token could be one that min_tokens bans.
    # Fixed: `prefill_leg_params` keeps min_tokens (capped at 1) and, with it, the stop tokens.
    prompt = PROMPTS[0]
    first = colocated_tokens(tiny, prompt, greedy(1))[0]
    long_params = SamplingParams(max_tokens=10, min_tokens=10, temperature=0.0)
    banned_params = SamplingParams(max_tokens=6, min_tokens=1, temperature=0.0, stop_token_ids=(first,))
    pair = Pair(tiny)
    pair.submit("long", prompt, long_params)
    pair.submit("banned", prompt, banned_params)
    pair.run()
    assert not pair.p.take_reports()
    assert pair.tokens("long") == colocated_tokens(tiny, prompt, long_params) and len(pair.tokens("long")) == 10
    expected = colocated_tokens(tiny, prompt, banned_params)
    assert expected[0] != first and pair.tokens("banned") == expected
    assert pair.p.counters.num_completed == 2 and pair.d.counters.num_recomputed == 0
    pair.assert_nothing_held()


def test_a_request_id_handed_off_again_is_refused_not_raised(tiny: LoadedModel) -> None:
    # Was a bug (engine/handoff_prefill.py `PrefillHandoffs.submit`): `HandoffSource.start` raises ProtocolError for
    # a transfer id it still keeps (an ended leg stays a tombstone for 10 minutes), and it escaped `submit` and the
    # worker's loop: a request id used again (the router refuses one only while it is in flight) killed the prefill
    # worker. Fixed: such a handoff is refused, and the decode worker, told by the router, runs it itself.
    pair = Pair(tiny)
    pair.submit("r", PROMPTS[0], greedy(4))
    pair.run()
    pair.outputs.clear()
    pair.submit("r", PROMPTS[1], greedy(4))
    [report] = pair.p.take_reports()
    assert report.outcome == "refused" and "'r'" in report.reason
    assert pair.d.on_prefill_failed("r", report.reason, refused=True) == []  # the router relays the refusal
    pair.run()
    assert pair.tokens("r") == colocated_tokens(tiny, PROMPTS[1], greedy(4))
    assert pair.d.counters.num_recomputed == 1 and pair.p.counters.num_completed == 1
    pair.assert_nothing_held()
