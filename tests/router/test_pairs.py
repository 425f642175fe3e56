"""The pair choice, through the placement (pure): prefix- and queue-aware prefill worker, admission- and
transfer-aware decode worker, conditional disaggregation by uncached tokens, and what each decision commits."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvbaton.cache.hashing import CacheKey
from kvbaton.router.base import RouteRequest
from kvbaton.router.load import WorkerStats
from kvbaton.router.placement import ClusterPlacement, Placement, PlacementConfig

KEY = CacheKey("rev", "layout")
BLOCK = 16


def request(request_id: str, tokens: list[int], max_tokens: int = 8) -> RouteRequest:
    return RouteRequest.from_tokens(request_id, tokens, KEY, BLOCK, max_tokens)


def heartbeat(placement: ClusterPlacement, worker: str, queued_tokens: int = 0, free_blocks: int = 1000,
              running: int = 0) -> None:
    placement.on_stats(WorkerStats(worker, queued_tokens, 0, free_blocks, running, 0, 0, BLOCK), 0.0)


def cluster(threshold: int = 0, kv_bytes_per_token: int = 1000, prefill: tuple[str, ...] = ("p0", "p1"),
            decode: dict[str, str] | None = None, mixed: tuple[str, ...] = ()) -> ClusterPlacement:
    placement = ClusterPlacement(PlacementConfig(policy="least_load", block_size=BLOCK,
                                                 local_prefill_threshold_tokens=threshold,
                                                 kv_bytes_per_token=kv_bytes_per_token))
    roles = {p: "prefill" for p in prefill} | {m: "mixed" for m in mixed}
    for worker, role in roles.items():
        placement.add_worker(worker, role)
        heartbeat(placement, worker)
    for worker, link in (decode if decode is not None else {"d0": "shm"}).items():
        placement.add_worker(worker, "decode", link)
        heartbeat(placement, worker)
    return placement


def place(placement: ClusterPlacement, r: RouteRequest, whole: bool = False) -> Placement:
    decision = placement.place(r, 0.0, whole)
    assert isinstance(decision, Placement), decision
    return decision


def test_prefill_worker_follows_the_cached_prefix_until_its_queue_outweighs_it() -> None:
    placement = cluster()
    prompt = list(range(200))
    placement.state.index.on_routed("p1", request("warm", prompt).block_hashes)
    assert place(placement, request("a", prompt + [1, 2])) == Placement("d0", "pair", 192, prefill_worker="p1")
    heartbeat(placement, "p1", queued_tokens=50_000)  # a long queue costs more than the 192 saved tokens
    assert place(placement, request("b", prompt + [3])).prefill_worker == "p0"


def test_decode_worker_prefers_room_then_a_smaller_batch_then_the_faster_link() -> None:
    placement = cluster(prefill=("p0",), decode={"d0": "shm", "d1": "shm"})
    heartbeat(placement, "d0", free_blocks=2)  # would refuse a 13-block reservation
    assert place(placement, request("a", list(range(200)))).worker_id == "d1"
    heartbeat(placement, "d0", running=1)
    heartbeat(placement, "d1", running=5)
    assert place(placement, request("b", list(range(200)))).worker_id == "d0"
    placement = cluster(prefill=("p0",), decode={"d0": "tcp", "d1": "shm"})
    assert place(placement, request("c", list(range(200)))).worker_id == "d1"


def test_short_uncached_prompts_prefill_on_their_decode_worker() -> None:
    placement = cluster(threshold=64, prefill=("p0",))
    assert place(placement, request("short", list(range(40)))) == Placement("d0", "local_prefill", 0)
    assert placement.state.load.assignment("short") == ("d0", None)  # committed where it runs
    long = list(range(300))
    placement.state.index.on_routed("d0", request("warm", long).block_hashes)  # d0 holds all but the tail
    assert place(placement, request("hit", long + [5])).reason == "local_prefill"
    decision = place(placement, request("miss", list(range(500, 700))))
    assert decision.reason == "pair" and placement.state.load.assignment("miss") == ("p0", None)


def test_short_prompts_go_to_the_mixed_pool_when_there_is_one() -> None:
    placement = cluster(threshold=64, prefill=("p0",), mixed=("m0",))
    decision = place(placement, request("short", list(range(40))))
    assert (decision.worker_id, decision.reason, decision.prefill_worker) == ("m0", "least_load", "")


def test_a_call_wanting_its_prompt_logprobs_or_one_token_stays_on_one_worker() -> None:
    placement = cluster()
    assert place(placement, request("logprobs", list(range(200))), whole=True).reason == "local_prefill"
    one = place(placement, request("one", list(range(300, 500)), max_tokens=1))
    assert (one.reason, one.prefill_worker, one.worker_id in ("p0", "p1")) == ("prefill_only", "", True)


def test_without_decode_workers_the_prefill_workers_serve_calls_whole_by_the_policy() -> None:
    placement = cluster(decode={})
    decision = place(placement, request("a", [1, 2, 3]))
    assert (decision.reason, decision.prefill_worker) == ("least_load", "") and decision.worker_id in ("p0", "p1")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 500), min_size=1, max_size=300), st.integers(0, 400),
       st.lists(st.integers(0, 3000), min_size=2, max_size=2))
def test_choice_is_a_live_worker_and_deterministic(tokens: list[int], threshold: int, queues: list[int]) -> None:
    decisions = []
    for _ in range(2):
        placement = cluster(threshold, decode={"d0": "shm", "d1": "tcp"})
        heartbeat(placement, "p0", queued_tokens=queues[0])
        heartbeat(placement, "p1", queued_tokens=queues[1])
        decisions.append(place(placement, request("r", tokens)))
        placement.on_finished("r", 1.0)
        placement.check_invariants()
    assert decisions[0] == decisions[1]
    decision = decisions[0]
    assert decision.worker_id in ("d0", "d1")
    assert (decision.prefill_worker in ("p0", "p1")) == (decision.reason == "pair")
    assert (decision.reason == "local_prefill") == (len(tokens) < threshold)
