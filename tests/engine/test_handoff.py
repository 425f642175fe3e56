"""Prefill engine -> decode engine through the real handoff drivers over the inproc transport (tiny-random).

Two engines in one thread: greedy outputs after a handoff equal a colocated engine's, the decode
engine adopts the reserved blocks (no second allocation), the prefill engine keeps the prompt in
its prefix cache after the ack, and failures end by the kv_load_failure_policy with no block held.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from kvbaton.core.config import CacheConfig, EngineConfig, SchedulerConfig
from kvbaton.core.errors import KvbatonError
from kvbaton.core.sampling import SamplingParams
from kvbaton.core.step import TokenDelta
from kvbaton.engine.engine import Engine
from kvbaton.engine.handoff import kv_layout_for, numpy_kv
from kvbaton.engine.handoff_decode import DecodeHandoffs
from kvbaton.engine.handoff_prefill import PrefillHandoffs
from kvbaton.engine.structured import grammar_for
from kvbaton.model.registry import LoadedModel, load_model
from kvbaton.transfer.faults import FaultAction, FaultRule, FaultyTransport
from kvbaton.transfer.messages import LayerChunk, ReserveRequest
from kvbaton.transfer.transport_inproc import create_inproc_pair

BLOCK_SIZE = 4
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random")


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def make_engine(loaded: LoadedModel, clock: Callable[[], float], budget_tokens: int = 8) -> Engine:
    config = EngineConfig(model="tiny-random", cache=CacheConfig(BLOCK_SIZE, NUM_BLOCKS, True),
                          scheduler=SchedulerConfig(max_num_batched_tokens=budget_tokens))
    return Engine(config, loaded=loaded, clock=clock)


class Pair:
    """A prefill engine and a decode engine linked by inproc transports (with optional faults on the prefill end)."""

    def __init__(self, loaded: LoadedModel, rules: list[FaultRule] | None = None, lease_s: float = 5.0,
                 decode_blocks: int = NUM_BLOCKS, reserve_ahead_tokens: int | None = None) -> None:
        self.clock = Clock()
        self.prefill = make_engine(loaded, self.clock)
        config = EngineConfig(model="tiny-random", cache=CacheConfig(BLOCK_SIZE, decode_blocks, True),
                              scheduler=SchedulerConfig(max_num_batched_tokens=8))
        self.decode = Engine(config, loaded=loaded, clock=self.clock)
        layout = kv_layout_for(loaded, BLOCK_SIZE)
        src_end, dst_end = create_inproc_pair("p0", "d0", numpy_kv(self.decode.storage.kv_cache))
        transport = FaultyTransport(src_end, rules or [], self.clock)
        self.p = PrefillHandoffs(self.prefill, layout, transport, lambda peer, address: None, lease_s, self.clock,
                                 reserve_ahead_tokens)
        self.d = DecodeHandoffs(self.decode, layout, dst_end, lease_s, self.clock)
        self.outputs: dict[str, list[TokenDelta]] = {}

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams, policy: str = "recompute") -> None:
        self.d.expect(request_id, prompt, params, "p0", policy)
        self.p.submit(request_id, prompt, params, "d0", "inproc")

    def round(self) -> None:
        self.p.poll()
        for out in self.p.on_outputs(self.prefill.step() if self.prefill.has_unfinished_requests() else []):
            raise AssertionError(f"prefill engine leaked an output: {out}")
        self.p.poll()
        got = self.d.poll()
        if self.decode.has_unfinished_requests():
            got += self.decode.step()
        for out in got:
            self.outputs.setdefault(out.request_id, []).append(out)

    def run(self, max_rounds: int = 400, advance_s: float = 0.01) -> None:
        for _ in range(max_rounds):
            self.round()
            self.clock.now_s += advance_s
            if not (self.p.num_live or self.d.num_live or self.prefill.has_unfinished_requests()
                    or self.decode.has_unfinished_requests()):
                return
        raise AssertionError("the pair did not finish")

    def tokens(self, request_id: str) -> list[int]:
        return [t for out in self.outputs[request_id] for t in out.new_token_ids]

    def final(self, request_id: str) -> TokenDelta:
        return self.outputs[request_id][-1]

    def assert_nothing_held(self) -> None:
        for engine in (self.prefill, self.decode):
            engine.check_invariants()
            cached = engine.prefix_cache.num_cached_blocks if engine.prefix_cache is not None else 0
            assert engine.pool.num_used_blocks == cached
        assert self.p.source.num_held_blocks == 0 and self.d.destination.num_reserved_blocks == 0


def colocated_tokens(loaded: LoadedModel, prompt: list[int], params: SamplingParams) -> list[int]:
    engine = make_engine(loaded, Clock())
    engine.add_request(prompt, params, request_id="ref")
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    return tokens


PROMPTS = [list(range(3, 40)), [5] * 9, list(range(100, 117))]


def greedy(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_handoff_outputs_equal_colocated_and_blocks_are_adopted(tiny: LoadedModel) -> None:
    pair = Pair(tiny)
    for i, prompt in enumerate(PROMPTS):
        pair.submit(f"r{i}", prompt, greedy())
    pair.run()
    for i, prompt in enumerate(PROMPTS):
        assert pair.tokens(f"r{i}") == colocated_tokens(tiny, prompt, greedy()), i
        assert pair.final(f"r{i}").finish_reason == "length"
    assert pair.p.counters.num_completed == 3 and pair.d.counters.num_completed == 3
    assert pair.d.counters.num_recomputed == 0 and pair.p.counters.num_bytes > 0
    # The decode worker never prefilled: its scheduler saw no admissions, only adoptions.
    assert pair.decode.stats().prefix_cache_queries_tokens == 0
    pair.assert_nothing_held()


def test_penalties_and_logit_bias_carry_across_the_handoff(tiny: LoadedModel) -> None:
    # The prefill engine samples the first token with the request's penalties; the decode engine goes on from
    # the prompt and that token with the same ones: the tokens equal a colocated engine's.
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=1.4,
                            frequency_penalty=0.5, presence_penalty=0.3, logit_bias=((7, 2.0),))
    pair = Pair(tiny)
    for i, prompt in enumerate(PROMPTS):
        pair.submit(f"r{i}", prompt, params)
    pair.run()
    for i, prompt in enumerate(PROMPTS):
        expected = colocated_tokens(tiny, prompt, params)
        assert pair.tokens(f"r{i}") == expected and expected != colocated_tokens(tiny, prompt, greedy()), i
    pair.assert_nothing_held()


def test_a_grammar_carries_across_the_handoff(tiny: LoadedModel) -> None:
    # The prefill engine's matcher takes the first token it samples; the decode engine builds its own and takes
    # that token again before masking its first decode: the output equals a colocated engine's and fits.
    params = SamplingParams(max_tokens=24, temperature=0.0, grammar=grammar_for("regex", "(ab|ba){2,}c"))
    pair = Pair(tiny)
    for i, prompt in enumerate(PROMPTS):
        pair.submit(f"r{i}", prompt, params)
    pair.run()
    for i, prompt in enumerate(PROMPTS):
        tokens = pair.tokens(f"r{i}")
        assert tokens == colocated_tokens(tiny, prompt, params), i
        text = tiny.tokenizer.decode(tokens)
        assert re.fullmatch("(ab|ba){2,}c", text) and pair.final(f"r{i}").finish_reason == "stop", text
    pair.assert_nothing_held()


def test_prefill_prefix_hit_still_hands_over_the_whole_prompt(tiny: LoadedModel) -> None:
    pair = Pair(tiny)
    shared = list(range(10, 30))
    pair.submit("a", shared + [1, 2, 3], greedy())
    pair.run()
    pair.submit("b", shared + [4, 5], greedy())
    pair.run()
    assert pair.prefill.stats().prefix_cache_hits_tokens >= 16  # the prefill worker kept "a" after the ack
    assert pair.tokens("b") == colocated_tokens(tiny, shared + [4, 5], greedy())
    pair.assert_nothing_held()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_dropped_layer_expires_and_follows_the_failure_policy(tiny: LoadedModel, policy: str) -> None:
    pair = Pair(tiny, [FaultRule(FaultAction.DROP, LayerChunk, layer_index=1)], lease_s=0.5)
    prompt = PROMPTS[0]
    pair.submit("r", prompt, greedy(), policy)
    pair.run()
    if policy == "recompute":
        assert pair.tokens("r") == colocated_tokens(tiny, prompt, greedy())
        assert pair.d.counters.num_recomputed == 1
    else:
        assert pair.final("r").finish_reason == "error" and "KV transfer failed" in pair.final("r").error
    assert pair.p.counters.num_failed == 1
    pair.assert_nothing_held()


def test_refused_reservation_is_reported_and_recomputed(tiny: LoadedModel) -> None:
    pair = Pair(tiny, decode_blocks=4)  # 37 prompt tokens need 10 blocks
    prompt = PROMPTS[0]
    pair.submit("r", prompt, greedy(4), "fail")
    for _ in range(3):
        pair.round()
    [report] = pair.p.take_reports()
    assert report.outcome == "refused" and "blocks" in report.reason
    # Refusal is backpressure, not a KV load failure: the decode worker tries to run it itself even under
    # "fail", and here the prompt can never fit its 4 blocks: a clean error naming why.
    [final] = pair.d.on_prefill_failed("r", report.reason, refused=True)
    assert final.finish_reason == "error" and "10 KV blocks" in final.error
    pair.run()
    pair.assert_nothing_held()


def test_cancel_while_waiting_for_the_grant(tiny: LoadedModel) -> None:
    pair = Pair(tiny, [FaultRule(FaultAction.DELAY, ReserveRequest, delay_s=100.0)])
    pair.submit("r", PROMPTS[0], greedy())
    pair.round()
    pair.p.abort("r")
    assert pair.d.abort("r").finish_reason == "abort"
    pair.clock.now_s = 200.0  # the delayed reservation arrives after the cancel: it is cancelled at once
    pair.run()
    pair.assert_nothing_held()


def test_late_reservation_reserves_in_turn_and_outputs_stay_equal(tiny: LoadedModel) -> None:
    # Reserve once at most 8 prompt tokens are left to compute ahead: the three prompts (37, 9, 17 tokens)
    # reserve one after another, each when the engine has (almost) drained the one before it.
    pair = Pair(tiny, reserve_ahead_tokens=8)
    params = greedy()
    for i, prompt in enumerate(PROMPTS):
        pair.submit(f"r{i}", prompt, params)
    reserved_blocks = [pair.d.destination.num_reserved_blocks]
    for _ in range(400):
        pair.round()
        pair.clock.now_s += 0.01
        reserved_blocks.append(pair.d.destination.num_reserved_blocks)
        pair.p.check_invariants()
        if not (pair.p.num_live or pair.d.num_live or pair.prefill.has_unfinished_requests()
                or pair.decode.has_unfinished_requests()):
            break
    for i, prompt in enumerate(PROMPTS):
        assert pair.tokens(f"r{i}") == colocated_tokens(tiny, prompt, params)
    # First only r0's 10 blocks (37 tokens); r1's 3 join once r0 has at most 8 tokens left to prefill, and the
    # three are never held at once. Reserving at submit holds all three (10 + 3 + 5) before any prefill runs.
    assert reserved_blocks[:2] == [0, 10] and 13 in reserved_blocks and max(reserved_blocks) < 18
    eager = Pair(tiny)
    for i, prompt in enumerate(PROMPTS):
        eager.submit(f"r{i}", prompt, params)
    eager.round()
    assert eager.d.destination.num_reserved_blocks == 18
    pair.assert_nothing_held()


def test_late_reservation_cancel_and_lease_while_waiting_for_a_turn(tiny: LoadedModel) -> None:
    # ahead 0: the second leg waits until the engine has nothing left to prefill.
    pair = Pair(tiny, lease_s=1.0, reserve_ahead_tokens=0)
    pair.submit("a", PROMPTS[0], greedy())
    pair.submit("b", PROMPTS[1], greedy())
    pair.submit("c", PROMPTS[2], greedy())
    pair.round()
    assert pair.p.num_live == 3 and pair.d.destination.num_reserved_blocks == 10  # only a reserved
    pair.p.abort("b")  # cancelled before it ever reserved: nothing to tell the decode worker's transport
    assert pair.d.abort("b").finish_reason == "abort"
    pair.p.check_invariants()
    pair.run()
    assert pair.p.counters.num_cancelled == 1 and not pair.p.take_reports()
    pair.assert_nothing_held()
    # A leg whose turn does not come within the lease fails and is reported.
    stuck = Pair(tiny, lease_s=0.05, reserve_ahead_tokens=0)
    stuck.submit("a", PROMPTS[0], greedy())
    stuck.submit("b", PROMPTS[1], greedy())
    stuck.p.poll()
    stuck.clock.now_s = 0.1
    stuck.p.poll()
    reports = stuck.p.take_reports()
    assert [r.request_id for r in reports if r.outcome == "expired" and "turn" in r.reason] == ["b"]


def test_negative_reserve_ahead_is_refused(tiny: LoadedModel) -> None:
    with pytest.raises(KvbatonError):
        Pair(tiny, reserve_ahead_tokens=-1)


def test_decode_worker_grants_between_the_layers_of_its_step(tiny: LoadedModel) -> None:
    """The decode worker pumps the transport between two layers (`DecodeHandoffs.pump` as the engine's hook): a
    reservation that arrives while a step runs is granted in that step; adoption still waits for `poll`."""
    pair = Pair(tiny)
    pair.decode.between_layers = pair.d.pump
    pair.submit("r0", PROMPTS[0], greedy(20))
    for _ in range(40):  # until r0 decodes on the decode engine
        pair.round()
        pair.clock.now_s += 0.01
        if pair.decode.has_unfinished_requests():
            break
    assert pair.decode.has_unfinished_requests()
    pair.submit("r1", PROMPTS[1], greedy())  # its ReserveRequest is on the way to the decode worker
    assert pair.d.destination.num_reserved_blocks == 0
    outputs = pair.decode.step()  # the reservation is granted between two layers of this step
    assert pair.d.destination.num_reserved_blocks == -(-len(PROMPTS[1]) // BLOCK_SIZE)
    assert [out.request_id for out in outputs] == ["r0"]  # r1 is not adopted mid-step
    for out in outputs:
        pair.outputs.setdefault(out.request_id, []).append(out)
    pair.run()
    assert pair.tokens("r0") == colocated_tokens(tiny, PROMPTS[0], greedy(20))
    assert pair.tokens("r1") == colocated_tokens(tiny, PROMPTS[1], greedy())
    pair.assert_nothing_held()
