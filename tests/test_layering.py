"""Architecture checks: layers import downward only, and the policy core never pulls in torch, fastapi or zmq."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "kvbaton"

# Lower rank = lower layer. A module may import its own layer or any lower one (shared/DESIGN.md). The offline
# `LLM` (llm.py) sits on top beside the CLI: it starts its store node from `server`.
LAYER_RANK = {
    "core": 0, "bench": 1, "cache": 2, "scheduler": 3, "transfer": 4, "router": 5, "sim": 6, "plan": 7,
    "model": 8, "engine": 9, "server": 10, "cli": 11, "llm": 11,
}
POLICY_CORE = ("core", "bench", "cache", "scheduler", "transfer", "router", "sim", "plan")
FORBIDDEN_IN_CORE = ("torch", "fastapi", "zmq", "uvicorn", "starlette")


def _layer_of(module_path: Path) -> str:
    rel = module_path.relative_to(SRC)
    return rel.parts[0].removesuffix(".py")


def _kvbaton_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvbaton."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("kvbaton."))
    return found


def _modules() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if p.parent != SRC or p.name in ("cli.py", "llm.py"))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_imports_point_down(path: Path) -> None:
    layer = _layer_of(path)
    rank = LAYER_RANK[layer]
    upward = {dep for dep in _kvbaton_imports(path) if LAYER_RANK[dep] > rank}
    assert not upward, f"{path.relative_to(SRC)} ({layer}) imports higher layers {sorted(upward)}"


def _policy_modules() -> list[str]:
    names = []
    for layer in POLICY_CORE:
        for path in sorted((SRC / layer).rglob("*.py")):
            rel = path.relative_to(SRC.parent).with_suffix("")
            names.append(".".join(rel.parts).removesuffix(".__init__"))
    return names


def test_policy_core_imports_no_torch_fastapi_or_zmq() -> None:
    modules = _policy_modules()
    assert len(modules) > 10
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN_IN_CORE!r})\n"
        "print(','.join(bad))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", f"policy core pulled in: {proc.stdout.strip()}"
