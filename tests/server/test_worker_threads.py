"""`--threads-per-worker`: the launcher passes it to every worker, and a worker applies it before loading its model."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvbaton.cli import build_parser
from kvbaton.server.launcher import ServeConfig, worker_command
from kvbaton.server.worker import Worker, WorkerConfig


@pytest.fixture
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _threads_arg(command: list[str]) -> str:
    return command[command.index("--threads") + 1]


def test_worker_command_carries_threads_per_worker() -> None:
    assert _threads_arg(worker_command(ServeConfig(threads_per_worker=1), "tcp://127.0.0.1:5557", "w0")) == "1"
    # 0 means "share the cores evenly": the worker gets an explicit count (see the test below)
    assert _threads_arg(worker_command(ServeConfig(), "tcp://127.0.0.1:5557", "w0")) == str(
        ServeConfig().num_threads_per_worker)


def test_cli_parses_both_options() -> None:
    parser = build_parser()
    assert parser.parse_args(["serve", "--threads-per-worker", "1"]).threads_per_worker == 1
    worker_args = parser.parse_args(["worker", "--router", "tcp://127.0.0.1:5557", "--threads", "2"])
    assert worker_args.threads == 2
    assert parser.parse_args(["serve"]).threads_per_worker == 0


def test_worker_sets_torch_threads_before_loading(restore_threads: None) -> None:
    torch.set_num_threads(2)
    Worker(WorkerConfig(router_address="tcp://127.0.0.1:1", worker_id="w0", model="tiny-random", num_threads=1))
    assert torch.get_num_threads() == 1


def test_zero_threads_keeps_torch_default(restore_threads: None) -> None:
    torch.set_num_threads(2)
    Worker(WorkerConfig(router_address="tcp://127.0.0.1:1", worker_id="w0", model="tiny-random", num_threads=0))
    assert torch.get_num_threads() == 2


def test_default_threads_share_the_cores_evenly(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert ServeConfig(num_workers=2).num_threads_per_worker == 4
    assert ServeConfig(num_workers=0, num_prefill=1, num_decode=2).num_threads_per_worker == 2
    assert ServeConfig(num_workers=16).num_threads_per_worker == 1
    assert ServeConfig(num_workers=2, threads_per_worker=3).num_threads_per_worker == 3
    assert _threads_arg(worker_command(ServeConfig(num_workers=4), "tcp://127.0.0.1:5557", "w0")) == "2"
