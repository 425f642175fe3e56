"""Cost models behind one `CostModel` interface, and `create_cost_model` to pick one by name or file."""

from __future__ import annotations

from pathlib import Path

from kvbaton.core.errors import InvalidRequestError
from kvbaton.sim.catalog import get_gpu, get_model
from kvbaton.sim.costs.base import BatchShape, ConstantCostModel, CostModel, Parallelism
from kvbaton.sim.costs.linear import DISTSERVE_A100_PATH, LinearCoefficients, LinearCostModel, load_linear_model
from kvbaton.sim.costs.roofline import Efficiency, RooflineCostModel

__all__ = [
    "BatchShape", "ConstantCostModel", "CostModel", "Efficiency", "LinearCoefficients", "LinearCostModel",
    "Parallelism", "RooflineCostModel", "create_cost_model", "load_linear_model",
]

COST_MODELS = ("roofline", "distserve", "zero", "FILE.json")


def create_cost_model(kind: str, model: str, gpu: str) -> CostModel:
    """`roofline` (catalog GPU x model), `distserve` (published A100 fits), `zero`, or a coefficient JSON file."""
    if kind == "roofline":
        return RooflineCostModel(get_model(model), get_gpu(gpu))
    if kind == "distserve":
        if gpu != "a100":
            raise InvalidRequestError(f"DistServe's published coefficients are for a100, not {gpu}")
        return load_linear_model(DISTSERVE_A100_PATH, model)
    if kind == "zero":
        return ConstantCostModel(0.0)
    if kind.endswith(".json"):
        if not Path(kind).is_file():
            raise InvalidRequestError(f"cost coefficient file not found: {kind}")
        return load_linear_model(kind, model, only_if_absent=True)
    raise InvalidRequestError(f"unknown cost model {kind!r}; choose one of {', '.join(COST_MODELS)}")
