"""Prefill engine -> decode engine through the real handoff drivers over the inproc transport (tiny-random).

Two engines in one thread: greedy outputs after a handoff equal a colocated engine's, the decode
engine adopts the reserved blocks (no second allocation), the prefill engine keeps the prompt in
its prefix cache after the ack, and failures end by the kv_load_failure_policy with no block held.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvbaton.core.config import CacheConfig, EngineConfig, SchedulerConfig
from kvbaton.core.sampling import SamplingParams
from kvbaton.engine.engine import Engine, RequestOutput
from kvbaton.engine.handoff import kv_layout_for, numpy_kv
from kvbaton.engine.handoff_decode import DecodeHandoffs
from kvbaton.engine.handoff_prefill import PrefillHandoffs
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
                 decode_blocks: int = NUM_BLOCKS) -> None:
        self.clock = Clock()
        self.prefill = make_engine(loaded, self.clock)
        config = EngineConfig(model="tiny-random", cache=CacheConfig(BLOCK_SIZE, decode_blocks, True),
                              scheduler=SchedulerConfig(max_num_batched_tokens=8))
        self.decode = Engine(config, loaded=loaded, clock=self.clock)
        layout = kv_layout_for(loaded, BLOCK_SIZE)
        src_end, dst_end = create_inproc_pair("p0", "d0", numpy_kv(self.decode.storage.kv_cache))
        transport = FaultyTransport(src_end, rules or [], self.clock)
        self.p = PrefillHandoffs(self.prefill, layout, transport, lambda peer, address: None, lease_s, self.clock)
        self.d = DecodeHandoffs(self.decode, layout, dst_end, lease_s, self.clock)
        self.outputs: dict[str, list[RequestOutput]] = {}

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

    def final(self, request_id: str) -> RequestOutput:
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
        assert pair.final(f"r{i}").finish_reason.value == "length"
    assert pair.p.counters.num_completed == 3 and pair.d.counters.num_completed == 3
    assert pair.d.counters.num_recomputed == 0 and pair.p.counters.num_bytes > 0
    # The decode worker never prefilled: its scheduler saw no admissions, only adoptions.
    assert pair.decode.stats().prefix_cache_queries_tokens == 0
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
        assert pair.final("r").finish_reason.value == "error" and "KV transfer failed" in pair.final("r").error
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
    assert final.finish_reason.value == "error" and "10 KV blocks" in final.error
    pair.run()
    pair.assert_nothing_held()


def test_cancel_while_waiting_for_the_grant(tiny: LoadedModel) -> None:
    pair = Pair(tiny, [FaultRule(FaultAction.DELAY, ReserveRequest, delay_s=100.0)])
    pair.submit("r", PROMPTS[0], greedy())
    pair.round()
    pair.p.abort("r")
    assert pair.d.abort("r").finish_reason.value == "abort"
    pair.clock.now_s = 200.0  # the delayed reservation arrives after the cancel: it is cancelled at once
    pair.run()
    pair.assert_nothing_held()
