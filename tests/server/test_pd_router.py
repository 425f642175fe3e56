"""The pair choice (pure): prefix- and queue-aware prefill worker, admission- and transfer-aware decode worker,
conditional disaggregation by uncached tokens, and what it commits to the router state."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbaton.cache.hashing import CacheKey
from kvbaton.core.errors import CapacityError
from kvbaton.router.base import RouteRequest
from kvbaton.router.load import WorkerStats
from kvbaton.router.state import RouterState
from kvbaton.server.pd_router import PairChoiceConfig, PairChooser

KEY = CacheKey("rev", "layout")
BLOCK = 16


def request(request_id: str, tokens: list[int]) -> RouteRequest:
    return RouteRequest.from_tokens(request_id, tokens, KEY, BLOCK, 8)


def heartbeat(state: RouterState, worker: str, queued_tokens: int = 0, free_blocks: int = 1000,
              running: int = 0) -> None:
    state.load.on_stats(WorkerStats(worker, queued_tokens, 0, free_blocks, running, 0, 0, BLOCK), 0.0)


def chooser(threshold: int = 0, kv_bytes_per_token: int = 1000) -> PairChooser:
    state = RouterState(block_size=BLOCK)
    for worker in ("p0", "p1", "d0", "d1"):
        heartbeat(state, worker)
    return PairChooser(state, PairChoiceConfig(threshold, kv_bytes_per_token))


def test_prefill_worker_follows_the_cached_prefix_until_its_queue_outweighs_it() -> None:
    pairs = chooser()
    prompt = list(range(200))
    pairs.state.index.on_routed("p1", request("warm", prompt).block_hashes)
    decision = pairs.choose(request("a", prompt + [1, 2]), ["p0", "p1"], {"d0": "shm"}, 0.0)
    assert (decision.prefill_worker, decision.reason, decision.num_matched_tokens) == ("p1", "pair", 192)
    heartbeat(pairs.state, "p1", queued_tokens=50_000)  # a long queue costs more than the 192 saved tokens
    assert pairs.choose(request("b", prompt + [3]), ["p0", "p1"], {"d0": "shm"}, 0.0).prefill_worker == "p0"


def test_decode_worker_prefers_room_then_a_smaller_batch_then_the_faster_link() -> None:
    pairs = chooser()
    heartbeat(pairs.state, "d0", free_blocks=2)  # would refuse a 13-block reservation
    assert pairs.choose(request("a", list(range(200))), ["p0"], {"d0": "shm", "d1": "shm"}, 0.0).decode_worker == "d1"
    heartbeat(pairs.state, "d0", running=1)
    heartbeat(pairs.state, "d1", running=5)
    assert pairs.choose(request("b", list(range(200))), ["p0"], {"d0": "shm", "d1": "shm"}, 0.0).decode_worker == "d0"
    heartbeat(pairs.state, "d1", running=1)
    assert pairs.choose(request("c", list(range(200))), ["p0"], {"d0": "tcp", "d1": "shm"}, 0.0).decode_worker == "d1"


def test_short_uncached_prompts_skip_the_handoff_and_commit_nothing() -> None:
    pairs = chooser(threshold=64)
    decision = pairs.choose(request("short", list(range(40))), ["p0"], {"d0": "shm"}, 0.0)
    assert (decision.reason, decision.prefill_worker, decision.decode_worker) == ("local_prefill", "", "d0")
    assert pairs.state.load.assignment("short") is None  # the caller places (and commits) it
    long = list(range(300))
    pairs.state.index.on_routed("d0", request("warm", long).block_hashes)  # d0 holds all but the tail
    assert pairs.choose(request("hit", long + [5]), ["p0"], {"d0": "shm"}, 0.0).reason == "local_prefill"
    decision = pairs.choose(request("miss", list(range(500, 700))), ["p0"], {"d0": "shm"}, 0.0)
    assert decision.reason == "pair" and pairs.state.load.assignment("miss") == ("p0", None)


def test_no_decode_worker_is_a_capacity_error() -> None:
    with pytest.raises(CapacityError):
        chooser().choose(request("a", [1, 2, 3]), ["p0"], {}, 0.0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 500), min_size=1, max_size=300), st.integers(0, 400),
       st.lists(st.integers(0, 3000), min_size=2, max_size=2))
def test_choice_is_a_live_worker_and_deterministic(tokens: list[int], threshold: int, queues: list[int]) -> None:
    decisions = []
    for _ in range(2):
        pairs = chooser(threshold)
        heartbeat(pairs.state, "p0", queued_tokens=queues[0])
        heartbeat(pairs.state, "p1", queued_tokens=queues[1])
        decisions.append(pairs.choose(request("r", tokens), ["p0", "p1"], {"d0": "shm", "d1": "tcp"}, 0.0))
    assert decisions[0] == decisions[1]
    decision = decisions[0]
    assert decision.decode_worker in ("d0", "d1")
    assert (decision.prefill_worker in ("p0", "p1")) == (decision.reason == "pair")
    assert (decision.reason == "local_prefill") == (len(tokens) < threshold)
