"""Tensor and pipeline parallel workers (rank processes behind one engine): greedy output equal to one process in
float32 token for token; degrees that do not divide the KV heads refused; a rank killed by pid ends every request
with an error in bounded time, leaks no block and leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from kvbaton import LLM, SamplingParams
from kvbaton.core.errors import InvalidRequestError, KvbatonError
from kvbaton.core.request import FinishReason
from kvbaton.core.step import ScheduledChunk, StepPlan
from kvbaton.engine.rank_process import micro_batches
from kvbaton.transfer.transport_shm import remove_stale_regions
from tests.engine.test_smollm2_parity import PARIS

PROMPTS = [list(range(5, 40)), list(range(100, 160)), [7, 8, 9], list(range(200, 290))]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _greedy(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY)]


LOGPROBS = SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, prompt_logprobs=2)


def _logprobs(llm: LLM) -> list[tuple[list[int], list[float], list[float]]]:
    """Per prompt: output ids, their logprobs, and the prompt tokens' logprobs (all rows the ranks returned)."""
    out = []
    for result in llm.generate(PROMPTS[:2], LOGPROBS):
        sample = result.outputs[0]
        prompt = [entry.logprob for entry in result.prompt_logprobs[1:]]
        out.append((sample.token_ids, [t.logprob for t in sample.logprobs], prompt))
    return out


@pytest.fixture(scope="module")
def one_process() -> tuple[list[list[int]], list]:
    with LLM("tiny-random", dtype="float32", num_blocks=96, max_num_batched_tokens=64) as llm:
        return _greedy(llm), _logprobs(llm)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_parallel_greedy_equals_one_process(one_process: tuple[list[list[int]], list], tp: int, pp: int) -> None:
    # A 64-token budget chunks the 90-token prompt and mixes decodes with prefill chunks in one step.
    want_ids, want_logprobs = one_process
    with LLM("tiny-random", dtype="float32", num_blocks=96, max_num_batched_tokens=64, tensor_parallel_size=tp,
             pipeline_parallel_size=pp, rank_num_threads=1) as llm:
        assert len(llm.engine.ranks.pids) == tp * pp
        assert _greedy(llm) == want_ids
        for (ids, logprobs, prompt), (want, want_lp, want_prompt) in zip(_logprobs(llm), want_logprobs):
            assert ids == want
            assert logprobs == pytest.approx(want_lp, abs=1e-4)
            assert prompt == pytest.approx(want_prompt, abs=1e-4)
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


def test_micro_batches_split_the_step_evenly_and_cut_only_prefill_chunks() -> None:
    def chunk(rid: str, start: int, num: int, samples: bool = True) -> ScheduledChunk:
        return ScheduledChunk(rid, start, tuple(range(start, start + num)), (0,) * 16, samples)

    plan = StepPlan(3, (chunk("d0", 40, 1), chunk("d1", 40, 1), chunk("p", 0, 200), chunk("q", 10, 54)), 256)
    batches = micro_batches(plan, 2)
    assert [b.num_batched_tokens for b in batches] == [64, 64, 64, 64]
    pieces = [(c.request_id, c.start_pos, c.num_tokens, c.samples) for b in batches for c in b.chunks]
    assert pieces == [("d0", 40, 1, True), ("d1", 40, 1, True), ("p", 0, 62, False), ("p", 62, 64, False),
                      ("p", 126, 64, False), ("p", 190, 10, True), ("q", 10, 54, True)]
    assert sum((c.token_ids for b in batches for c in b.chunks if c.request_id == "p"), ()) == tuple(range(200))
    assert micro_batches(plan, 1) == [plan]
    assert micro_batches(StepPlan(4, (chunk("d0", 40, 1), chunk("d1", 9, 1)), 2), 2) == [
        StepPlan(4, (chunk("d0", 40, 1), chunk("d1", 9, 1)), 2)]  # too small to be worth cutting
    speculative = StepPlan(5, (chunk("s", 0, 70),), 70)
    assert [b.num_batched_tokens for b in micro_batches(speculative, 2, {"s"})] == [70]


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


@pytest.mark.timeout(240)
def test_ranks_exit_when_their_front_process_is_killed() -> None:
    script = ("from kvbaton import LLM\n"
              "llm = LLM('tiny-random', dtype='float32', num_blocks=32, tensor_parallel_size=2, rank_num_threads=1)\n"
              "print(*llm.engine.ranks.pids, flush=True)\n"
              "import time; time.sleep(300)\n")
    front = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in front.stdout.readline().split()]
        assert len(pids) == 2
        front.kill()
        front.wait(10)
        deadline = time.monotonic() + 20
        alive = set(pids)
        while alive and time.monotonic() < deadline:
            for pid in list(alive):
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    alive.discard(pid)
            time.sleep(0.1)
        assert not alive, f"ranks {alive} outlived their front process"
        # Its KV region is left behind, as a killed decode worker's is, for the next start's sweep.
        assert any(f"-{front.pid}-" in name for name in remove_stale_regions())
    finally:
        if front.poll() is None:
            front.kill()
            front.wait(10)
