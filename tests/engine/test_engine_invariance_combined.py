"""Outputs of the whole engine do not depend on what runs with them, under every feature at once.

Random timelines of arrivals and aborts drive one tiny-random float32 engine configured with a random mix of
chunked prefill (small token budgets, a long-prefill cap), the prefix cache (shared prefixes, repeated prompts:
full and partial hits; tenants), a tight KV pool (preemption and recompute), speculative decoding (prompts whose
continuations loop, so drafts are accepted), a KV store node past a small device pool (its loads asynchronous,
before admission; its DRAM small enough to evict), the priority and lpm queue
policies, `max_num_seqs` and a short context; the requests mix greedy and seeded sampling, structured-output
grammars, penalties and logit bias, logprobs and prompt logprobs, stop strings, stop token ids, min_tokens, EOS
and n > 1. After every step the engine's invariants hold; once all have ended every device block is free or
cached (no lock left) and the store node holds no lease and keeps its invariants; and each request that was not aborted
outputs exactly the tokens, text, finish reason and logprobs (to float32 tolerance) it outputs alone on an engine
of its own, while an aborted one outputs a prefix of those tokens. Float32 because bfloat16's rounding depends on
the batch shape, which legitimately flips near-tied greedy choices.
"""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvbaton.core.config import CacheConfig, EngineConfig, SchedulerConfig
from kvbaton.core.request import FinishReason
from kvbaton.core.sampling import SamplingParams
from kvbaton.core.step import SampledToken, TokenDelta
from kvbaton.engine.engine import Engine
from kvbaton.engine.structured import grammar_for
from kvbaton.model.registry import LoadedModel, load_model
from kvbaton.server.store_client import LocalStoreNode
from tests.store_nodes import wait_unpinned

LOGPROB_TOLERANCE = 1e-4
MAX_PROMPT_TOKENS = 40
MAX_OUTPUT_TOKENS = 20
MAX_DRAFT_TOKENS = 3
MAX_MODEL_LEN = 52  # some prompts reach it before max_tokens


def _family(seed: int, length: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(3, 259) for _ in range(length))  # byte tokens of the byte-level tokenizer


# Prompt families: two shared system-prompt-like prefixes (prefix hits, partial hits past a block boundary) and
# two repetitive ones, whose greedy tiny-random continuations fall into loops that prompt lookup drafts.
FAMILIES = (_family(1, 32), _family(2, 24), (5, 6, 7, 8) * 6, (9, 3) * 10 + (4,))
GRAMMARS = (("choice", ["yes", "no", "maybe so"]), ("regex", "[a-z]{2,6}"))
ADJUSTMENTS = ({"repetition_penalty": 1.3}, {"frequency_penalty": 0.5, "presence_penalty": 0.3},
               {"logit_bias": ((65, 5.0), (100, -3.0))})


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@functools.cache
def _loaded() -> LoadedModel:
    return load_model("tiny-random", "float32", "cpu")


@functools.cache
def _grammar(index: int) -> str:
    return grammar_for(*GRAMMARS[index])


def _engine(block_size: int, num_blocks: int, *, prefix_cache: bool = True, store: LocalStoreNode | None = None,
            max_num_batched_tokens: int = 512, max_num_seqs: int = 128, queue_policy: str = "fcfs",
            num_speculative_tokens: int = 0, long_prefill_token_threshold: int = 0) -> Engine:
    clock = itertools.count()
    config = EngineConfig(
        model="tiny-random", dtype="float32", max_model_len=MAX_MODEL_LEN,
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_cache=prefix_cache),
        scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                  queue_policy=queue_policy, num_speculative_tokens=num_speculative_tokens,
                                  long_prefill_token_threshold=long_prefill_token_threshold),
    )
    return Engine(config, _loaded(), clock=lambda: float(next(clock)),
                  create_store_link=store.link if store is not None else None)


@dataclass(slots=True)
class Outcome:
    """Everything one request streamed, joined."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[SampledToken] = field(default_factory=list)
    prompt_logprobs: tuple[SampledToken, ...] = ()
    finish_reason: FinishReason | None = None
    error: str = ""
    num_cached_tokens: int = 0
    num_finals: int = 0

    def take(self, out: TokenDelta) -> None:
        assert self.num_finals == 0, f"{out.request_id}: output after its final one"
        self.token_ids.extend(out.new_token_ids)
        self.text += out.new_text
        self.logprobs.extend(out.logprobs)
        if out.prompt_logprobs:
            assert not self.prompt_logprobs, f"{out.request_id}: prompt logprobs twice"
            self.prompt_logprobs = out.prompt_logprobs
        if out.new_token_ids and len(self.token_ids) == len(out.new_token_ids):
            self.num_cached_tokens = out.num_cached_tokens
        if out.finished:
            self.num_finals += 1
            self.finish_reason, self.error = out.finish_reason, out.error


@functools.cache
def _reference_engine() -> Engine:
    return _engine(16, 512, prefix_cache=False)


@functools.lru_cache(maxsize=None)
def _alone(prompt: tuple[int, ...], params: SamplingParams) -> Outcome:
    """The request run by itself (nothing cached, nothing else running, one chunk, no drafts)."""
    engine = _reference_engine()
    request_id = engine.add_request(list(prompt), params)
    outcome = Outcome()
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == request_id
            outcome.take(out)
    assert outcome.num_finals == 1
    # It may fail, but only for a reason of its own: a grammar that forces the stop token min_tokens bans.
    failed = outcome.finish_reason == FinishReason.ERROR
    assert not failed or outcome.error.startswith("structured output"), outcome.error
    return outcome


# ---- what hypothesis draws ----------------------------------------------------------------------------------------

request_specs = st.fixed_dictionaries({
    "family": st.sampled_from([-1, 0, 0, 1, 1, 2, 3]),  # -1: no shared prefix
    "prefix_tokens": st.integers(0, 32),
    "suffix": st.lists(st.integers(3, 258), max_size=6),
    "repeat": st.none() | st.integers(0, 5),  # the prompt of an earlier request again (a full hit)
    "max_tokens": st.integers(1, MAX_OUTPUT_TOKENS),
    "min_tokens": st.sampled_from([0, 0, 0, 1, 3]),  # > 0 turns drafts off
    "ignore_eos": st.booleans(),
    "logprobs": st.sampled_from([None, None, 0, 2]),
    "prompt_logprobs": st.sampled_from([None, None, None, None, 0, 2]),
    "grammar": st.sampled_from([None, None, None, None, None, 0, 1]),
    "seed": st.sampled_from([None, None, None, 0, 1]),
    "adjustment": st.sampled_from([None, None, None, None, 0, 1, 2]),  # penalties or a logit bias (no drafts)
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.sampled_from([True, True, False]),
    "tenant": st.sampled_from(["", "", "b"]),  # tenants share no cached KV
    "stop_at": st.none() | st.integers(0, MAX_OUTPUT_TOKENS),  # a stop string from the output alone, at this char
    "stop_token_at": st.none() | st.integers(0, MAX_OUTPUT_TOKENS),  # a stop token id from the output alone
    "n": st.sampled_from([1, 1, 1, 2, 3]),
    "priority": st.integers(-1, 1),
    "arrive_after_steps": st.sampled_from([0, 0, 1, 3, 10, 25]),  # steps run before it is added (its turn)
    "abort_after_steps": st.none() | st.none() | st.integers(0, 12),  # steps after its arrival, if aborted
})
engine_specs = st.fixed_dictionaries({
    "block_size": st.sampled_from([4, 8, 16]),
    "pool_slack_blocks": st.sampled_from([0, 0, 1, 3, 200]),  # 0: one request at its longest fills the pool
    "prefix_cache": st.sampled_from([False, True, True]),
    "kv_store": st.sampled_from([False, True]),
    "max_num_batched_tokens": st.sampled_from([5, 8, 16, 64, 512]),
    "max_num_seqs": st.sampled_from([2, 128]),
    "queue_policy": st.sampled_from(["fcfs", "priority", "lpm"]),
    "num_speculative_tokens": st.sampled_from([0, MAX_DRAFT_TOKENS]),
    "long_prefill_token_threshold": st.sampled_from([0, 0, 3]),
})


def _request(spec: dict, earlier: list[tuple[int, ...]], speculating: bool) -> tuple[tuple[int, ...], SamplingParams]:
    """The prompt and params a drawn spec stands for (`earlier`: the prompts drawn before it); stop strings and stop
    token ids are taken from what the request outputs alone, so that they hit.

    A seeded request samples, unless the engine speculates: verifying drafts draws from its generator in another
    pattern than plain decodes (the distribution is the same, not the draws), so it would differ from alone."""
    prefix = FAMILIES[spec["family"]][: spec["prefix_tokens"]] if spec["family"] >= 0 else ()
    prompt = (prefix + tuple(spec["suffix"]))[:MAX_PROMPT_TOKENS] or (5,)
    if spec["repeat"] is not None and earlier:
        prompt = earlier[spec["repeat"] % len(earlier)]
    params = SamplingParams(
        max_tokens=spec["max_tokens"], ignore_eos=spec["ignore_eos"],
        temperature=0.8 if spec["seed"] is not None and not speculating else 0.0, seed=spec["seed"],
        min_tokens=min(spec["min_tokens"], spec["max_tokens"]), logprobs=spec["logprobs"],
        prompt_logprobs=spec["prompt_logprobs"], priority=spec["priority"],
        grammar=_grammar(spec["grammar"]) if spec["grammar"] is not None else "",
        include_stop_str_in_output=spec["include_stop_str_in_output"],
        skip_special_tokens=spec["skip_special_tokens"],
        **(ADJUSTMENTS[spec["adjustment"]] if spec["adjustment"] is not None else {}),
    )
    if spec["stop_at"] is not None or spec["stop_token_at"] is not None:
        plain = _alone(prompt, params)
        if spec["stop_at"] is not None and len(plain.text) > spec["stop_at"] + 1:
            params = replace(params, stop=(plain.text[spec["stop_at"] : spec["stop_at"] + 2],))
        if spec["stop_token_at"] is not None and len(plain.token_ids) > spec["stop_token_at"]:
            params = replace(params, stop_token_ids=(plain.token_ids[spec["stop_token_at"]],))
    return prompt, replace(params, n=spec["n"])


def _assert_same_logprobs(got: list[SampledToken] | tuple[SampledToken, ...],
                          want: list[SampledToken] | tuple[SampledToken, ...], what: str) -> None:
    assert len(got) == len(want), what
    for a, b in zip(got, want):
        assert a.token_id == b.token_id, what
        assert a.logprob == pytest.approx(b.logprob, abs=LOGPROB_TOLERANCE), what
        assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs], what
        assert [v for _, v in a.top_logprobs] == pytest.approx([v for _, v in b.top_logprobs],
                                                               abs=LOGPROB_TOLERANCE), what


def _check_at_rest(engine: Engine, store: LocalStoreNode | None) -> None:
    """Every request has ended: the device pool is held by the cache alone, with no lock left on it, and the store
    node (when there is one) holds no lease and keeps its invariants."""
    engine.check_invariants()
    cache = engine.prefix_cache
    num_cached = cache.num_cached_blocks if cache is not None else 0
    assert engine.pool.num_used_blocks == num_cached
    assert engine.pool.num_free_blocks == engine.pool.num_blocks - num_cached
    if cache is not None:
        assert cache.num_evictable_blocks == num_cached, "a lock outlived its request"
    if store is not None:
        wait_unpinned(store.server)


@pytest.fixture(scope="module")
def store_nodes() -> Iterator[dict[int, LocalStoreNode]]:
    """A store node per block size, shared by the examples (blocks one example stored may serve the next: the same
    model's KV of the same tokens); 24 blocks of DRAM each, so they evict too."""
    kv = _loaded().config
    nodes = {size: LocalStoreNode(kv.kv_bytes_per_token(4) * size, size, kv.num_layers * 2,
                                  24 * kv.kv_bytes_per_token(4) * size / 1e9) for size in (4, 8, 16)}
    yield nodes
    for node in nodes.values():
        node.stop()


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(engine_spec=engine_specs, specs=st.lists(request_specs, min_size=2, max_size=6))
def test_every_request_outputs_what_it_outputs_alone(engine_spec: dict, specs: list[dict],
                                                    store_nodes: dict[int, LocalStoreNode]) -> None:
    requests: list[tuple[tuple[int, ...], SamplingParams]] = []
    for spec in specs:
        requests.append(_request(spec, [prompt for prompt, _ in requests],
                                 speculating=engine_spec["num_speculative_tokens"] > 0))
    # Any one request at its longest fits the pool (the engine fails only what can never fit; alone, no request
    # fails here), with `pool_slack_blocks` to spare: 0 makes two requests together preempt one another.
    block_size = engine_spec["block_size"]
    longest = max(len(prompt) + params.max_tokens + MAX_DRAFT_TOKENS for prompt, params in requests)
    num_blocks = -(-longest // block_size) + 1 + engine_spec["pool_slack_blocks"]
    store = store_nodes[block_size] if engine_spec["kv_store"] and engine_spec["prefix_cache"] else None
    engine = _engine(block_size, num_blocks, prefix_cache=engine_spec["prefix_cache"], store=store,
                     max_num_batched_tokens=engine_spec["max_num_batched_tokens"],
                     max_num_seqs=engine_spec["max_num_seqs"], queue_policy=engine_spec["queue_policy"],
                     num_speculative_tokens=engine_spec["num_speculative_tokens"],
                     long_prefill_token_threshold=engine_spec["long_prefill_token_threshold"])
    # The timeline: request i arrives after `arrive_after_steps` more steps than request i - 1, and is aborted
    # `abort_after_steps` steps after its arrival (an abort after it ended changes nothing).
    arrivals: dict[int, list[int]] = {}
    aborts: dict[int, list[int]] = {}
    at = 0
    for i, spec in enumerate(specs):
        at += spec["arrive_after_steps"]
        arrivals.setdefault(at, []).append(i)
        if spec["abort_after_steps"] is not None:
            aborts.setdefault(at + spec["abort_after_steps"], []).append(i)
    added: list[tuple[str, tuple[int, ...], SamplingParams]] = []  # (request id, prompt, one sample's params)
    ids_of: dict[int, list[str]] = {}
    outcomes: dict[str, Outcome] = {}
    aborted: set[str] = set()
    last_event_at = max([*arrivals, *aborts])
    try:
        for step in range(10_000):
            for i in arrivals.get(step, ()):
                prompt, params = requests[i]
                for index in range(params.n):
                    request_id = engine.add_request(list(prompt), params.for_sample(index), tenant=specs[i]["tenant"])
                    added.append((request_id, prompt, params.for_sample(index)))
                    ids_of.setdefault(i, []).append(request_id)
                    outcomes[request_id] = Outcome()
            for i in aborts.get(step, ()):
                for request_id in ids_of[i]:
                    if outcomes[request_id].num_finals == 0:
                        aborted.add(request_id)
                    engine.abort_request(request_id)
            if step >= last_event_at and not engine.has_unfinished_requests():
                break
            for out in engine.step():
                outcomes[out.request_id].take(out)
            engine.check_invariants()
        assert not engine.has_unfinished_requests(), "the engine never drained"
        _check_at_rest(engine, store)
    finally:
        engine.close()  # its store IO thread
    stats = engine.stats()
    for name, happened in (("preempted", stats.num_preemptions), ("prefix hit", stats.prefix_cache_hits_tokens),
                           ("loaded from the store", engine.store_io.num_loaded_blocks if store else 0),
                           ("drafts accepted", engine.scheduler.num_accepted_tokens), ("aborted", aborted)):
        if happened:
            event(name)

    for request_id, prompt, params in added:
        got = outcomes[request_id]
        want = _alone(prompt, params)
        assert got.num_finals == 1, f"{request_id}: {got.num_finals} final outputs"
        assert got.finish_reason != FinishReason.ERROR or want.finish_reason == FinishReason.ERROR, (
            f"{request_id}: {got.error}")
        assert got.num_cached_tokens % block_size == 0 and got.num_cached_tokens < len(prompt)
        if request_id in aborted:
            assert got.finish_reason == FinishReason.ABORT, f"{request_id}: aborted but ended {got.finish_reason}"
            assert got.token_ids == want.token_ids[: len(got.token_ids)], f"{request_id}: aborted off course"
            continue
        what = f"{request_id} ({len(prompt)} prompt tokens, {params})"
        # (An error's first line: llguidance appends its parser's state, timings included.)
        assert ((got.token_ids, got.text, got.finish_reason, got.error.split("\n")[0])
                == (want.token_ids, want.text, want.finish_reason, want.error.split("\n")[0])), (
            f"{what}: {got.token_ids, got.text, got.finish_reason}, alone "
            f"{want.token_ids, want.text, want.finish_reason}")
        _assert_same_logprobs(got.logprobs, want.logprobs, what)
        _assert_same_logprobs(got.prompt_logprobs, want.prompt_logprobs, what)
