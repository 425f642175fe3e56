"""DistServe's step-time form with coefficients from a JSON file (published ones or `kvbaton profile` fits).

  prefill(l_i, c_i) = a + b·Σl + c·Σl² + d·Σ l·c        (l_i new tokens, c_i context already in KV)
  decode(B, ctx)    = a + b·Σctx + c·B                   (two batch regimes split at `threshold`)
  mixed step        = prefill + decode - min(a_prefill, a_decode)   (one forward pays one fixed cost)
  + overheads       per step: e + f·(context of every sequence in the batch); a prefill step: g·pp more

DistServe fits the first three prefill terms (no cached context: `d` = 0 in its files) and the
decode form per tensor-parallel degree on A100-80GB, in milliseconds; `data/distserve_a100.json`
ships its published OPT-13B and OPT-66B figures as its simulator prices them since its commit
4c68ed9 (prefill x 1.1 folded into the coefficients), with the overheads that simulator adds to
every step (`simdistserve/base/worker.py` `add_ray_overhead`: e = 2 ms, f = 1e-4 ms; and
`estimators/time_estimator.py`: g = 1 ms per pipeline stage of a prefill). Pipeline parallelism
divides a step's compute by `pp`, DistServe's steady-state convention (a stage is free again after
1/pp of the step); the overheads are not divided. A file that names a catalog `gpu` prices that
GPU, and the simulator sizes the KV pool from its memory (`kvbaton.sim.run.kv_blocks_for`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvbaton.core.errors import InvalidRequestError
from kvbaton.sim.costs.base import BatchShape, CostModel, Parallelism

DATA_DIR = Path(__file__).resolve().parent / "data"
DISTSERVE_A100_PATH = DATA_DIR / "distserve_a100.json"


@dataclass(frozen=True, slots=True)
class LinearCoefficients:
    """One (model, GPU, TP degree) fit, in seconds."""

    prefill: tuple[float, float, float, float]  # a, b (per token), c (per token²), d (per new x cached token)
    decode_small: tuple[float, float, float]  # a, b (per context token), c (per sequence), batches < threshold
    decode_large: tuple[float, float, float]  # the same for batches >= threshold
    decode_threshold: int = 1 << 30  # batch size where the large-batch regime starts

    @staticmethod
    def from_json(raw: dict[str, Any], seconds_per_unit: float) -> LinearCoefficients:
        try:
            prefill = [float(x) for x in raw["prefill"]] + [0.0] * (4 - len(raw["prefill"]))
            small = [float(x) for x in raw["decode_small"]]
            large = [float(x) for x in raw.get("decode_large", small)]
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequestError(f"bad cost coefficients ({exc}): need prefill and decode_small lists") from None
        if len(prefill) != 4 or len(small) != 3 or len(large) != 3:
            raise InvalidRequestError("prefill takes 3 or 4 coefficients, decode_small/decode_large 3 each")
        k = seconds_per_unit
        return LinearCoefficients(
            tuple(x * k for x in prefill),  # type: ignore[arg-type]
            tuple(x * k for x in small),  # type: ignore[arg-type]
            tuple(x * k for x in large),  # type: ignore[arg-type]
            int(raw.get("decode_threshold", 1 << 30)),
        )

    def to_json(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


@dataclass(frozen=True, slots=True)
class StepOverhead:
    """Seconds added to every step outside the fitted forward (DistServe's simulator adds these)."""

    per_step: float = 0.0  # e
    per_context_token: float = 0.0  # f, times the context of every sequence in the step
    per_prefill_stage: float = 0.0  # g, times pp, on a step with prefill chunks

    @staticmethod
    def from_json(raw: dict[str, Any], seconds_per_unit: float) -> StepOverhead:
        try:
            return StepOverhead(*(float(raw.get(k, 0.0)) * seconds_per_unit
                                  for k in ("per_step", "per_context_token", "per_prefill_stage")))
        except (AttributeError, TypeError, ValueError) as exc:
            raise InvalidRequestError(f"bad step_overhead ({exc}): per_step, per_context_token, "
                                      "per_prefill_stage numbers") from None

    def __bool__(self) -> bool:
        return bool(self.per_step or self.per_context_token or self.per_prefill_stage)


class LinearCostModel(CostModel):
    """The DistServe form over per-TP coefficient sets (see the module docstring)."""

    def __init__(self, by_tp: dict[int, LinearCoefficients], kv_bytes_per_token: int, name: str = "linear",
                 overhead: StepOverhead = StepOverhead(), gpu_name: str | None = None) -> None:
        if not by_tp:
            raise InvalidRequestError("a linear cost model needs at least one coefficient set")
        self.by_tp = dict(sorted(by_tp.items()))
        self.kv_bytes_per_token = kv_bytes_per_token
        self.name = name
        self.overhead = overhead
        self.gpu_name = gpu_name

    def coefficients(self, tp: int) -> LinearCoefficients:
        found = self.by_tp.get(tp)
        if found is None:
            raise InvalidRequestError(f"{self.name}: no coefficients for tp={tp}; have tp in {sorted(self.by_tp)}")
        return found

    def step_s(self, shape: BatchShape, parallel: Parallelism = Parallelism()) -> float:
        k = self.coefficients(parallel.tp)
        total_s = 0.0
        overheads: list[float] = []
        if shape.prefill_new_tokens:
            a, b, c, d = k.prefill
            total_s += a + sum(b * n + c * n * n + d * n * ctx
                               for n, ctx in zip(shape.prefill_new_tokens, shape.prefill_context_tokens))
            overheads.append(a)
        if shape.num_decodes:
            a, b, c = k.decode_small if shape.num_decodes < k.decode_threshold else k.decode_large
            total_s += a + b * shape.decode_context_tokens + c * shape.num_decodes
            overheads.append(a)
        if len(overheads) == 2:
            total_s -= min(overheads)
        total_s = max(0.0, total_s) / parallel.pp
        extra = self.overhead
        if extra and (shape.prefill_new_tokens or shape.num_decodes):
            context = shape.decode_context_tokens + sum(shape.prefill_new_tokens) + sum(shape.prefill_context_tokens)
            total_s += extra.per_step + extra.per_context_token * context
            if shape.prefill_new_tokens:
                total_s += extra.per_prefill_stage * parallel.pp
        return total_s


def load_linear_model(path: str | Path, model: str | None = None, only_if_absent: bool = False) -> LinearCostModel:
    """Read a coefficient file: {"time_unit": "ms"|"s", "gpu": catalog name (optional), "step_overhead":
    {...StepOverhead...} (optional), "models": {name: {"kv_bytes_per_token": n, "tp": {"1":
    {...LinearCoefficients...}}}}}. `model` picks an entry (None: the only one; with `only_if_absent`, a
    model the file lacks also takes its only one, as a profile of another name prices the run)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidRequestError(f"cannot read cost coefficients {path}: {exc}") from None
    unit = {"s": 1.0, "ms": 1e-3}.get(data.get("time_unit", "s"))
    if unit is None:
        raise InvalidRequestError(f"{path}: time_unit must be 's' or 'ms'")
    models = data.get("models", {})
    if model is None or (only_if_absent and model not in models and len(models) == 1):
        if len(models) != 1:
            raise InvalidRequestError(f"{path} holds {sorted(models)}; pick one with --model")
        model = next(iter(models))
    entry = models.get(model)
    if entry is None:
        raise InvalidRequestError(f"{path} has no coefficients for {model!r}; it has {sorted(models)}")
    by_tp = {int(tp): LinearCoefficients.from_json(raw, unit) for tp, raw in entry["tp"].items()}
    gpu = data.get("gpu")
    if gpu is not None and not isinstance(gpu, str):
        raise InvalidRequestError(f"{path}: gpu must be a catalog GPU name, got {gpu!r}")
    fitted = LinearCostModel(by_tp, int(entry.get("kv_bytes_per_token", 0)), name=f"{Path(path).stem}:{model}",
                             overhead=StepOverhead.from_json(data.get("step_overhead", {}), unit), gpu_name=gpu)
    fitted.model_name = model
    fitted.step_noise_sigma = float(data.get("step_noise_sigma", 0.0))
    fitted.step_noise_rho = float(data.get("step_noise_rho", 0.0))
    return fitted


def save_linear_model(path: str | Path, model: str, coefficients: LinearCoefficients, kv_bytes_per_token: int,
                      source: str) -> None:
    """Write one fit (tp=1, seconds) in the format `load_linear_model` reads."""
    payload = {"source": source, "time_unit": "s",
               "models": {model: {"kv_bytes_per_token": kv_bytes_per_token, "tp": {"1": coefficients.to_json()}}}}
    Path(path).write_text(json.dumps(payload, indent=2) + "\n")
