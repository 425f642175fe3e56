"""Cost models behind one `CostModel` interface, and `create_cost_model` to pick one by name or file."""

from __future__ import annotations

from pathlib import Path

from kvbaton.core.errors import InvalidRequestError
from kvbaton.sim.catalog import get_gpu, get_model
from kvbaton.sim.costs.base import BatchShape, ConstantCostModel, CostModel, Parallelism
from kvbaton.sim.costs.linear import DISTSERVE_A100_PATH, LinearCoefficients, LinearCostModel, load_linear_model
from kvbaton.sim.costs.roofline import Efficiency, RooflineCostModel
from kvbaton.sim.hardware import capped, check_cap

__all__ = [
    "BatchShape", "ConstantCostModel", "CostModel", "Efficiency", "LinearCoefficients", "LinearCostModel",
    "Parallelism", "RooflineCostModel", "create_cost_model", "load_linear_model",
]

COST_MODELS = ("roofline", "distserve", "zero", "FILE.json")


def create_cost_model(kind: str, model: str, gpu: str, power_cap: float = 1.0) -> CostModel:
    """`roofline` (catalog GPU x model), `distserve` (published A100 fits), `zero`, or a coefficient JSON file.
    `power_cap` < 1 holds the GPU to that fraction of its TDP (`kvbaton.sim.hardware.capped`): roofline only."""
    if kind == "roofline":
        return RooflineCostModel(get_model(model), capped(get_gpu(gpu), power_cap))
    if check_cap(power_cap) < 1:
        raise InvalidRequestError(f"a power cap needs the roofline cost model, which scales compute and bandwidth; "
                                  f"{kind} prices the GPU as it was measured")
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
