"""A `kvbaton plan --json` answer as the worker pools `kvbaton serve --placement FILE` launches on one machine.

The plan's `best` (or `best_disaggregated` / `best_colocated`) is a deployment unit: a prefill pool and a decode
pool, or a colocated pool, each `replicas` workers of tensor degree `tp` and pipeline degree `pp`; with a target
rate it also says how many `units` it takes. `serve_layout` turns that into worker counts per role (`replicas` x
`units`), and refuses, with the reason, what the running code cannot launch:

- a worker of tp or pp above a cap the caller sets (`max_tp`, `max_pp`; none by default: a live worker runs its
  degrees as rank processes, and `kvbaton serve` checks them against the model it serves);
- more processes (workers x tp x pp ranks) than the machine can hold (`max_workers`: one per core on the CPU, say);
- a file that is not a plan (no such key, a malformed pool).

`serve_command` prints the equivalent `kvbaton serve` flags, which `kvbaton plan` shows under its answer.
Pure Python: the planner and the CLI both import it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbaton.core.errors import InvalidRequestError

PICKS = ("best", "best_disaggregated", "best_colocated")
SERVABLE_BY_NAME = ("smollm2-135m",)  # catalog models whose weights kvbaton loads by name (model/registry.py)


@dataclass(frozen=True, slots=True)
class PoolLayout:
    """One role's workers: how many, and each one's parallel degrees."""

    num_workers: int
    tp: int = 1
    pp: int = 1


@dataclass(frozen=True, slots=True)
class ServeLayout:
    """The pools of one launch: mixed workers, or prefill + decode workers."""

    planned_model: str  # the catalog model the plan priced ("" when the file does not say)
    planned_gpu: str
    mixed: PoolLayout | None = None
    prefill: PoolLayout | None = None
    decode: PoolLayout | None = None

    @property
    def num_workers(self) -> int:
        return sum(pool.num_workers for pool in (self.mixed, self.prefill, self.decode) if pool is not None)

    @property
    def num_processes(self) -> int:
        """Rank processes in all: a worker of degrees tp x pp runs that many."""
        return sum(pool.num_workers * pool.tp * pool.pp for pool in (self.mixed, self.prefill, self.decode)
                   if pool is not None)

    def serve_flags(self) -> list[str]:
        if self.mixed is not None:
            pool = self.mixed
            return ["--workers", str(pool.num_workers),
                    *(["--tensor-parallel-size", str(pool.tp)] if pool.tp > 1 else []),
                    *(["--pipeline-parallel-size", str(pool.pp)] if pool.pp > 1 else [])]
        assert self.prefill is not None and self.decode is not None
        flags = ["--prefill", str(self.prefill.num_workers), "--decode", str(self.decode.num_workers)]
        for role, pool in (("prefill", self.prefill), ("decode", self.decode)):
            flags += [f"--{role}-tp", str(pool.tp)] if pool.tp > 1 else []
            flags += [f"--{role}-pp", str(pool.pp)] if pool.pp > 1 else []
        return flags


def _pool(unit: dict[str, Any], role: str, units: int, where: str) -> PoolLayout:
    pool = unit.get(role)
    if not isinstance(pool, dict):
        raise InvalidRequestError(f"{where}: the {role} pool is missing or not an object")
    values: dict[str, int] = {}
    for key in ("tp", "pp", "replicas"):
        value = pool.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidRequestError(f"{where}: {role}.{key} must be a positive integer, got {value!r}")
        values[key] = value
    return PoolLayout(values["replicas"] * units, values["tp"], values["pp"])


def serve_layout(plan: Any, pick: str = "best", *, max_tp: int | None = None, max_pp: int | None = None,
                 max_workers: int | None = None) -> ServeLayout:
    """The pools of `plan` (a parsed `kvbaton plan --json` object) at `pick`; InvalidRequestError for one the
    running code or this machine cannot launch, naming what is missing."""
    if pick not in PICKS:
        raise InvalidRequestError(f"placement pick must be one of {', '.join(PICKS)}, got {pick!r}")
    if not isinstance(plan, dict) or "best" not in plan:
        raise InvalidRequestError("not a `kvbaton plan --json` answer (no \"best\" placement)")
    unit = plan.get(pick)
    if not isinstance(unit, dict):
        raise InvalidRequestError(f"the plan has no {pick} placement")
    settings = plan.get("settings") if isinstance(plan.get("settings"), dict) else {}
    units = unit.get("units", 1) if pick == "best" else 1
    if isinstance(units, bool) or not isinstance(units, int) or units < 1:
        raise InvalidRequestError(f"{pick}.units must be a positive integer, got {units!r}")
    model, gpu = str(settings.get("model", "")), str(settings.get("gpu", ""))
    if "colocated" in unit:
        layout = ServeLayout(model, gpu, mixed=_pool(unit, "colocated", units, pick))
    else:
        layout = ServeLayout(model, gpu, prefill=_pool(unit, "prefill", units, pick),
                             decode=_pool(unit, "decode", units, pick))
    for role, pool in (("colocated", layout.mixed), ("prefill", layout.prefill), ("decode", layout.decode)):
        if pool is None:
            continue
        if max_tp is not None and pool.tp > max_tp:
            raise InvalidRequestError(f"the plan's {role} workers are tensor parallel (tp {pool.tp}); here a worker "
                                      f"runs tp <= {max_tp}")
        if max_pp is not None and pool.pp > max_pp:
            raise InvalidRequestError(f"the plan's {role} workers are pipeline parallel (pp {pool.pp}); here a worker "
                                      f"runs pp <= {max_pp}")
    if max_workers is not None and layout.num_processes > max_workers:
        raise InvalidRequestError(f"the plan's {pick} takes {layout.num_workers} workers of {layout.num_processes} "
                                  f"rank processes in all; this machine holds at most {max_workers}")
    return layout


def read_serve_layout(path: str, pick: str = "best", **limits: Any) -> ServeLayout:
    """`serve_layout` of the plan JSON in file `path`."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InvalidRequestError(f"--placement: cannot read {path}: {exc.strerror}") from None
    try:
        plan = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"--placement: {path} is not JSON ({exc.msg} at line {exc.lineno})") from None
    return serve_layout(plan, pick, **limits)


def serve_command(plan: Any, pick: str = "best") -> str:
    """The `kvbaton serve` command line that launches `plan`'s `pick` here, or why it cannot."""
    try:
        layout = serve_layout(plan, pick)
    except InvalidRequestError as exc:
        return f"not launchable live: {exc}"
    model = layout.planned_model if layout.planned_model in SERVABLE_BY_NAME else "PATH (the model's .gguf or HF dir)"
    return " ".join(["kvbaton serve --model", model, *layout.serve_flags(), "(or: kvbaton serve --placement PLAN.json)"])
