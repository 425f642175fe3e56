"""Engine behaviour on tiny-random: sampling options, stop conditions, abort, bad input, block accounting."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from kvbaton import LLM, SamplingParams
from kvbaton.core.errors import InvalidRequestError, ModelNotFoundError
from kvbaton.core.request import FinishReason


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-random", dtype="float32", num_blocks=256)


def test_max_tokens_and_length_finish(llm: LLM) -> None:
    out = llm.generate("abc", SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 7
    assert out.finish_reason == FinishReason.LENGTH
    llm.engine.check_invariants()


def test_seeded_sampling_is_reproducible_and_differs_from_greedy(llm: LLM) -> None:
    sampled = SamplingParams(max_tokens=24, temperature=1.5, top_p=0.95, top_k=50, seed=7, ignore_eos=True)
    a = llm.generate("once upon a time", sampled)[0].outputs[0].token_ids
    b = llm.generate("once upon a time", sampled)[0].outputs[0].token_ids
    greedy = llm.generate("once upon a time", SamplingParams(max_tokens=24, temperature=0.0,
                                                              ignore_eos=True))[0].outputs[0].token_ids
    assert a == b
    assert a != greedy


def test_n_samples_are_independent(llm: LLM) -> None:
    result = llm.generate("xyz", SamplingParams(max_tokens=16, temperature=1.0, n=3, ignore_eos=True))[0]
    assert [o.index for o in result.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in result.outputs}) > 1


def test_seeded_n_samples_differ_and_sample_j_is_seed_plus_j(llm: LLM) -> None:
    # Was a bug (engine/llm.py): every sample of a seeded n > 1 request ran with the request's seed, so all n were
    # one sample repeated. Sample j now runs with seed + j (SamplingParams.for_sample), as vLLM seeds them.
    params = SamplingParams(max_tokens=16, temperature=1.0, n=3, seed=11, ignore_eos=True)
    samples = [o.token_ids for o in llm.generate("xyz", params)[0].outputs]
    alone = [llm.generate("xyz", SamplingParams(max_tokens=16, temperature=1.0, seed=11 + j,
                                                ignore_eos=True))[0].outputs[0].token_ids for j in range(3)]
    assert samples == alone and len({tuple(s) for s in samples}) == 3


def test_for_sample_seeds() -> None:
    params = SamplingParams(n=4, seed=2**64 - 2)
    assert [p.seed for p in (params.for_sample(j) for j in range(4))] == [2**64 - 2, 2**64 - 1, 0, 1]
    assert {p.n for p in (params.for_sample(j) for j in range(4))} == {1}
    unseeded = SamplingParams(n=2)
    assert unseeded.for_sample(1) == SamplingParams(n=1)
    assert SamplingParams().for_sample(0) is not None and SamplingParams(seed=-5, n=2).for_sample(1).seed == -4


def test_top_k_one_is_greedy(llm: LLM) -> None:
    greedy = llm.generate("hello there", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    top1 = llm.generate("hello there", SamplingParams(max_tokens=12, temperature=0.8, top_k=1, ignore_eos=True))[0]
    assert greedy.outputs[0].token_ids == top1.outputs[0].token_ids


def test_stop_token_ids_end_the_request(llm: LLM) -> None:
    free = llm.generate("stop me", SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0].outputs[0]
    target = free.token_ids[5]
    first = free.token_ids.index(target)
    stopped = llm.generate("stop me", SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                     stop_token_ids=(target,)))[0].outputs[0]
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.finish_reason == FinishReason.STOP


def test_stop_string_is_cut_and_never_returned(llm: LLM) -> None:
    free = llm.generate("stop me", SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0].outputs[0]
    text = free.text
    assert len(text) >= 6
    stop = text[3:5]
    stopped = llm.generate("stop me", SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                     stop=(stop,)))[0].outputs[0]
    assert stopped.finish_reason == FinishReason.STOP
    assert stopped.text == text[: text.index(stop)]
    llm.engine.check_invariants()


def test_include_stop_str_in_output_and_special_tokens(llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    text = llm.generate("abc", greedy)[0].outputs[0].text
    stop = text[4:6]
    cut = llm.generate("abc", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=(stop,)))
    kept = llm.generate("abc", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=(stop,),
                                              include_stop_str_in_output=True))
    assert cut[0].outputs[0].text == text[:text.index(stop)]
    assert kept[0].outputs[0].text == text[:text.index(stop) + len(stop)]
    # tiny-random's end-of-sequence token is special: its text shows only when asked for.
    eos = llm.engine.tokenizer.eos_token_id
    forced = dict(max_tokens=1, temperature=0.0, logit_bias=((eos, 100.0),))
    assert llm.generate("abc", SamplingParams(**forced))[0].outputs[0].text == ""
    shown = llm.generate("abc", SamplingParams(**forced, skip_special_tokens=False))[0].outputs[0]
    assert shown.token_ids == [eos] and shown.text == llm.engine.tokenizer.id_to_token(eos)
    llm.engine.check_invariants()


def test_logprobs(llm: LLM) -> None:
    out = llm.generate("abc", SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == 4
    for token_id, sampled in zip(out.token_ids, out.logprobs):
        assert sampled.token_id == token_id
        assert len(sampled.top_logprobs) == 3
        assert sampled.top_logprobs[0][0] == token_id  # greedy picks the most likely
        assert sampled.logprob == pytest.approx(sampled.top_logprobs[0][1])
        assert sampled.logprob <= 0.0


@pytest.mark.parametrize("kv_store_gb", [0.0, 0.001])
def test_reset_prefix_cache_forgets_every_prefix_no_request_holds(kv_store_gb: float) -> None:
    llm = LLM("tiny-random", dtype="float32", num_blocks=12, block_size=4, kv_store_gb=kv_store_gb)
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompts = [[3 + i + 40 * k for i in range(16)] for k in range(3)]  # 3 x 4 blocks: the pool keeps 2 cached
    for prompt in prompts:
        llm.generate(prompt, greedy)
    again = llm.generate(prompts[-1], greedy)[0]
    assert again.num_cached_tokens > 0
    store = llm.store_node.server.state.store if llm.store_node is not None else None
    if store is not None:
        assert store.num_blocks > 0  # every prompt's full blocks were written through
    llm.engine.add_request(prompts[1], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    llm.engine.step()  # `held` runs on (a prefix hit) and keeps its blocks through the reset
    num_used = llm.engine.pool.num_used_blocks
    freed = llm.reset_prefix_cache()
    assert 0 < freed < num_used and llm.engine.pool.num_used_blocks == num_used - freed
    if store is not None:
        assert store.num_blocks == 0
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.generate(prompts[-1], greedy)[0].num_cached_tokens == 0  # nothing of it was kept anywhere
    llm.engine.check_invariants()
    llm.close()


def test_abort_midway_frees_blocks(llm: LLM) -> None:
    engine = llm.engine
    rid = engine.add_request("a long enough prompt to take some blocks" * 4,
                             SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.abort_request(rid)
    engine.abort_request(rid)  # idempotent
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    final = [o for o in outputs if o.request_id == rid and o.finished]
    assert len(final) == 1 and final[0].finish_reason == FinishReason.ABORT
    engine.check_invariants()


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("", {"max_tokens": 4}, "empty"),
        ("x" * 2100, {"max_tokens": 4}, "context"),
    ],
)
def test_bad_prompts_are_rejected_cleanly(llm: LLM, prompt: str, params: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate(prompt, SamplingParams(**params))
    llm.engine.check_invariants()


@pytest.mark.parametrize("kwargs", [{"max_tokens": 0}, {"max_tokens": -3}, {"temperature": -1.0},
                                    {"top_p": 0.0}, {"top_k": -1}, {"logprobs": 99}, {"n": 0}])
def test_bad_sampling_params(kwargs: dict) -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


def test_unknown_model_name() -> None:
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        LLM("no-such-model")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvbaton.cli", *args], capture_output=True, text=True, timeout=120)


def test_cli_generate_json() -> None:
    proc = _cli("generate", "--model", "tiny-random", "--dtype", "float32", "--prompt", "hello world",
                "--max-tokens", "5", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) >= {"text", "token_ids", "prompt_token_ids", "cached_tokens", "ttft_s", "tpot_s"}
    assert len(out["prompt_token_ids"]) == len("hello world")
    assert out["cached_tokens"] == 0


def test_cli_generate_constrained(tmp_path) -> None:  # noqa: ANN001
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                  "additionalProperties": False}))
    for flags, check in [
        (["--regex", "[ab]{4}!"], lambda text: re.fullmatch("[ab]{4}!", text)),
        (["--choice", "left", "--choice", "right"], lambda text: text in ("left", "right")),
        (["--json-schema", f"@{schema}"], lambda text: isinstance(json.loads(text)["ok"], bool)),
    ]:
        proc = _cli("generate", "--model", "tiny-random", "--prompt", "go", "--max-tokens", "16", "--json", *flags)
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert check(out["text"]) and out["finish_reason"] == "stop", out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt", ""], "empty"),
        (["--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
        (["--prompt", "x" * 2100], "context"),
        (["--prompt", "hi", "--regex", "(a"], "invalid regex"),
        (["--prompt", "hi", "--json-schema", "@/nonexistent/schema.json"], "cannot read"),
        (["--prompt", "hi", "--json-schema", "{"], "invalid json schema"),
    ],
)
def test_cli_bad_input_is_one_clear_line(args: list[str], message: str) -> None:
    proc = _cli("generate", "--model", "tiny-random", *args)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert message in proc.stderr


def test_cli_unknown_model_is_one_clear_line() -> None:
    proc = _cli("generate", "--model", "nope-7b", "--prompt", "hi")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "nope-7b" in proc.stderr


def test_cli_unsupported_architecture_gguf_is_one_clear_line(tmp_path) -> None:  # noqa: ANN001
    from kvbaton.model.tiny import create_tiny_random_model
    from tests.model.test_gguf_loader import write_gguf

    config, state = create_tiny_random_model()
    write_gguf(tmp_path / "gpt2.gguf", config, state, arch="gpt2")
    proc = _cli("generate", "--model", str(tmp_path / "gpt2.gguf"), "--prompt", "hi")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "gpt2" in proc.stderr and "not supported" in proc.stderr
