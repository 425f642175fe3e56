"""Conversation affinity without a pin: a turn continuing a stored response has a prompt that extends the previous
turn's ids (`responses_store.continued_prompt_ids`), so the router's placement (`ClusterPlacement`, Preble) finds
the previous turn's blocks on the worker that ran it and sends the turn there, until that worker's load makes
its own cost terms move the conversation elsewhere."""

from __future__ import annotations

from kvbaton.cache.hashing import CacheKey
from kvbaton.model.tokenizer import Tokenizer
from kvbaton.router.base import RouteRequest
from kvbaton.router.placement import ClusterPlacement, Placement, PlacementConfig
from kvbaton.server.responses_store import StoredResponse, continued_prompt_ids

BLOCK = 16
KEY = CacheKey("tiny-random", "test")


def _turns(tokenizer: Tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    messages = [{"role": "system", "content": "You answer about animals, briefly and kindly. " * 3},
                {"role": "user", "content": "What does the quick brown fox do all day long?"}]
    first_text = tokenizer.apply_chat_template(messages, True)
    first_ids = tuple(tokenizer.encode(first_text, add_bos=False))
    output_ids = (*tokenizer.encode("It jumps over the lazy dog.", add_bos=False), tokenizer.eos_token_id)
    previous = StoredResponse({}, "", (), first_text, first_ids, tuple(output_ids), 0.0)
    history = messages + [{"role": "assistant", "content": "It jumps over the lazy dog."},
                          {"role": "user", "content": "And the dog?"}]
    second_ids = continued_prompt_ids(tokenizer, tokenizer.apply_chat_template(history, True), previous)
    assert second_ids[:len(first_ids) + len(output_ids)] == first_ids + output_ids  # the same token prefix
    return first_ids, second_ids


def _place(placement: ClusterPlacement, request_id: str, ids: tuple[int, ...], now: float) -> Placement:
    decision = placement.place(RouteRequest.from_tokens(request_id, ids, KEY, BLOCK), now)
    assert isinstance(decision, Placement), decision
    return decision


def test_the_next_turn_goes_where_the_last_ones_kv_is_until_that_worker_is_too_busy(tokenizer: Tokenizer) -> None:
    first_ids, second_ids = _turns(tokenizer)
    placement = ClusterPlacement(PlacementConfig(policy="preble", block_size=BLOCK))
    for worker in ("w0", "w1"):
        placement.add_worker(worker, "mixed")
    first = _place(placement, "turn-1", first_ids, 0.0)
    second = _place(placement, "turn-2", second_ids, 1.0)
    assert second.worker_id == first.worker_id and second.reason == "exploit"
    assert second.num_matched_tokens == len(first_ids) // BLOCK * BLOCK
    # The conversation goes on while its worker is swamped by other work: Preble's periodic rebalancing (after
    # its warm-up decisions) moves the conversation's prefix group to the idle worker. Nothing pins it.
    placement.state.load.on_assigned(first.worker_id, "backlog", now=1.0, num_prefill_tokens=0, num_blocks=0,
                                     work_s=600.0)
    workers = [_place(placement, f"turn-2-retry-{i}", second_ids, 2.0 + i / 1000).worker_id for i in range(80)]
    moved_at = next(i for i, worker in enumerate(workers) if worker != first.worker_id)
    assert moved_at > 0 and set(workers[moved_at:]) == {"w0", "w1"} - {first.worker_id}
