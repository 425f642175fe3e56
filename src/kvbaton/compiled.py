"""The policy core compiled to C with mypyc, from the same sources: an optional build, for the simulator's speed.

The modules every simulated (and live) step runs through, the scheduler, the radix cache and block pool, the
router's prefix index and placement, the simulator's event loop and workers, are plain Python; mypyc, which
compiles type-annotated Python (mypy itself ships so), turns them into C extensions beside their sources. Nothing
forks: the compiled modules are these files, type-checked, so the live engine and the simulator still drive the
same objects, and every `kvbaton sim --json` is byte-identical compiled or not (`test_compiled_core`).

- `python src/kvbaton/compiled.py build [SRC]` (`make compiled`) compiles `MODULES` in place under SRC (the checkout's
  `src/` by default), next to each `.py`, which the import system then loads instead, and writes a manifest of
  the sources' hashes. It needs mypy (the `compile` extra) and a C compiler.
- `python src/kvbaton/compiled.py clean [SRC]` (`make uncompiled`) removes them; `status` says whether a build is there.
- Importing kvbaton with a manifest whose sources have changed since the build raises ImportError, naming the
  stale modules, rather than run code that no longer matches its source. (So the commands above run this file as
  a script, which imports nothing of kvbaton.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

# The simulator's hot path (a sampling profile of the Mooncake trace at full context), as paths under src/.
MODULES = (
    "kvbaton/cache/block_pool.py",
    "kvbaton/cache/hashing.py",
    "kvbaton/cache/radix_cache.py",
    "kvbaton/cache/radix_lru.py",
    "kvbaton/cache/radix_node.py",
    "kvbaton/core/request.py",
    "kvbaton/router/block_map.py",
    "kvbaton/router/placement.py",
    "kvbaton/router/preble.py",
    "kvbaton/router/prefix_index.py",
    "kvbaton/router/prefix_tree.py",
    "kvbaton/router/state.py",
    "kvbaton/scheduler/block_manager.py",
    "kvbaton/scheduler/local_scheduler.py",
    "kvbaton/scheduler/request_queues.py",
    "kvbaton/scheduler/step_planning.py",
    "kvbaton/sim/cluster.py",
    "kvbaton/sim/costs/roofline.py",
    "kvbaton/sim/prompts.py",
    "kvbaton/sim/worker.py",
)
GROUP = "kvbaton_core"  # mypyc's shared library for the group: GROUP__mypyc.<abi>.so at the top of SRC
MANIFEST = "compiled_manifest.json"  # under SRC/kvbaton: module path -> sha256 of the source compiled

_SRC = Path(__file__).resolve().parent.parent


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _module_name(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def check_fresh(src: Path = _SRC) -> None:
    """Raise ImportError if a build's manifest names sources changed since (their compiled modules are stale)."""
    manifest = src / "kvbaton" / MANIFEST
    if not manifest.exists():
        return
    built = json.loads(manifest.read_text())
    stale = [path for path, digest in built.items() if not (src / path).exists() or _digest(src / path) != digest]
    if stale:
        raise ImportError(f"kvbaton's compiled modules are stale (their sources changed since the build): "
                          f"{', '.join(map(_module_name, stale))}; rebuild them (`make compiled`) or remove them "
                          f"(`make uncompiled`)")


def loaded() -> list[str]:
    """The names of MODULES that are imported now and came from a compiled extension."""
    names = (_module_name(path) for path in MODULES)
    return [name for name in names
            if name in sys.modules and str(getattr(sys.modules[name], "__file__", "")).endswith((".so", ".pyd"))]


def _artifacts(src: Path) -> list[Path]:
    suffixes = (".so", ".pyd")
    found = [path for path in src.glob(f"{GROUP}__mypyc*") if path.suffix in suffixes]
    for module in MODULES:
        stem = src / module.removesuffix(".py")
        found += [path for path in stem.parent.glob(stem.name + ".*") if path.suffix in suffixes]
    manifest = src / "kvbaton" / MANIFEST
    return found + ([manifest] if manifest.exists() else [])


def copy_sources(dest: Path, src: Path = _SRC) -> Path:
    """A copy of `src`'s kvbaton package under `dest` without any build (extensions, manifest, bytecode): a source
    root to build in apart from the checkout (the compiled-core test and benchmark). Returns it."""
    shutil.copytree(src / "kvbaton", dest / "kvbaton",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd", MANIFEST))
    return dest


def clean(src: Path = _SRC) -> list[Path]:
    """Remove a build's extensions and manifest under `src`; returns what was removed."""
    removed = _artifacts(src)
    for path in removed:
        path.unlink()
    return removed


def build(src: Path = _SRC, jobs: int | None = None) -> list[Path]:
    """Compile MODULES in place under `src` (mypyc, then the C compiler) and write the manifest; returns the
    extensions built. A failed build removes whatever it had put in place: no extension is left without a manifest
    (which would load unchecked)."""
    from mypyc.build import mypycify  # the `compile` extra: imported here, as only a build needs it
    from setuptools import Distribution

    src = src.resolve()
    clean(src)
    digests = {path: _digest(src / path) for path in MODULES}
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="kvbaton-mypyc-") as work:
        os.chdir(src)  # mypyc names modules by their paths relative to the working directory
        try:
            # mypy checks the modules compiled and reads kvbaton's other modules for their types only; installed
            # packages are not read at all (what the modules name of numpy or torch is Any to it): analysing torch's
            # sources took the build 4.5 minutes instead of half of one, for the same compiled code
            options = ["--follow-imports=silent", "--ignore-missing-imports", "--no-site-packages"]
            extensions = mypycify([*options, *MODULES], opt_level="3", group_name=GROUP, multi_file=True,
                                  target_dir=os.path.join(work, "c"))
            dist = Distribution({"name": GROUP, "ext_modules": extensions})
            command = dist.get_command_obj("build_ext")
            command.inplace = True
            command.build_temp = os.path.join(work, "temp")
            command.build_lib = os.path.join(work, "lib")
            command.parallel = jobs or os.cpu_count() or 1
            dist.run_command("build_ext")
        except BaseException:
            clean(src)
            raise
        finally:
            os.chdir(cwd)
    built = [path for path in _artifacts(src) if path.name != MANIFEST]
    (src / "kvbaton" / MANIFEST).write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")
    return built


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python src/kvbaton/compiled.py", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("build", "clean", "status"))
    parser.add_argument("src", nargs="?", type=Path, default=_SRC, help="the source root holding kvbaton/")
    parser.add_argument("--jobs", type=int, default=None, help="parallel C compiles (default: every core)")
    args = parser.parse_args(argv)
    if args.action == "build":
        built = build(args.src, args.jobs)
        print(f"compiled {len(MODULES)} modules into {len(built)} extensions under {args.src}")
    elif args.action == "clean":
        removed = clean(args.src)
        print(f"removed {len(removed)} files under {args.src}")
    else:
        manifest = args.src / "kvbaton" / MANIFEST
        print(json.dumps({"built": manifest.exists(), "modules": list(MODULES)}))


if __name__ == "__main__":
    main()
