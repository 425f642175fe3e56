"""benchmarks/gpu_check.sh's two device calls, played here on the CPU: SmolLM2's GGUF (over the 64 MiB one call
carries) split in halves, each call's payload (the tree it sends plus what it carries) under the limit, the first
call's half staged outside the tree, and the second call, in a fresh copy of the tree that holds only what it
carries, joining the halves (checked by their sha256) and running gpu_check.py on the joined file with none of the
packages the GPU machine lacks. No device, no network: the wheel step (`prepare-wheel`, a pip download) is not run
(the venv has gguf, so `run` installs nothing)."""

from __future__ import annotations

import filecmp
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
CARRY_LIMIT = 64 * 1024 * 1024  # /work/.library/device/README.md: the working tree that travels, carried paths too
WHEEL_ALLOWANCE = 1024 * 1024  # the gguf wheel (~0.1 MB), not downloaded here
# kvbaton's dependencies that the GPU machine's image does not have (its package list, device/KINDS.md):
# gpu_check.py must not need them.
NOT_ON_THE_GPU_MACHINE = ("zmq", "fastapi", "starlette", "uvicorn", "httptools", "orjson", "llguidance")

BLOCKER = f'''import sys
class _NotOnTheGpuMachine:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {NOT_ON_THE_GPU_MACHINE!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not on the GPU machine)", name=name)
        return None
sys.meta_path.insert(0, _NotOnTheGpuMachine())
'''


def _smollm2_gguf() -> Path:
    try:
        from kvbaton.model.registry import smollm2_gguf_path

        path = Path(smollm2_gguf_path())
    except Exception as exc:  # noqa: BLE001 - the SmolLM2 package is not installed
        pytest.skip(f"no SmolLM2 GGUF here: {exc}")
    if not path.is_file():
        pytest.skip(f"no SmolLM2 GGUF at {path}")
    return path


def _tracked_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True, timeout=30).stdout
    return [name for name in listed.decode().split("\0") if name and (ROOT / name).is_file()]


def _copy_tree(files: list[str], to: Path) -> None:
    """What a device call's machine gets of the tree (before the carried paths)."""
    for name in files:
        (to / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, to / name)


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _script(tree: Path, *args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(tree / "benchmarks" / "gpu_check.sh"), *args], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(300)
def test_the_two_calls_carry_smollm2_under_the_limit_and_the_second_runs_the_check_on_it(tmp_path: Path) -> None:
    gguf = _smollm2_gguf()
    carry = tmp_path / "carry"
    env = {**os.environ, "GPUCARRY": str(carry), "GGUF": str(gguf), "VENV_PY": sys.executable}
    # Here: split and sizes (the tree as this checkout would send it).
    prepared = _script(ROOT, "prepare-gguf", env=env)
    assert prepared.returncode == 0, prepared.stdout + prepared.stderr
    assert prepared.stdout.count("(ok; tree ") == 2 and "OVER" not in prepared.stdout, prepared.stdout
    files = _tracked_files()
    tree_bytes = sum((ROOT / name).stat().st_size for name in files)
    half_a, half_b = carry / "gguf-a", carry / "gguf-b"
    assert (half_a / "part").stat().st_size + (half_b / "part").stat().st_size == gguf.stat().st_size
    assert tree_bytes + _bytes(half_a) <= CARRY_LIMIT, (tree_bytes, _bytes(half_a))
    assert tree_bytes + _bytes(half_b) + WHEEL_ALLOWANCE <= CARRY_LIMIT, (tree_bytes, _bytes(half_b))
    assert (half_b / "sha256").read_text().strip() == hashlib.sha256(gguf.read_bytes()).hexdigest()

    stage = tmp_path / "machine-tmp"  # the machine's /tmp: it outlives one call's tree while the machine is warm
    # Device call 1: the tree and the first half alone.
    call_1 = tmp_path / "call-1"
    _copy_tree(files, call_1)
    shutil.copytree(half_a, call_1 / ".gpucarry" / "gguf-a")
    machine = {**os.environ, "GPUCHECK_STAGE": str(stage)}
    machine.pop("GPUCARRY", None)
    staged = _script(call_1, "stage-a", env=machine)
    assert staged.returncode == 0, staged.stderr
    assert filecmp.cmp(stage / "part-a", half_a / "part", shallow=False)

    # Device call 2: a fresh tree with the second half (the first call's tree is gone), the packages the GPU machine
    # lacks unimportable, and the check in its CPU mode on the joined file.
    call_2 = tmp_path / "call-2"
    _copy_tree(files, call_2)
    shutil.copytree(half_b, call_2 / ".gpucarry" / "gguf-b")
    (call_2 / ".gpucarry" / "whl").mkdir()
    blocker = tmp_path / "gpu-machine-site"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(BLOCKER)
    out = tmp_path / "out"
    run_env = {**machine, "OUT": str(out), "PYTHON": sys.executable, "PYTHONPATH": str(blocker)}
    for name in NOT_ON_THE_GPU_MACHINE:  # as on that machine (here they are installed)
        probe = subprocess.run([sys.executable, "-c", f"import {name}"], env=run_env, capture_output=True, timeout=30)
        assert probe.returncode == 1 and b"not on the GPU machine" in probe.stderr, name
    ran = _script(call_2, "run", "--small", env=run_env, timeout=280)
    assert ran.returncode == 0, ran.stdout[-3000:]
    joined = stage / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert filecmp.cmp(joined, gguf, shallow=False)
    report = json.loads((out / "gpu_check.json").read_text())
    assert (out / "gpu_check.log").read_text().strip().endswith(json.dumps(report))
    parity = report["parity_smollm2"]
    assert parity["model"] == "smollm2-135m" and parity["equal"], parity  # read from the joined halves
    assert report["ok"] is True, {name: report[name] for name in ("parity_big", "pair")}


def test_join_refuses_a_missing_or_corrupt_half(tmp_path: Path) -> None:
    carry, stage = tmp_path / "carry", tmp_path / "stage"
    (carry / "gguf-b").mkdir(parents=True)
    stage.mkdir()
    env = {**os.environ, "GPUCARRY": str(carry), "GPUCHECK_STAGE": str(stage)}
    first, second = b"GGUF" + bytes(range(256)) * 3, bytes(range(255, -1, -1)) * 2
    (carry / "gguf-b" / "part").write_bytes(second)
    (carry / "gguf-b" / "sha256").write_text(hashlib.sha256(first + second).hexdigest() + "\n")
    missing = _script(ROOT, "join", env=env)
    assert missing.returncode == 0 and missing.stdout == "" and "stage-a not run on it" in missing.stderr
    (stage / "part-a").write_bytes(first)
    joined = _script(ROOT, "join", env=env)
    assert joined.returncode == 0 and Path(joined.stdout.strip()).read_bytes() == first + second, joined.stderr
    (stage / "part-a").write_bytes(first[:-1] + b"x")
    corrupt = _script(ROOT, "join", env=env)
    assert corrupt.stdout == "" and "does not match its sha256" in corrupt.stderr
    assert not (stage / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()  # no half-right file left to be picked up
    (carry / "gguf-b" / "part").unlink()
    assert "no second GGUF half carried" in _script(ROOT, "join", env=env).stderr
