"""What a fleet's hardware costs and how a power cap changes a GPU: price table, power and the cap model.

Prices (`DEFAULT_PRICE_SOURCES`) are USD per GPU-hour, on-demand list prices from public price pages:
a100 (80 GB SXM) 2.21, a100-40gb 2.06, h100 (HGX SXM) 4.76, a6000 1.28: CoreWeave's on-demand list
(2023-24), which x 8 match Splitwise's DGX prices ($17.6/h and $38/h per 8-GPU machine, H100 2.16x an
A100); h200 6.31 and l40s 2.25: on-demand list prices of 2024 public GPU clouds, the least certain rows.
Prices change monthly and differ by provider and commitment: pass a file (`load_prices`) to use your own.

Power is the board's TDP (datasheets: A100 SXM 400 W, H100/H200 SXM 700 W, L40S 350 W, RTX A6000 300 W)
times its power cap, the fraction of TDP it is held to (`cap_p=0.7` in a cluster spec). The cap model
(`capped`): an SM clock that falls until the board fits its cap, dynamic power ~ f·V² ~ f³ (voltage
tracks frequency under DVFS), so a compute-bound step's FLOP/s scale as cap^(1/3) (0.89 at 0.7, 0.79 at 0.5).
HBM keeps its own clock: bandwidth holds while the cap stays above what a memory-bound decode draws,
`DECODE_POWER_FRACTION` of TDP, and falls in proportion below it. That fraction, 0.5, is an assumption
read off published measurements: Splitwise (ISCA'24, §III) finds the token phase draws far less than TDP
and power-caps token machines with little loss, and decode on a 700 W H200 draws 137–300 W (Ma et al.,
2026, "The illusion of power capping in LLM decode"). A cap does not change a GPU's price per hour.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from kvbaton.core.errors import InvalidRequestError
from kvbaton.sim.catalog import GPUS, GpuSpec

DECODE_POWER_FRACTION = 0.5  # of TDP, drawn by a memory-bound decode at full bandwidth (module docstring)
DEFAULT_PRICE_SOURCES: dict[str, str] = {
    "a100": "CoreWeave on-demand A100 80GB NVLink, 2023-24 (Splitwise's DGX-A100 $17.6/h / 8)",
    "a100-40gb": "CoreWeave on-demand A100 40GB NVLink, 2023-24",
    "h100": "CoreWeave on-demand H100 HGX, 2023-24 (Splitwise's DGX-H100 $38/h / 8)",
    "h200": "public GPU-cloud on-demand H200 SXM, 2024 (approximate)",
    "l40s": "public GPU-cloud on-demand L40S, 2024 (approximate)",
    "a6000": "CoreWeave on-demand RTX A6000, 2023-24",
}


def check_cap(cap: float) -> float:
    if not (isinstance(cap, (int, float)) and math.isfinite(cap) and 0 < cap <= 1):
        raise InvalidRequestError(f"power cap {cap!r} is outside (0, 1]: it is the fraction of TDP a GPU is held to")
    return float(cap)


def flops_scale(cap: float) -> float:
    """A capped GPU's compute throughput over its uncapped one: cap^(1/3)."""
    return check_cap(cap) ** (1.0 / 3.0)


def bandwidth_scale(cap: float) -> float:
    """A capped GPU's memory bandwidth over its uncapped one: 1 down to `DECODE_POWER_FRACTION`, then linear."""
    return min(1.0, check_cap(cap) / DECODE_POWER_FRACTION)


def capped(gpu: GpuSpec, cap: float) -> GpuSpec:
    """`gpu` held to `cap` of its TDP: compute and bandwidth scaled by the cap model; `gpu` itself when cap is 1."""
    if check_cap(cap) == 1.0:
        return gpu
    return replace(gpu, flops_per_s=gpu.flops_per_s * flops_scale(cap),
                   mem_bytes_per_s=gpu.mem_bytes_per_s * bandwidth_scale(cap), power_cap=cap)


def default_prices() -> dict[str, float]:
    return {name: gpu.price_per_hour for name, gpu in GPUS.items()}


def load_prices(path: str | Path | None) -> dict[str, float]:
    """The default price table, with the GPUs a JSON file names overridden: {"prices_per_gpu_hour": {"h100": 4.0}}
    (a "source" key beside it is allowed and ignored). None: the defaults."""
    prices = default_prices()
    if path is None:
        return prices
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequestError(f"cannot read GPU prices {path}: {exc}") from None
    table = data.get("prices_per_gpu_hour") if isinstance(data, dict) else None
    if not isinstance(table, dict):
        raise InvalidRequestError(f'{path}: expected {{"prices_per_gpu_hour": {{"<gpu>": USD per GPU-hour}}}}')
    for name, price in table.items():
        if name not in GPUS:
            raise InvalidRequestError(f"{path}: unknown GPU {name!r}; choose from {', '.join(GPUS)}")
        if isinstance(price, bool) or not isinstance(price, (int, float)) or not (math.isfinite(price) and price > 0):
            raise InvalidRequestError(f"{path}: price of {name} must be a positive number of USD per GPU-hour, "
                                      f"got {price!r}")
        prices[name] = float(price)
    return prices
