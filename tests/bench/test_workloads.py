"""Workload generators: determinism, valid token ids, the documented shapes and measured sharing."""

from __future__ import annotations

import statistics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbaton.bench.sharing import PrefixSharingIndex, describe_workload, measure_sharing
from kvbaton.bench.tokens import FIRST_NORMAL_TOKEN
from kvbaton.bench.workloads import PREBLE_WORKLOADS, WORKLOADS, WorkloadRequest, create_workload
from kvbaton.bench.workloads.distserve import MAX_TOTAL_TOKENS, distserve_lengths
from kvbaton.core.errors import InvalidRequestError

SYNTHETIC = [name for name in WORKLOADS if name != "mooncake"]


def fingerprint(requests: list[WorkloadRequest]) -> list[tuple]:
    return [(r.index, r.arrival_s, r.prompt_token_ids, r.output_tokens, r.slo_class, r.tenant, r.group)
            for r in requests]


@pytest.mark.parametrize("name", SYNTHETIC)
def test_deterministic_for_a_seed(name: str) -> None:
    a = create_workload(name, num_requests=60, seed=3)
    assert fingerprint(a) == fingerprint(create_workload(name, num_requests=60, seed=3))
    assert fingerprint(a) != fingerprint(create_workload(name, num_requests=60, seed=4))


@pytest.mark.parametrize("name", SYNTHETIC)
def test_token_ids_valid_and_arrivals_ordered(name: str) -> None:
    vocab = 1000
    requests = create_workload(name, num_requests=80, seed=1, vocab_size=vocab)
    assert len(requests) == 80
    assert [r.index for r in requests] == list(range(80))
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    for r in requests:
        prompt = r.prompt_array
        assert prompt.dtype == np.int32 and len(prompt) == r.num_prompt_tokens > 0
        assert FIRST_NORMAL_TOKEN <= int(prompt.min()) and int(prompt.max()) < vocab
        assert r.output_tokens >= 1


def test_arrival_process_does_not_change_prompts() -> None:
    poisson = create_workload("tool-use", num_requests=50, seed=2, rate=5.0)
    gamma = create_workload("tool-use", num_requests=50, seed=2, rate=5.0, arrival="gamma", arrival_cv=4.0)
    assert [r.prompt_token_ids for r in poisson] == [r.prompt_token_ids for r in gamma]
    assert [r.arrival_s for r in poisson] != [r.arrival_s for r in gamma]


def test_shared_prefix_shape() -> None:
    requests = create_workload("shared-prefix", seed=0, num_groups=4, prompts_per_group=5, system_prompt_tokens=100,
                               question_tokens=10, output_tokens=7)
    assert len(requests) == 20
    by_group: dict[str, list[WorkloadRequest]] = {}
    for r in requests:
        by_group.setdefault(r.group, []).append(r)
        assert r.num_prompt_tokens == 110 and r.output_tokens == 7
    assert sorted(len(g) for g in by_group.values()) == [5, 5, 5, 5]
    for members in by_group.values():
        heads = {m.prompt_token_ids[:100] for m in members}
        assert len(heads) == 1
    # 20 prompts of 110 tokens; each group's first prompt shares nothing: 16 * 100 shared tokens
    shared, total = measure_sharing(requests)
    assert (shared, total) == (16 * 100, 20 * 110)


def test_shared_prefix_zipf_is_skewed() -> None:
    requests = create_workload("shared-prefix", num_requests=2000, seed=0, num_groups=16, zipf_exponent=1.2,
                               system_prompt_tokens=8, question_tokens=4)
    counts = sorted((sum(r.group == f"g{i}" for r in requests) for i in range(16)), reverse=True)
    assert counts[0] > 5 * counts[-1]


def test_hot_prefix_burst_classes_rates_and_burst() -> None:
    requests = create_workload("hot-prefix-burst", num_requests=4000, seed=0)
    by_class = {c: [r for r in requests if r.slo_class == c] for c in "ABC"}
    system = requests[0].prompt_token_ids[:8000]
    assert all(r.prompt_token_ids[:8000] == system for r in requests[:50])
    assert {r.num_prompt_tokens for r in by_class["A"]} == {8000 + 200 + 16}
    assert {r.num_prompt_tokens for r in by_class["B"]} == {8000 + 400 + 16}
    assert {r.num_prompt_tokens for r in by_class["C"]} == {8000 + 16}
    # nominal duration 4000 / (125 + 3 * 100 * 0.2) = 21.62 s, counting the burst's extra A
    # requests; before the burst (first 40 %, 8.65 s) the class rates are 100 / 5 / 20
    nominal_s = 4000 / 185
    start_s, end_s = 0.4 * nominal_s, 0.6 * nominal_s
    before = [r for r in requests if r.arrival_s < start_s]
    assert sum(r.slo_class == "A" for r in before) / start_s == pytest.approx(100, rel=0.1)
    assert sum(r.slo_class == "C" for r in before) / start_s == pytest.approx(20, rel=0.25)
    burst = [r for r in requests if start_s <= r.arrival_s < end_s]
    assert sum(r.slo_class == "A" for r in burst) / (end_s - start_s) == pytest.approx(400, rel=0.1)
    assert sum(r.slo_class == "C" for r in burst) / (end_s - start_s) == pytest.approx(20, rel=0.3)
    assert requests[-1].arrival_s == pytest.approx(nominal_s, rel=0.1)
    scaled = create_workload("hot-prefix-burst", num_requests=2000, seed=0, rate=12.5, burst_frac=0.0)
    assert len(scaled) / scaled[-1].arrival_s == pytest.approx(12.5, rel=0.1)


def test_agent_turns_extend_the_previous_turn() -> None:
    requests = create_workload("agent", num_requests=300, seed=0)
    last_prompt: dict[str, tuple[int, ...]] = {}
    for r in requests:
        prompt = r.prompt_token_ids
        if r.group in last_prompt:
            prev = last_prompt[r.group]
            assert len(prompt) > len(prev) and prompt[:len(prev)] == prev
        last_prompt[r.group] = prompt


@pytest.mark.parametrize("name", PREBLE_WORKLOADS)
def test_preble_workloads_share_85_to_97_percent(name: str) -> None:
    # Preble (ICLR 2025) reports 85-97 % of prompt tokens shared across its five workloads.
    for seed in (0, 1):
        stats = describe_workload(create_workload(name, seed=seed))
        assert 0.85 <= stats.sharing_ratio <= 0.97, (name, seed, stats.sharing_ratio)


def test_preble_prompt_lengths_match_the_paper_shape() -> None:
    # means quoted from Preble Table 1 (prompt tokens); the generators aim within 20 %
    paper = {"tool-use": 1835, "agent": 2285, "programming": 3871, "video-qa": 9865, "long-doc-qa": 23474}
    for name, mean in paper.items():
        got = statistics.fmean(r.num_prompt_tokens for r in create_workload(name, seed=0))
        assert got == pytest.approx(mean, rel=0.2), name


def test_length_scale_shrinks_prompts() -> None:
    full = create_workload("long-doc-qa", num_requests=40, seed=0)
    quarter = create_workload("long-doc-qa", num_requests=40, seed=0, length_scale=0.25)
    ratio = sum(r.num_prompt_tokens for r in quarter) / sum(r.num_prompt_tokens for r in full)
    assert ratio == pytest.approx(0.25, rel=0.02)


def test_sharing_index_is_exact_at_token_level() -> None:
    index = PrefixSharingIndex()
    base = np.arange(100, 400, dtype=np.int32)
    assert index.insert(base) == 0
    assert index.insert(base[:150]) == 150  # a prefix of an earlier prompt
    other = base.copy()
    other[137] = 5
    assert index.insert(other) == 137  # diverges mid-chunk
    assert index.insert(base, tenant="t2") == 0  # tenants never share


def test_sharegpt_file(tmp_path) -> None:
    import json

    convs = [{"conversations": [{"from": "human", "value": "tell me a story about a cat"},
                                {"from": "gpt", "value": "once upon a time there was a cat"}]},
             {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
             {"conversations": [{"from": "human", "value": "tell me a story about a dog please"},
                                {"from": "gpt", "value": "no"}]}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs))
    requests = create_workload("sharegpt-like", seed=0, sharegpt_path=str(path))
    assert sorted(r.num_prompt_tokens for r in requests) == [7, 8]  # "hi" is dropped (< 4 words)
    assert sorted(r.output_tokens for r in requests) == [1, 8]
    shared, _ = measure_sharing(requests)
    assert shared == 6  # "tell me a story about a" is common, word for word


def test_unknown_names_and_params_are_user_errors() -> None:
    with pytest.raises(InvalidRequestError):
        create_workload("nope")
    with pytest.raises(InvalidRequestError):
        create_workload("tool-use", num_tools_typo=3)
    with pytest.raises(InvalidRequestError):
        create_workload("tool-use", arrival="trace")


def test_100k_shared_prefix_requests_generate_in_seconds() -> None:
    import time

    start = time.perf_counter()
    requests = create_workload("shared-prefix", num_requests=100_000, seed=0)
    elapsed_s = time.perf_counter() - start
    assert len(requests) == 100_000 and requests[-1].num_prompt_tokens == 2048 + 128
    assert elapsed_s < 20.0  # about 3 s on the 2-core dev machine (benchmarks/workload_gen.py)


@settings(max_examples=60, deadline=None)
@given(base=st.lists(st.integers(17, 19), min_size=300, max_size=300),
       shapes=st.lists(st.tuples(st.integers(0, 300), st.lists(st.integers(17, 19), max_size=40),
                                 st.sampled_from(["", "t"])), min_size=1, max_size=12))
def test_sharing_index_matches_brute_force(base: list[int], shapes: list[tuple[int, list[int], str]]) -> None:
    # Every prompt is a prefix of one 300-token base plus a random tail, so common prefixes end
    # anywhere, inside and across 128-token chunks; empty prompts are skipped by construction.
    prompts = [(base[:cut] + tail or [17], tenant) for cut, tail, tenant in shapes]
    index = PrefixSharingIndex()
    for i, (prompt, tenant) in enumerate(prompts):
        expected = 0
        for earlier, earlier_tenant in prompts[:i]:
            if earlier_tenant == tenant:
                lcp = next((k for k, (x, y) in enumerate(zip(prompt, earlier)) if x != y),
                           min(len(prompt), len(earlier)))
                expected = max(expected, lcp)
        assert index.insert(np.asarray(prompt, dtype=np.int32), tenant) == expected


def test_shifting_mix_turns_long_prompts_into_long_outputs_at_the_shift() -> None:
    requests = create_workload("shifting-mix", num_requests=200, seed=1, rate=4.0, shift_fraction=0.25)
    first, second = requests[:50], requests[50:]
    assert {r.group for r in first} == {"phase1"} and {r.group for r in second} == {"phase2"}
    assert (statistics.fmean(r.num_prompt_tokens for r in first)
            > 5 * statistics.fmean(r.num_prompt_tokens for r in second))
    assert statistics.fmean(r.output_tokens for r in second) > 10 * statistics.fmean(r.output_tokens for r in first)
    assert max(r.arrival_s for r in first) < min(r.arrival_s for r in second)
    with pytest.raises(InvalidRequestError, match="shift_fraction"):
        create_workload("shifting-mix", num_requests=10, shift_fraction=1.0)


def test_distserve_sharegpt_follows_distserves_opt13b_mix_under_its_cut() -> None:
    pairs = distserve_lengths(np.random.default_rng(0), 20_000)
    prompts = np.array([p for p, _ in pairs])
    outputs = np.array([o for _, o in pairs])
    assert all(p + o < MAX_TOTAL_TOKENS and p >= 9 and o >= 1 for p, o in pairs)
    # The trace it stands for: prompt mean 780, P90 1,512; output mean 176, median 67 (module docstring).
    assert 750 < prompts.mean() < 810 and 1450 < np.percentile(prompts, 90) < 1560
    assert 150 < outputs.mean() < 190 and 50 < np.median(outputs) < 80
    requests = create_workload("distserve-sharegpt", num_requests=50, seed=3, rate=2.0)
    again = create_workload("distserve-sharegpt", num_requests=50, seed=3, rate=2.0)
    assert [(r.num_prompt_tokens, r.output_tokens, r.arrival_s) for r in requests] == \
        [(r.num_prompt_tokens, r.output_tokens, r.arrival_s) for r in again]
