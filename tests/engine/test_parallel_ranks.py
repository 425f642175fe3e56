"""Tensor and pipeline parallel workers (rank processes behind one engine): greedy output equal to one process in
float32 token for token; degrees that do not divide the KV heads refused; a rank killed by pid ends every request
with an error in bounded time, leaks no block and leaves no process behind."""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvbaton import LLM, SamplingParams
from kvbaton.core.errors import InvalidRequestError, KvbatonError
from kvbaton.core.request import FinishReason
from kvbaton.core.step import ScheduledChunk, StepPlan
from kvbaton.engine.rank_process import micro_batches
from tests.engine.test_smollm2_parity import PARIS

PROMPTS = [list(range(5, 40)), list(range(100, 160)), [7, 8, 9], list(range(200, 290))]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _greedy(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def one_process() -> list[list[int]]:
    with LLM("tiny-random", dtype="float32", num_blocks=96, max_num_batched_tokens=64) as llm:
        return _greedy(llm)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_parallel_greedy_equals_one_process(one_process: list[list[int]], tp: int, pp: int) -> None:
    # A 64-token budget chunks the 90-token prompt and mixes decodes with prefill chunks in one step.
    with LLM("tiny-random", dtype="float32", num_blocks=96, max_num_batched_tokens=64, tensor_parallel_size=tp,
             pipeline_parallel_size=pp, rank_num_threads=1) as llm:
        assert len(llm.engine.ranks.pids) == tp * pp
        assert _greedy(llm) == one_process
        llm.engine.check_invariants()
        pids = llm.engine.ranks.pids
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_degree_that_does_not_divide_the_kv_heads_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size=3 does not divide the model's 2 KV heads"):
        LLM("tiny-random", dtype="float32", num_blocks=32, tensor_parallel_size=3)
    with pytest.raises(InvalidRequestError, match="pipeline_parallel_size=3 exceeds the model's 2 layers"):
        LLM("tiny-random", dtype="float32", num_blocks=32, pipeline_parallel_size=3)


def test_micro_batches_cut_at_chunk_boundaries_in_order() -> None:
    chunks = tuple(ScheduledChunk(f"r{i}", 0, (1,) * n, (0,) * 8, True) for i, n in enumerate((1, 1, 30, 10, 20)))
    plan = StepPlan(3, chunks, 62)
    batches = micro_batches(plan, 2)
    assert [[c.request_id for c in b.chunks] for b in batches] == [["r0", "r1", "r2"], ["r3", "r4"]]
    assert [b.num_batched_tokens for b in batches] == [32, 30]
    assert micro_batches(plan, 1) == [plan]


@pytest.mark.timeout(240)
def test_killed_rank_ends_every_request_with_an_error() -> None:
    llm = LLM("tiny-random", dtype="float32", num_blocks=96, tensor_parallel_size=2, rank_num_threads=1)
    try:
        engine = llm.engine
        ids = [engine.add_request(p, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
               for p in PROMPTS]
        engine.step()
        engine.step()
        victim = engine.ranks.pids[1]
        os.kill(victim, signal.SIGKILL)
        started = time.monotonic()
        finals = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
            assert time.monotonic() - started < 30
        assert sorted(finals) == sorted(ids)
        assert {o.finish_reason for o in finals.values()} == {FinishReason.ERROR}
        assert all(f"pid {victim}" in o.error for o in finals.values())
        engine.check_invariants()  # only prefix-cache blocks remain
        with pytest.raises(KvbatonError, match="can run no more steps"):
            engine.add_request([1, 2, 3], GREEDY)
    finally:
        llm.close()


@pytest.mark.smollm2
@pytest.mark.timeout(600)
def test_smollm2_tp3_equals_tp1() -> None:
    # PARIS is one process's fp32 greedy output, checked against transformers by test_smollm2_parity.
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(dtype="float32", num_blocks=32, tensor_parallel_size=3, rank_num_threads=1) as llm:
        assert llm.generate("The capital of France is", params)[0].outputs[0].token_ids == PARIS[:12]
