"""The Mooncake trace loader reproduces the trace's published statistics and its block-level sharing."""

from __future__ import annotations

import itertools
import json
import statistics

import pytest

from kvbaton.bench.workloads import create_workload
from kvbaton.bench.workloads.mooncake import DEFAULT_MOONCAKE_TRACE, MOONCAKE_BLOCK_TOKENS, read_mooncake_trace
from kvbaton.core.errors import InvalidRequestError

needs_trace = pytest.mark.skipif(not DEFAULT_MOONCAKE_TRACE.is_file(), reason="shared Mooncake trace not present")


@pytest.fixture(scope="module")
def trace_workload() -> list:
    return create_workload("mooncake")


@needs_trace
def test_published_statistics(trace_workload: list) -> None:
    # Mooncake FAST'25 synthetic trace: 3,993 requests, mean input 15,325, mean output 149
    assert len(trace_workload) == 3993
    assert round(statistics.fmean(r.num_prompt_tokens for r in trace_workload)) == 15325
    assert round(statistics.fmean(r.output_tokens for r in trace_workload)) == 149
    rows = read_mooncake_trace(DEFAULT_MOONCAKE_TRACE)
    assert trace_workload[-1].arrival_s == pytest.approx(rows[-1]["timestamp"] / 1000)


@needs_trace
def test_k_shared_hash_ids_mean_k_blocks_of_shared_tokens(trace_workload: list) -> None:
    rows = read_mooncake_trace(DEFAULT_MOONCAKE_TRACE)
    by_first_id: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        by_first_id.setdefault(row["hash_ids"][0], []).append(i)
    num_partial = num_prefix = 0
    for members in by_first_id.values():
        for i, j in itertools.combinations(members[:30], 2):
            a, b = rows[i]["hash_ids"], rows[j]["hash_ids"]
            k = next((n for n, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            pa, pb = trace_workload[i].prompt_array, trace_workload[j].prompt_array
            n = min(len(pa), len(pb))
            diff = (pa[:n] != pb[:n]).nonzero()[0]
            if k < min(len(a), len(b)):
                # they part at block k: exactly k * 512 leading tokens in common
                assert diff[0] == k * MOONCAKE_BLOCK_TOKENS, (i, j, k)
                num_partial += 1
            else:
                # one id list is a prefix of the other: the shorter prompt is a prefix of the longer
                assert len(diff) == 0, (i, j)
                num_prefix += 1
    assert num_partial > 1000 and num_prefix > 10


def test_small_trace_file_speed_and_rate(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    rows = [{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [7, 8]},
            {"timestamp": 500, "input_length": 1024, "output_length": 5, "hash_ids": [7, 8]},
            {"timestamp": 1000, "input_length": 100, "output_length": 0, "hash_ids": [9]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    requests = create_workload("mooncake", trace=str(path), speed=2.0)
    assert [r.arrival_s for r in requests] == [0.0, 0.25, 0.5]
    assert [r.num_prompt_tokens for r in requests] == [600, 1024, 100]
    assert [r.output_tokens for r in requests] == [3, 5, 1]  # zero-length outputs are raised to 1
    assert requests[0].prompt_token_ids == requests[1].prompt_token_ids[:600]
    assert create_workload("mooncake", trace=str(path), rate=4.0)[-1].arrival_s == pytest.approx(0.5)
    assert len(create_workload("mooncake", trace=str(path), num_requests=2)) == 2
    poisson = create_workload("mooncake", trace=str(path), arrival="poisson", rate=1.0)
    assert [r.num_prompt_tokens for r in poisson] == [600, 1024, 100]


def test_bad_trace_rows_are_user_errors(tmp_path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [1]}) + "\n")
    with pytest.raises(InvalidRequestError):
        create_workload("mooncake", trace=str(path))
    with pytest.raises(InvalidRequestError):
        create_workload("mooncake", trace=str(tmp_path / "missing.jsonl"))
