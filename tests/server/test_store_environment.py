"""The one function that says what a worker's environment gets for the KV store, for local workers and Ray's actors
alike: streaming copies (unless the threshold is set already) and a store transport forced in the launcher's."""

from __future__ import annotations

import pytest

from kvbaton.server.launcher import ServeConfig, store_environment
from kvbaton.server.store_client import TRANSPORT_ENV
from kvbaton.transfer.store_slots import STREAMING_COPIES


def test_store_workers_get_streaming_copies_and_a_forced_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TRANSPORT_ENV, raising=False)
    assert store_environment(ServeConfig(model="tiny-random"), {"GLIBC_TUNABLES": ""}) == {}  # no store
    config = ServeConfig(model="tiny-random", kv_store_gb=0.1)
    assert store_environment(config, {}) == {"GLIBC_TUNABLES": STREAMING_COPIES}
    assert store_environment(config, {"GLIBC_TUNABLES": "glibc.a=1"}) == {
        "GLIBC_TUNABLES": f"glibc.a=1:{STREAMING_COPIES}"}
    assert store_environment(config, {"GLIBC_TUNABLES": "glibc.cpu.x86_non_temporal_threshold=1"}) == {}
    monkeypatch.setenv(TRANSPORT_ENV, "tcp")
    assert store_environment(config, {})[TRANSPORT_ENV] == "tcp"
