"""Handoff parity over the wire: through the router, a prefill worker and a decode worker (real zmq and shared-memory
KV, in-process threads), every sampling option gives exactly a colocated engine's answer.

The engine-level cases are in tests/engine/test_handoff_parity.py; these add what only the cluster does: the
sampling params crossing msgpack twice (router -> each leg), the first token's logprobs crossing the KV link, the
deltas and usage the decode worker sends, prompt_logprobs sent whole to one worker, and `n` expanded by the router
into one call per sample. Calls run one after another against one colocated engine that runs the same requests in
the same order, so prefix-cache hits (usage.cached_tokens) must agree too.
"""

from __future__ import annotations


import pytest

from kvbaton.core.config import CacheConfig, EngineConfig, SchedulerConfig
from kvbaton.core.sampling import SamplingParams
from kvbaton.core.step import SampledToken
from kvbaton.engine.engine import Engine
from kvbaton.engine.structured import grammar_for
from kvbaton.model.registry import LoadedModel, load_model
from kvbaton.server.base import GenerateCall, TokenDelta
from kvbaton.server.cluster import ClusterManager
from tests.engine.test_handoff_parity import EOS, Answer, answer_of, assert_same
from tests.server.pd_helpers import BLOCK_SIZE, NUM_BLOCKS, collect, run_pd, wait_clean
from tests.server.test_worker_cluster import WorkerThread

PD = {"p0": "prefill", "d0": "decode"}


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random", "float32")  # logprobs to 1e-4 (tests/engine/test_handoff_parity.py)


def greedy(**kwargs: object) -> SamplingParams:
    fields: dict[str, object] = {"max_tokens": 8, "temperature": 0.0}
    fields.update(kwargs)
    return SamplingParams(**fields)  # type: ignore[arg-type]


# (name, prompt index, params); prompt_logprobs calls last: they run whole on the decode worker, whose cache the
# prefill worker does not share. A call of one token runs whole on the prefill worker (no decode is left to hand
# off), so it answers as one engine there.
CASES: list[tuple[str, int, SamplingParams]] = [
    ("plain", 0, greedy()),
    ("max_tokens_1", 1, greedy(max_tokens=1)),
    ("bench", 0, greedy(max_tokens=10, min_tokens=10, logprobs=1)),
    ("min_tokens_2_eos_first", 1, greedy(min_tokens=2, logit_bias=((EOS, 100.0),))),
    ("eos_first", 0, greedy(logit_bias=((EOS, 100.0),), logprobs=3)),
    ("eos_ignored_specials_shown", 1, greedy(logit_bias=((EOS, 100.0),), ignore_eos=True, max_tokens=3,
                                             skip_special_tokens=False)),
    ("stop_strings", 0, greedy(stop=("e", "a"), include_stop_str_in_output=True, max_tokens=16)),
    ("stop_strings_min_tokens", 1, greedy(stop=("e", "a"), min_tokens=3, max_tokens=16)),
    ("logprobs_20", 0, greedy(logprobs=20, max_tokens=3)),
    ("penalties", 1, greedy(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.5,
                            logit_bias=((70, 3.0), (71, -3.0)), max_tokens=12)),
    ("truncation_greedy", 0, greedy(min_p=0.3, top_k=2, top_p=0.4)),
    ("grammar_json", 1, greedy(grammar=grammar_for("json_object", None), max_tokens=20)),
    ("priority_seed", 0, greedy(priority=3, seed=99)),
    ("seeded_sample", 1, SamplingParams(max_tokens=10, temperature=2.0, top_p=0.95, seed=7)),
    # the router's expansion of n = 2: sample 1 carries seed + 1
    ("n_sample_1", 0, SamplingParams(max_tokens=10, temperature=2.0, seed=7, n=2).for_sample(1)),
    ("prompt_logprobs", 0, greedy(prompt_logprobs=2, logprobs=1)),
    ("prompt_logprobs_max_tokens_1", 1, greedy(prompt_logprobs=0, max_tokens=1)),
]


def cluster_answer(deltas: list[TokenDelta]) -> tuple[Answer, tuple[SampledToken, ...]]:
    """The deltas read as the engine's outputs, and the prompt logprobs (on the first delta that has any)."""
    return answer_of(deltas), next((d.prompt_logprobs for d in deltas if d.prompt_logprobs), ())


def colocated_answers(loaded: LoadedModel, prompts: list[list[int]]) -> list[tuple[Answer, tuple[SampledToken, ...]]]:
    """Every case's answer from one engine configured as the workers are, running them in the same order."""
    engine = Engine(EngineConfig(model="tiny-random", cache=CacheConfig(BLOCK_SIZE, NUM_BLOCKS),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=64)), loaded=loaded)
    answers = []
    for name, prompt_index, params in CASES:
        engine.add_request(prompts[prompt_index], params, request_id=name)
        outputs: list[TokenDelta] = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        prompt_logprobs = next((o.prompt_logprobs for o in outputs if o.prompt_logprobs), ())
        answers.append((answer_of(outputs), prompt_logprobs))
    engine.check_invariants()
    return answers


def test_every_option_through_1p1d_answers_as_one_engine(tiny: LoadedModel) -> None:
    prompts = [tiny.tokenizer.encode("A shared opening that is long enough to fill a block or two. Then a question?"),
               tiny.tokenizer.encode("Another prompt, about something else entirely, of a few blocks: go on")]
    expected = colocated_answers(tiny, prompts)

    async def body(cluster: ClusterManager, workers: dict[str, WorkerThread]) -> None:
        for (name, prompt_index, params), (answer, prompt_logprobs) in zip(CASES, expected, strict=True):
            deltas = await collect(cluster, GenerateCall(name, tuple(prompts[prompt_index]), params, arrival_at=0.0))
            got, got_prompt_logprobs = cluster_answer(deltas)
            assert_same(got, answer, name)
            one_token = params.max_tokens == 1 and params.prompt_logprobs is None
            assert deltas[-1].worker_id == ("p0" if one_token else "d0"), name
            assert [t.token_id for t in got_prompt_logprobs] == [t.token_id for t in prompt_logprobs], name
            assert [[i for i, _ in t.top_logprobs] for t in got_prompt_logprobs] == [
                [i for i, _ in t.top_logprobs] for t in prompt_logprobs], name
            assert [t.logprob for t in got_prompt_logprobs] == pytest.approx(
                [t.logprob for t in prompt_logprobs], abs=1e-4), name
        await wait_clean(cluster, ["p0", "d0"])
        num_whole = sum(params.prompt_logprobs is not None for _, _, params in CASES)
        num_one_token = sum(params.max_tokens == 1 and params.prompt_logprobs is None for _, _, params in CASES)
        num_pairs = len(CASES) - num_whole - num_one_token
        assert cluster.router_decisions == {"pair": num_pairs, "local_prefill": num_whole,
                                            "prefill_only": num_one_token}
        for worker_id in ("p0", "d0"):
            stats = cluster.workers[worker_id].stats
            assert stats.num_transfers_completed == num_pairs, worker_id
            assert stats.num_transfers_failed == stats.num_transfer_recomputes == 0, worker_id
        assert all(w.thread.is_alive() for w in workers.values())

    run_pd(tiny, PD, body)
