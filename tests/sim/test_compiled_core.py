"""The policy core compiled by mypyc (`kvbaton.compiled`, `make compiled`) simulates exactly as the interpreted one.

One build into a copy of the sources (a minute on two cores), then: every simulator output but `cpu_s` is
byte-identical to the checkout's on configurations that reach the compiled modules' paths (mixed workers with
preble at full context, PD pairs with handoffs, the KV store and the conductor, admission with a pool balancer);
the compiled extensions are what those runs imported; a changed source makes importing kvbaton fail until the
build is redone or removed, and `clean` leaves plain sources that import again; a build that fails (a type error
mypy refuses) leaves no extension behind, nor a manifest.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvbaton import compiled

SRC = Path(compiled.__file__).resolve().parent.parent
TRACE = SRC.parent.parent / "shared" / "data" / "mooncake" / "synthetic_trace.jsonl"  # ../shared beside the checkout

pytest.importorskip("mypyc", reason="the `compile` extra (mypy) builds the compiled core")
pytestmark = pytest.mark.timeout(1200)

SIMS = (
    ["--workload", "tool-use", "--num-requests", "300", "--rate", "30", "--cluster", "2P2D",
     "--policy", "preble,round_robin"],
    ["--workload", "conversation", "--num-requests", "300", "--cluster", "4xmixed", "--policy", "conductor,preble",
     "--kv-store-gb", "8"],
    ["--workload", "shared-prefix", "--num-requests", "300", "--cluster", "3P1D", "--policy", "preble",
     "--num-blocks", "1500", "--admission", "early", "--ttft-slo", "0.5", "--tpot-slo", "0.05", "--adaptive-pools"],
    ["--workload", "sharegpt-like", "--num-requests", "200", "--cluster", "1P1D", "--policy", "preble",
     "--speculative-tokens", "4", "--reserve-ahead-tokens", "4096"],
)


def _run(src: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env)


def _sim(src: Path, args: list[str]) -> dict[str, object]:
    code = "import sys; from kvbaton.cli import main; sys.argv = ['kvbaton', *sys.argv[1:]]; main()"
    proc = _run(src, "-c", code, "sim", *args, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    result.pop("cpu_s")
    return result


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the checkout's sources with the compiled core built in it."""
    src = compiled.copy_sources(tmp_path_factory.mktemp("compiled") / "src")
    proc = _run(src, str(src / "kvbaton" / "compiled.py"), "build", str(src), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return src


def test_compiled_core_loads_its_extensions(built: Path) -> None:
    """Every kvbaton module imports beside the compiled ones (no interpreted class may subclass a compiled one), and
    the compiled ones are what is loaded."""
    expected = sorted(path.removesuffix(".py").replace("/", ".") for path in compiled.MODULES)
    code = ("import importlib, json, pkgutil, kvbaton; from kvbaton import compiled\n"
            "for module in pkgutil.walk_packages(kvbaton.__path__, 'kvbaton.'): importlib.import_module(module.name)\n"
            "print(json.dumps(compiled.loaded()))")
    proc = _run(built, "-c", code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(json.loads(proc.stdout)) == expected
    proc = _run(SRC, "-c", code)  # the checkout itself runs its sources (CI never builds there)
    assert proc.returncode == 0 and json.loads(proc.stdout) == [], proc.stderr[-3000:]


@pytest.mark.parametrize("args", SIMS, ids=["pd-pairs", "store-conductor", "admission-pools", "speculative-reserve"])
def test_compiled_core_simulates_identically(built: Path, args: list[str]) -> None:
    assert _sim(built, args) == _sim(SRC, args)


@pytest.mark.skipif(not TRACE.exists(), reason="needs ../shared/data/mooncake")
def test_compiled_core_simulates_the_mooncake_trace_identically(built: Path) -> None:
    args = ["--workload", "mooncake", "--trace", str(TRACE), "--num-requests", "400", "--cluster", "8xmixed",
            "--policy", "preble", "--max-model-len", "262144"]
    assert _sim(built, args) == _sim(SRC, args)


def test_a_changed_source_makes_the_build_stale_until_it_is_cleaned(built: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(built, src, symlinks=True)
    module = src / compiled.MODULES[0]
    module.write_text(module.read_text() + "\n# changed after the build\n")
    proc = _run(src, "-c", "import kvbaton")
    assert proc.returncode != 0 and "compiled modules are stale" in proc.stderr, proc.stderr[-3000:]
    assert compiled.MODULES[0].removesuffix(".py").replace("/", ".") in proc.stderr
    proc = _run(src, str(src / "kvbaton" / "compiled.py"), "clean", str(src))  # a script: needs no import
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not list(src.rglob("*.so")) and not (src / "kvbaton" / compiled.MANIFEST).exists()
    proc = _run(src, "-c", "import json, kvbaton.sim.run; from kvbaton import compiled; "
                           "print(json.dumps(compiled.loaded()))")
    assert proc.returncode == 0 and json.loads(proc.stdout) == [], proc.stderr[-3000:]


def test_a_failed_build_leaves_nothing_that_would_load_unchecked(built: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(built, src, symlinks=True)  # a build in place, which the failed one must remove too
    module = src / "kvbaton" / "sim" / "prompts.py"
    module.write_text(module.read_text() + "\nBROKEN: int = 'not an int'\n")  # mypy refuses it: nothing compiles
    proc = _run(src, str(src / "kvbaton" / "compiled.py"), "build", str(src), timeout=900)
    assert proc.returncode != 0 and "kvbaton/sim/prompts.py" in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert not list(src.rglob("*.so")) and not (src / "kvbaton" / compiled.MANIFEST).exists()
