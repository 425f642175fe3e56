"""Simulator speed with the policy core compiled (mypyc, `make compiled`) beside the same sources interpreted.

Issue 20's targets: CPU-s per 1,000 requests on the Mooncake synthetic trace, 8 mixed H100 workers, llama-3-8b,
preble (<= 2.0), at full context (`--max-model-len 262144`, every request served) and at the model's default 8k
context (half the trace fails at ingress there); and on `sim_speed.py`'s workload (8P8D preble, <= 0.5). Both
sides run the same commit's sources in fresh processes with the same command and the same timer (`kvbaton sim
--json`'s `cpu_s`, the simulation alone; `sim_speed.py`'s per-configuration medians), taken in turn, the order
swapped every repeat; the figure is the median of the repeats with their range. Every compiled run's `--json`
must equal the interpreted run's but `cpu_s` (`identical`). The compiled build goes into a temporary copy of the
sources (timed: `build_s`), or `--compiled-src DIR` reuses one built by `python src/kvbaton/compiled.py build DIR`.
Usage: python benchmarks/sim_compiled.py [--repeats 3] [--contexts full,default] [--no-sim-speed] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvbaton import compiled

SRC = Path(__file__).resolve().parent.parent / "src"
TRACE = SRC.parent.parent / "shared" / "data" / "mooncake" / "synthetic_trace.jsonl"
TARGET_MOONCAKE = 2.0  # CPU-s per 1,000 requests (issue 20)
TARGET_SIM_SPEED = 0.5
CONTEXTS = {"full": ["--max-model-len", "262144"], "default": []}
SIM = "import sys; from kvbaton.cli import main; sys.argv = ['kvbaton', *sys.argv[1:]]; main()"


def _run(src: Path, args: list[str], timeout: float) -> str:
    env = {**os.environ, "PYTHONPATH": str(src)}
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode:
        raise SystemExit(f"{' '.join(args[:3])} failed under {src}:\n{proc.stderr[-3000:]}")
    return proc.stdout


def _loaded(src: Path) -> list[str]:
    code = ("import importlib, json; from kvbaton import compiled\n"
            "for path in compiled.MODULES: importlib.import_module(path.removesuffix('.py').replace('/', '.'))\n"
            "print(json.dumps(compiled.loaded()))")
    return json.loads(_run(src, ["-c", code], 120))


def _build(work: Path) -> tuple[Path, float]:
    src = compiled.copy_sources(work / "src", SRC)
    started = time.perf_counter()
    _run(src, [str(src / "kvbaton" / "compiled.py"), "build", str(src)], 1800)
    return src, time.perf_counter() - started


def _summary(cpu_s: list[float], num_requests: int) -> dict[str, object]:
    per_1000 = [1000 * c / num_requests for c in cpu_s]
    return {"cpu_s_per_1000_requests": round(statistics.median(per_1000), 3),
            "cpu_s_per_1000_runs": [round(x, 3) for x in per_1000], "cpu_s_median": round(statistics.median(cpu_s), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--contexts", default="full,default", help=f"comma-separated, from {', '.join(CONTEXTS)}")
    parser.add_argument("--no-sim-speed", action="store_true", help="skip sim_speed.py's workload")
    parser.add_argument("--compiled-src", type=Path, default=None, help="a source root already built (else: built)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    contexts = [c for c in args.contexts.split(",") if c]
    if args.repeats < 1 or any(c not in CONTEXTS for c in contexts):
        parser.error(f"--repeats must be at least 1 and --contexts from {', '.join(CONTEXTS)}")
    with tempfile.TemporaryDirectory(prefix="kvbaton-sim-compiled-") as work:
        build_s = None
        compiled_src = args.compiled_src
        if compiled_src is None:
            compiled_src, build_s = _build(Path(work))
        sides = {"interpreted": SRC, "compiled": compiled_src}
        loaded = {name: _loaded(src) for name, src in sides.items()}
        if loaded["interpreted"] or not loaded["compiled"]:
            raise SystemExit(f"expected the checkout interpreted and the build compiled, got {loaded}")
        report: dict[str, object] = {"trace": str(args.trace), "repeats": args.repeats, "build_s": build_s,
                                     "compiled_modules": len(loaded["compiled"]), "mooncake": {}}
        base = ["-c", SIM, "sim", "--workload", "mooncake", "--trace", str(args.trace), "--cluster", "8xmixed",
                "--policy", "preble", "--json"]
        for context in contexts:
            cpu_s: dict[str, list[float]] = {name: [] for name in sides}
            outputs: dict[str, set[str]] = {name: set() for name in sides}
            num_requests = 0
            for repeat in range(args.repeats):
                for name in (list(sides) if repeat % 2 == 0 else list(sides)[::-1]):
                    result = json.loads(_run(sides[name], base + CONTEXTS[context], 1800))
                    cpu_s[name].append(result.pop("cpu_s"))
                    num_requests = sum(run["overall"]["num_requests"] for run in result["runs"].values())
                    outputs[name].add(json.dumps(result, sort_keys=True))
            entry = {name: _summary(runs, num_requests) for name, runs in cpu_s.items()}
            compiled_fig = entry["compiled"]["cpu_s_per_1000_requests"]
            entry.update(num_requests=num_requests, target=TARGET_MOONCAKE,
                         compiled_over_interpreted=round(compiled_fig / entry["interpreted"]["cpu_s_per_1000_requests"],
                                                         3),
                         compiled_over_target=round(compiled_fig / TARGET_MOONCAKE, 3),
                         identical=len(outputs["compiled"] | outputs["interpreted"]) == 1)
            report["mooncake"][context] = entry  # type: ignore[index]
        if not args.no_sim_speed:
            speed = Path(__file__).resolve().parent / "sim_speed.py"
            runs: dict[str, list[float]] = {name: [] for name in sides}
            for repeat in range(args.repeats):
                for name in (list(sides) if repeat % 2 == 0 else list(sides)[::-1]):
                    result = json.loads(_run(sides[name], [str(speed), "--repeats", "1", "--json"], 1800))
                    runs[name].append(result["runs"][0]["cpu_s_per_1000_requests"])  # 8P8D preble
            entry = {name: {"cpu_s_per_1000_requests": round(statistics.median(r), 3), "cpu_s_per_1000_runs": r}
                     for name, r in runs.items()}
            entry.update(configuration="8P8D preble, tool-use 2,000 requests at 40 req/s", target=TARGET_SIM_SPEED,
                         compiled_over_interpreted=round(entry["compiled"]["cpu_s_per_1000_requests"]
                                                         / entry["interpreted"]["cpu_s_per_1000_requests"], 3))
            report["sim_speed"] = entry
    if args.json:
        print(json.dumps(report))
        return
    for context, entry in report["mooncake"].items():  # type: ignore[attr-defined]
        print(f"mooncake {context} context ({entry['num_requests']} requests): compiled "
              f"{entry['compiled']['cpu_s_per_1000_requests']:.2f} CPU-s per 1,000 "
              f"(runs {entry['compiled']['cpu_s_per_1000_runs']}), interpreted "
              f"{entry['interpreted']['cpu_s_per_1000_requests']:.2f} ({entry['interpreted']['cpu_s_per_1000_runs']}); "
              f"{entry['compiled_over_interpreted']:.2f}x, {entry['compiled_over_target']:.2f}x the target "
              f"{TARGET_MOONCAKE}; identical: {entry['identical']}")
    if "sim_speed" in report:
        entry = report["sim_speed"]
        print(f"sim_speed 8P8D preble: compiled {entry['compiled']['cpu_s_per_1000_requests']:.3f}, interpreted "  # type: ignore[index]
              f"{entry['interpreted']['cpu_s_per_1000_requests']:.3f} CPU-s per 1,000 (target {TARGET_SIM_SPEED})")  # type: ignore[index]


if __name__ == "__main__":
    main()
