"""DistServe's step-time form with coefficients from a JSON file (published ones or `kvbaton profile` fits).

  prefill(l_i, c_i) = a + b·Σl + c·Σl² + d·Σ l·c        (l_i new tokens, c_i context already in KV)
  decode(B, ctx)    = a + b·Σctx + c·B                   (two batch regimes split at `threshold`)
  mixed step        = prefill + decode - min(a_prefill, a_decode)   (one forward pays one fixed cost)

DistServe fits the first three prefill terms (no cached context: `d` = 0 in its files) and the
decode form per tensor-parallel degree on A100-80GB, in milliseconds; `data/distserve_a100.json`
ships its published OPT-13B and OPT-66B figures. Pipeline parallelism divides a step by `pp`,
DistServe's steady-state convention (a stage is free again after 1/pp of the step).
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


class LinearCostModel(CostModel):
    """The DistServe form over per-TP coefficient sets (see the module docstring)."""

    def __init__(self, by_tp: dict[int, LinearCoefficients], kv_bytes_per_token: int, name: str = "linear") -> None:
        if not by_tp:
            raise InvalidRequestError("a linear cost model needs at least one coefficient set")
        self.by_tp = dict(sorted(by_tp.items()))
        self.kv_bytes_per_token = kv_bytes_per_token
        self.name = name

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
        return max(0.0, total_s) / parallel.pp


def load_linear_model(path: str | Path, model: str | None = None) -> LinearCostModel:
    """Read a coefficient file: {"time_unit": "ms"|"s", "models": {name: {"kv_bytes_per_token": n,
    "tp": {"1": {...LinearCoefficients...}}}}}. `model` picks an entry (None: the only one)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidRequestError(f"cannot read cost coefficients {path}: {exc}") from None
    unit = {"s": 1.0, "ms": 1e-3}.get(data.get("time_unit", "s"))
    if unit is None:
        raise InvalidRequestError(f"{path}: time_unit must be 's' or 'ms'")
    models = data.get("models", {})
    if model is None:
        if len(models) != 1:
            raise InvalidRequestError(f"{path} holds {sorted(models)}; pick one with --model")
        model = next(iter(models))
    entry = models.get(model)
    if entry is None:
        raise InvalidRequestError(f"{path} has no coefficients for {model!r}; it has {sorted(models)}")
    by_tp = {int(tp): LinearCoefficients.from_json(raw, unit) for tp, raw in entry["tp"].items()}
    fitted = LinearCostModel(by_tp, int(entry.get("kv_bytes_per_token", 0)), name=f"{Path(path).stem}:{model}")
    fitted.step_noise_sigma = float(data.get("step_noise_sigma", 0.0))
    fitted.step_noise_rho = float(data.get("step_noise_rho", 0.0))
    return fitted


def save_linear_model(path: str | Path, model: str, coefficients: LinearCoefficients, kv_bytes_per_token: int,
                      source: str) -> None:
    """Write one fit (tp=1, seconds) in the format `load_linear_model` reads."""
    payload = {"source": source, "time_unit": "s",
               "models": {model: {"kv_bytes_per_token": kv_bytes_per_token, "tp": {"1": coefficients.to_json()}}}}
    Path(path).write_text(json.dumps(payload, indent=2) + "\n")
