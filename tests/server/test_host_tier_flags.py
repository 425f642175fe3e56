"""Regressions found by bug hunting: the host KV tier's command-line options.

Each test failed on the code it was written against; the fix it guards is named in its comment.
"""

from __future__ import annotations

import pytest

from kvbaton import cli


def _refused(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run `kvbaton ARGV` with the cluster and the worker stubbed out: they must never start. Returns stderr."""
    started: list[str] = []
    monkeypatch.setattr("kvbaton.server.launcher.serve", lambda config: started.append("serve") or 0)
    monkeypatch.setattr("kvbaton.server.worker.Worker", lambda *args, **kwargs: started.append("worker"))
    monkeypatch.setattr("signal.signal", lambda *args: None)  # `kvbaton worker` installs a SIGTERM handler
    assert cli.main(argv) == 2
    assert started == []
    return capsys.readouterr().err


def test_serve_refuses_a_negative_host_num_blocks_before_starting_workers(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # Was a bug (cli.py `_run_serve`): `--host-num-blocks -1` was passed to every worker, each of which loaded the
    # model, registered with the router and only then failed building its engine (CacheConfig), so the cluster
    # started with workers that were already dying. Fixed: refused up front, as --workers and --gpus-per-worker are.
    err = _refused(monkeypatch, capsys, ["serve", "--model", "tiny-random", "--host-num-blocks", "-1"])
    assert err == "kvbaton: error: --host-num-blocks must not be negative, got -1\n"


def test_worker_refuses_a_negative_host_num_blocks_before_loading_and_registering(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # Was a bug (cli.py `_run_worker`): the worker loaded its model and registered with the router before its engine's
    # CacheConfig refused the value, leaving the router a worker that died at once. Fixed: refused before either.
    err = _refused(monkeypatch, capsys, ["worker", "--router", "tcp://127.0.0.1:1", "--host-num-blocks", "-3"])
    assert err == "kvbaton: error: --host-num-blocks must not be negative, got -3\n"
