"""Regressions of `kvbaton sim` found by a bug hunt: cluster specs, arrivals and traces at their edges."""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pytest

from kvbaton.bench.arrivals import gamma_arrivals
from kvbaton.bench.workloads import create_workload
from kvbaton.core.errors import InvalidRequestError
from kvbaton.sim.cli import add_sim_arguments, run_sim
from kvbaton.sim.spec import parse_cluster_spec


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    return parser.parse_args(["--workload", "sharegpt-like", "--num-requests", "4", "--no-progress", *argv])


@pytest.mark.parametrize("model, cluster", [("llama-3-8b", "1xmixed:tp=3"), ("llama-2-7b", "1xmixed:tp=64"),
                                            ("llama-3-8b", "1P1D:tp_d=16")])
def test_a_tensor_degree_the_heads_do_not_split_by_is_refused(model: str, cluster: str) -> None:
    # Bug: the sim checked pp against the layers but never tp against the heads: llama-3-8b (32 heads, 8 KV heads)
    # ran at tp=3, and llama-2-7b at tp=64, the roofline dividing the step by tp as if the split were possible.
    with pytest.raises(InvalidRequestError, match="heads"):
        run_sim(parse(["--model", model, "--cluster", cluster]))


@pytest.mark.parametrize("text", ["2xmixed:tp_p=2", "2xmixed:pp_d=2", "2xmixed:link=nvlink", "2P2D:tp_p=2,tp_p=4"])
def test_options_that_would_be_ignored_are_refused(text: str) -> None:
    # Bug: pool options and a link on a mixed cluster were silently ignored, and a repeated option silently took
    # its last value, so a typo simulated some other cluster than the one asked for.
    with pytest.raises(InvalidRequestError):
        parse_cluster_spec(text)


@pytest.mark.parametrize("cv", [float("inf"), 1e200])
def test_gamma_arrivals_refuse_a_cv_whose_shape_underflows(cv: float) -> None:
    # Bug: `cv > 0` let inf (and any cv whose square overflows) through; shape 1/cv^2 became 0 and the scale
    # 1/(rate * shape) raised ZeroDivisionError (a traceback from `kvbaton sim --arrival gamma --cv inf`).
    with pytest.raises(InvalidRequestError, match="cv"):
        gamma_arrivals(random.Random(0), 3, 1.0, cv)


@pytest.mark.parametrize("row", [
    '{"timestamp": 1, "input_length": 5, "output_length": 3, "hash_ids": [1e400]}',
    '{"timestamp": 1, "input_length": 5, "output_length": 1e400, "hash_ids": [1]}',
    '{"timestamp": 1, "input_length": 1e400, "output_length": 3, "hash_ids": [1]}',
])
def test_a_trace_row_with_an_infinite_count_is_refused(tmp_path: Path, row: str) -> None:
    # Bug: int(inf) raises OverflowError, which the row parser did not catch: a traceback, not a one-line error.
    trace = tmp_path / "trace.jsonl"
    trace.write_text(row + "\n")
    with pytest.raises(InvalidRequestError, match="trace.jsonl:1"):
        create_workload("mooncake", num_requests=1, seed=0, trace=str(trace))


@pytest.mark.parametrize("salt", [-1, 2**64])
def test_mooncake_salt_outside_uint64_is_taken(salt: int) -> None:
    # Bug: the salt went into np.uint64(salt) unchecked, so --param salt=-1 raised OverflowError (a traceback).
    requests = create_workload("mooncake", num_requests=2, seed=0, salt=salt)
    assert len(requests) == 2


def test_a_reader_that_goes_away_ends_the_command_quietly() -> None:
    # Was a bug: `kvbaton sim --json ... | head` (any output written with print) printed a BrokenPipeError traceback.
    # The command now stops quietly with status 141, as a writer killed by SIGPIPE reports.
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-m", "kvbaton.cli", "sim", "--workload", "tool-use", "--model",
                                "mistral-7b", "--gpu", "a6000", "--cluster", "1xmixed", "--rate", "2",
                                "--num-requests", "20", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()  # the reader is gone before anything is written
    stderr = process.stderr.read().decode()
    assert process.wait(120) == 141 and "Traceback" not in stderr, stderr
