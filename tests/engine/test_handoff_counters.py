"""Regressions found by bug hunting the handoff drivers: the transfer counters a worker reports in its heartbeat.

Each test failed on the code it was written against; the fix it guards is named in its comment.
"""

from __future__ import annotations

import pytest

from kvbaton.model.registry import LoadedModel, load_model
from tests.engine.test_handoff import PROMPTS, Pair, colocated_tokens, greedy

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random")


def test_a_cancelled_reserved_leg_is_counted_cancelled_on_the_prefill_worker(tiny: LoadedModel) -> None:
    # Was a bug (engine/handoff_prefill.py `PrefillHandoffs.abort`): only a leg still waiting for its turn to reserve
    # was counted in `num_cancelled`; a leg that had reserved (waiting for the grant, prefilling or awaiting the ack)
    # was forgotten by `_end` before any `_advance` could count its ending, so the heartbeat never showed it.
    # Fixed: every leg the router cancels is counted once.
    pair = Pair(tiny)
    pair.submit("r", PROMPTS[0], greedy())
    pair.round()  # granted: the prefill is running
    pair.p.abort("r")
    assert pair.d.abort("r").finish_reason == "abort"
    pair.run()
    assert pair.p.counters.num_cancelled == 1 and pair.p.counters.num_failed == 0
    assert pair.p.counters.num_started == 1 and pair.p.counters.num_completed == 0
    pair.assert_nothing_held()


def test_the_decode_worker_counts_the_legs_it_granted(tiny: LoadedModel) -> None:
    # Was a bug (engine/handoff_decode.py `DecodeHandoffs.pump`): `TransferCounters.num_started` is documented as
    # "decode: reservation granted", but the decode side never set it, so every decode worker reported 0 started
    # transfers next to its completed ones. Fixed: HandoffDestination counts its grants (as it counts refusals).
    pair = Pair(tiny)
    for i, prompt in enumerate(PROMPTS):
        pair.submit(f"r{i}", prompt, greedy(2))
    pair.run()
    counters = pair.d.counters
    assert (counters.num_started, counters.num_completed, counters.num_refused) == (3, 3, 0)
    pair.assert_nothing_held()


def test_a_reservation_that_cannot_fit_leaves_the_decode_workers_prefix_cache_alone(tiny: LoadedModel) -> None:
    # Was a bug (engine/handoff_decode.py, the destination's `make_room`): a reservation short of free blocks
    # evicted up to its shortfall from the decode worker's prefix cache before finding that even all of it could
    # not make room (here: more blocks than the whole pool), and then refused anyway, for nothing. Fixed: the
    # cache is evicted only when that makes room.
    pair = Pair(tiny, decode_blocks=8)  # 8 blocks of 4 tokens
    pair.decode.add_request(list(range(10, 22)), greedy(2), request_id="local")  # 3 prompt blocks, then cached
    while pair.decode.has_unfinished_requests():
        pair.decode.step()
    cache = pair.decode.prefix_cache
    assert cache is not None and cache.num_cached_blocks >= 2
    cached_before = cache.num_cached_blocks
    pair.submit("big", list(range(30, 70)), greedy())  # 40 tokens: 10 blocks, more than the pool holds
    for _ in range(5):
        pair.round()
    assert pair.d.counters.num_refused >= 1
    assert cache.num_cached_blocks == cached_before  # before the fix: 0
    pair.p.abort("big")
    pair.d.abort("big")
    pair.run()
    pair.assert_nothing_held()


def test_a_leg_the_prefill_worker_cancels_waits_for_the_routers_word_instead_of_recomputing(tiny: LoadedModel) -> None:
    # Was a bug (engine/handoff_decode.py `DecodeHandoffs._advance`): when a client left, the router aborted both legs,
    # and the prefill worker's cancel, arriving over the KV link before the router's abort, made the decode worker
    # count a failure and start recomputing the prompt for nobody (aborted a moment later). The prefill worker only
    # cancels when the router aborted the call (its abort is on the way) or when it stops (the router then relays
    # HandoffFailed): the decode worker now waits for either, up to a lease.
    pair = Pair(tiny)
    pair.submit("r", PROMPTS[0], greedy())
    pair.round()  # granted: the prefill is running
    pair.p.abort("r")  # the prefill leg's cancel, ahead of the router's abort to the decode worker
    for _ in range(5):
        pair.round()
    assert not pair.decode.has_unfinished_requests() and pair.d.counters.num_recomputed == 0
    assert pair.d.counters.num_failed == 0 and pair.d.owns("r")
    assert pair.d.abort("r").finish_reason == "abort"  # the router's abort
    pair.run()
    pair.assert_nothing_held()


def test_a_prefill_worker_stopping_still_ends_in_a_recompute(tiny: LoadedModel) -> None:
    pair = Pair(tiny)
    pair.submit("r", PROMPTS[0], greedy())
    pair.round()
    pair.p.abort("r", "prefill worker stopping")
    pair.round()
    assert pair.d.owns("r") and pair.d.counters.num_recomputed == 0
    assert pair.d.on_prefill_failed("r", "prefill worker lost", refused=False) == []  # relayed by the router
    pair.run()
    assert pair.tokens("r") == colocated_tokens(tiny, PROMPTS[0], greedy()) and pair.d.counters.num_recomputed == 1
    pair.assert_nothing_held()


def test_without_the_routers_word_a_cancelled_leg_recomputes_after_a_lease(tiny: LoadedModel) -> None:
    pair = Pair(tiny, lease_s=0.5)
    pair.submit("r", PROMPTS[0], greedy())
    pair.round()
    pair.p.abort("r")
    pair.run(advance_s=0.05)  # the router's word never comes
    assert pair.tokens("r") == colocated_tokens(tiny, PROMPTS[0], greedy()) and pair.d.counters.num_recomputed == 1
    pair.assert_nothing_held()
