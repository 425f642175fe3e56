"""`kvbaton serve --prefill N --decode M --prefill-tp A --decode-tp B`: each pool's workers get their own degree,
threads are shared among all rank processes, and a degree the model cannot be split by is refused up front."""

from __future__ import annotations

import os

import httpx
import pytest

from kvbaton import LLM, SamplingParams
from kvbaton.cli import main
from kvbaton.server.launcher import ServeConfig, worker_args
from tests.server.serve_helpers import child_pids, serve_process, wait_pd_idle


def _flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_each_pool_gets_its_own_degree() -> None:
    config = ServeConfig(model="tiny-random", num_workers=0, num_prefill=1, num_decode=2,
                         prefill_tensor_parallel_size=2, decode_pipeline_parallel_size=2)
    prefill = worker_args(config, "tcp://127.0.0.1:1", "p0", "prefill")
    decode = worker_args(config, "tcp://127.0.0.1:1", "d0", "decode")
    assert (_flag(prefill, "--tensor-parallel-size"), _flag(prefill, "--pipeline-parallel-size")) == ("2", None)
    assert (_flag(decode, "--tensor-parallel-size"), _flag(decode, "--pipeline-parallel-size")) == (None, "2")
    assert config.parallelism("mixed") == (1, 1)
    assert ServeConfig(num_workers=1, tensor_parallel_size=2).parallelism("mixed") == (2, 1)


def test_threads_are_shared_among_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 12)
    config = ServeConfig(num_workers=0, num_prefill=1, num_decode=1, prefill_tensor_parallel_size=2,
                         decode_tensor_parallel_size=1)
    assert config.num_threads_per_worker == 4  # 3 ranks in all


@pytest.mark.parametrize("argv", [
    ["serve", "--model", "tiny-random", "--prefill", "1", "--decode", "1", "--prefill-tp", "4"],
    ["worker", "--model", "tiny-random", "--router", "tcp://127.0.0.1:1", "-tp", "3"],
    ["generate", "--model", "tiny-random", "--prompt", "hi", "--tensor-parallel-size", "8"],
])
def test_a_degree_that_does_not_divide_the_kv_heads_is_refused_before_anything_starts(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert "does not divide the model's 2 KV heads" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_serve_with_a_tp2_prefill_pool_hands_off_to_a_tp1_decode_worker() -> None:
    prompt = "A prompt long enough to leave the prefill worker for the decode worker, " * 2
    with LLM("tiny-random", dtype="float32", num_blocks=64) as llm:
        want = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0))[0].outputs[0].text
    args = ["--model", "tiny-random", "--dtype", "float32", "--prefill", "1", "--decode", "1", "--prefill-tp", "2",
            "--local-prefill-threshold", "0", "--threads-per-worker", "1", "--num-blocks", "128"]
    with serve_process(args) as served, httpx.Client(timeout=120) as http:
        answer = http.post(f"{served.url}/v1/completions",
                           json={"model": "tiny-random", "prompt": prompt, "max_tokens": 8, "temperature": 0}).json()
        assert answer["choices"][0]["text"] == want
        _, workers = wait_pd_idle(http, served.url, handoffs={"p0": 1})
        assert workers["p0"]["transfers"]["num_completed"] == 1
        parallelism = {w: (workers[w]["tensor_parallel_size"], workers[w]["pipeline_parallel_size"]) for w in workers}
        assert parallelism == {"p0": (2, 1), "d0": (1, 1)}  # as each registered: /cluster shows it
        ranks = {pid: child_pids(pid) for pid in served.worker_pids}
        assert sorted(len(children) for children in ranks.values()) == [0, 2]  # the prefill worker's two ranks
    for pid in (child for children in ranks.values() for child in children):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
