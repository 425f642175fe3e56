"""The router is policy core: importing it must not pull in torch, fastapi or zmq."""

from __future__ import annotations

import subprocess
import sys

MODULES = ["base", "load", "policies", "preble", "prefill_model", "prefix_index", "state"]


def test_router_imports_no_heavy_frameworks() -> None:
    imports = "; ".join(f"import kvbaton.router.{m}" for m in MODULES)
    probe = f"import sys; {imports}; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'fastapi', 'zmq')))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
