"""The protocol half of `kvbaton.transfer` stays pure: the simulator imports it without numpy, torch or zmq."""

from __future__ import annotations

import subprocess
import sys

PURE_MODULES = ("kvbaton.transfer", "kvbaton.transfer.layout", "kvbaton.transfer.messages",
                "kvbaton.transfer.states", "kvbaton.transfer.source", "kvbaton.transfer.destination",
                "kvbaton.transfer.block_runs", "kvbaton.transfer.codec")


def test_protocol_modules_import_no_numpy_torch_or_zmq() -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {PURE_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in ('numpy', 'torch', 'zmq', 'fastapi'))))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""
