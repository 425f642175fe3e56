"""The command line's side of the trust boundary: deny by default off loopback (one line, nothing started), where
keys come from (flags, KVBATON_API_KEY, a key file), and the cluster secret: generated per run, or a private file
that hand-started workers read; a worker without one refuses to start; workers get it in their environment only."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvbaton import cli
from kvbaton.core.cluster_secret import API_KEY_ENV, SECRET_ENV, ClusterSecret, worker_environment
from kvbaton.server.auth import ADMIN, USER, Principal
from kvbaton.server.launcher import ServeConfig, worker_command

SERVE = ["serve", "--model", "tiny-random"]


def run(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> tuple[int, list[ServeConfig], list[object]]:
    """`kvbaton ARGV` with the launcher and the worker stubbed out; (exit status, serve configs, worker configs)."""
    served: list[ServeConfig] = []
    workers: list[object] = []
    monkeypatch.setattr("kvbaton.server.launcher.serve", lambda config: served.append(config) or 0)
    class StubWorker:
        def __init__(self, config: object, *args: object) -> None:
            workers.append(config)

        def run(self) -> str:
            return "stub"

    monkeypatch.setattr("kvbaton.server.worker.Worker", StubWorker)
    monkeypatch.setattr("signal.signal", lambda *args: None)  # `kvbaton worker` installs a SIGTERM handler
    return cli.main(argv), served, workers


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.7"])
def test_serve_off_loopback_without_a_key_refuses_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str], host: str) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    status, served, _ = run(monkeypatch, [*SERVE, "--host", host])
    err = capsys.readouterr().err
    assert status == 2 and served == []
    assert err.count("\n") == 1 and err.startswith(f"kvbaton: error: refusing to serve on {host} without an API key")


def test_loopback_needs_no_key_and_off_loopback_takes_a_key_or_an_explicit_opt_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert run(monkeypatch, SERVE)[:1] == (0,)  # the quick start: 127.0.0.1, no key
    status, served, _ = run(monkeypatch, [*SERVE, "--host", "0.0.0.0", "--api-key", "k1", "--api-key", "k2"])
    assert status == 0 and served[0].api_keys is not None and len(served[0].api_keys) == 2
    status, served, _ = run(monkeypatch, [*SERVE, "--host", "0.0.0.0", "--allow-unauthenticated"])
    assert status == 0 and served[0].allow_unauthenticated and len(served[0].api_keys or ()) == 0
    monkeypatch.setenv(API_KEY_ENV, "from-the-environment")
    status, served, _ = run(monkeypatch, [*SERVE, "--host", "0.0.0.0"])
    assert status == 0 and served[0].api_keys is not None
    assert served[0].api_keys.principal_of(b"from-the-environment") == Principal("", ADMIN)


def test_an_api_key_file_maps_keys_to_tenants_and_roles(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    path = tmp_path / "keys.json"
    path.write_text(json.dumps([{"key": "sk-a", "tenant": "acme", "role": "user"},
                                {"key": "sk-ops", "tenant": "ops", "role": "admin"}]))
    status, served, _ = run(monkeypatch, [*SERVE, "--api-key-file", str(path), "--trust-tenant-header",
                                          "--metrics-require-key"])
    keys = served[0].api_keys
    assert status == 0 and keys is not None and served[0].trust_tenant_header and served[0].metrics_require_key
    assert keys.principal_of(b"sk-a") == Principal("acme", USER)
    assert keys.principal_of(b"sk-ops") == Principal("ops", ADMIN)
    path.write_text(json.dumps([{"key": "sk-a", "role": "root"}]))
    assert run(monkeypatch, [*SERVE, "--api-key-file", str(path)])[0] == 2
    assert "role must be one of user, admin" in capsys.readouterr().err


def test_serve_writes_a_private_cluster_secret_file_for_hand_started_workers(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    path = tmp_path / "cluster.secret"
    status, served, _ = run(monkeypatch, [*SERVE, "--cluster-secret-file", str(path)])
    assert status == 0 and os.stat(path).st_mode & 0o777 == 0o600
    secret = served[0].cluster_secret
    assert secret is not None and ClusterSecret.read_file(str(path)) == secret
    # A worker started by hand with that file joins with the same secret.
    status, _, workers = run(monkeypatch, ["worker", "--router", "tcp://127.0.0.1:1", "--cluster-secret-file",
                                           str(path)])
    assert status == 0 and workers[0].cluster_secret == secret  # type: ignore[attr-defined]
    # A file other users may read is refused, by serve and by worker alike.
    path.chmod(0o644)
    for argv in ([*SERVE, "--cluster-secret-file", str(path)],
                 ["worker", "--router", "tcp://127.0.0.1:1", "--cluster-secret-file", str(path)]):
        assert run(monkeypatch, argv)[0] == 2
        assert "is open to other users (mode 0644): chmod 600" in capsys.readouterr().err


def test_a_worker_without_a_secret_refuses_to_start(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    status, _, workers = run(monkeypatch, ["worker", "--router", "tcp://127.0.0.1:1"])
    assert status == 2 and workers == []
    assert capsys.readouterr().err.startswith("kvbaton: error: no cluster secret")
    monkeypatch.setenv(SECRET_ENV, "not hex")
    assert run(monkeypatch, ["worker", "--router", "tcp://127.0.0.1:1"])[0] == 2


def test_workers_get_the_secret_in_their_environment_never_on_their_command_line() -> None:
    secret = ClusterSecret.generate()
    command = worker_command(ServeConfig(cluster_secret=secret), "tcp://127.0.0.1:1", "w0")
    assert secret.to_hex() not in " ".join(command)
    environment = worker_environment(secret, {"PATH": "/bin", API_KEY_ENV: "sk-router-only"})
    assert environment == {"PATH": "/bin", SECRET_ENV: secret.to_hex()}  # the router's API key stays behind
    assert secret.to_hex() not in repr(ServeConfig(cluster_secret=secret)) and "value" not in repr(secret)
