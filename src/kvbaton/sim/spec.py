"""Cluster specs: `4xmixed`, `2P2D`, `2P2D:tp_p=2,link=nvlink`, `2P3D:gpu_p=h100,gpu_d=a100,cap_d=0.7` -> workers.

Grammar: `<N>xmixed`, `<P>P<D>D` or both (`<N>xmixed+<P>P<D>D`), then optionally `:` and comma-separated options:
`tp`/`pp` (every worker), `tp_p`/`pp_p` (prefill pool), `tp_d`/`pp_d` (decode pool), `gpu`/`gpu_p`/`gpu_d`
(catalog GPU of every worker / of a pool; unnamed: the run's `--gpu`), `cap`/`cap_p`/`cap_d` (power cap, the
fraction of TDP in (0, 1] a pool's GPUs are held to: `kvbaton.sim.hardware`), and `link=<preset>` for
prefill->decode KV transfers (default infiniband). Pools of different GPUs sit in different machines: their KV
takes the link between those, never NVLink. Each option at most once; a mixed cluster takes only `tp`, `pp`,
`gpu` and `cap`. Worker ids: `w<i>` mixed, `p<i>` prefill, `d<i>` decode.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvbaton.core.errors import InvalidRequestError
from kvbaton.sim.catalog import get_gpu
from kvbaton.sim.costs.base import Parallelism
from kvbaton.sim.hardware import check_cap
from kvbaton.sim.links import get_link

ROLES = ("mixed", "prefill", "decode")
_MIXED = re.compile(r"^(\d+)x(mixed)$")
_DISAGG = re.compile(r"^(\d+)P(\d+)D$", re.IGNORECASE)
_COMBINED = re.compile(r"^(\d+)xmixed\+(\d+)P(\d+)D$", re.IGNORECASE)  # both kinds of pool, as `kvbaton serve` runs
_INT_OPTIONS = ("tp", "pp", "tp_p", "pp_p", "tp_d", "pp_d")
_GPU_OPTIONS = ("gpu", "gpu_p", "gpu_d")
_CAP_OPTIONS = ("cap", "cap_p", "cap_d")
_OPTIONS = (*_INT_OPTIONS, *_GPU_OPTIONS, *_CAP_OPTIONS, "link")
_NVLINKS = ("nvlink", "nvlink-a100")  # one baseboard's GPUs of one kind: never between pools of different GPUs


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    worker_id: str
    role: str  # mixed | prefill | decode
    parallel: Parallelism
    gpu: str = ""  # catalog GPU name; "": the one the cost model prices
    power_cap: float = 1.0  # fraction of the GPU's TDP it is held to


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    text: str  # as given
    workers: tuple[WorkerSpec, ...]
    link: str = "infiniband"  # prefill -> decode KV link preset

    @property
    def disaggregated(self) -> bool:
        return any(w.role != "mixed" for w in self.workers)

    @property
    def num_gpus(self) -> int:
        return sum(w.parallel.num_gpus for w in self.workers)

    def of_role(self, role: str) -> list[WorkerSpec]:
        return [w for w in self.workers if w.role == role]

    @property
    def hardware(self) -> tuple[tuple[str, float], ...]:
        """The distinct (GPU, power cap) pairs of its workers, in worker order."""
        return tuple(dict.fromkeys((w.gpu, w.power_cap) for w in self.workers))

    def price_per_hour(self, prices: dict[str, float]) -> float:
        """USD per hour of all its GPUs at `prices` (per GPU-hour, `kvbaton.sim.hardware.load_prices`); every pool
        must name its GPU (parse with a default GPU)."""
        unpriced = [w for w in self.workers if w.gpu not in prices]
        if unpriced:
            raise InvalidRequestError(f"cluster spec {self.text!r}: no price for worker {unpriced[0].worker_id}'s GPU "
                                      f"{unpriced[0].gpu!r}")
        return sum(w.parallel.num_gpus * prices[w.gpu] for w in self.workers)

    @property
    def power_kw(self) -> float:
        """Power provisioned for all its GPUs: TDP under each pool's cap, in kW."""
        return sum(w.parallel.num_gpus * get_gpu(w.gpu).tdp_w * w.power_cap for w in self.workers) / 1e3


def parse_cluster_spec(text: str, default_gpu: str = "") -> ClusterSpec:
    """The workers of `text`; a pool that names no GPU gets `default_gpu` ("" with no pool naming one: the cost
    model's own)."""
    shape, _, option_text = text.strip().partition(":")
    options: dict[str, str] = {}
    for item in filter(None, option_text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in _OPTIONS:
            raise InvalidRequestError(f"cluster option {item!r}: expected one of {', '.join(_OPTIONS)}=VALUE")
        if key in options:
            raise InvalidRequestError(f"cluster spec {text!r}: option {key} given twice")
        options[key] = value
    ints: dict[str, int] = {}
    for key in _INT_OPTIONS:
        if key in options:
            try:
                ints[key] = int(options[key])
            except ValueError:
                raise InvalidRequestError(f"cluster option {key} needs an integer, got {options[key]!r}") from None
    caps: dict[str, float] = {}
    for key in _CAP_OPTIONS:
        if key in options:
            try:
                value = float(options[key])
            except ValueError:
                raise InvalidRequestError(f"cluster option {key} needs a number in (0, 1], "
                                          f"got {options[key]!r}") from None
            caps[key] = check_cap(value)
    for key in _GPU_OPTIONS:
        if key in options:
            if not options[key]:
                raise InvalidRequestError(f"cluster spec {text!r}: option {key} names no GPU")
            get_gpu(options[key])
    link = options.get("link", "infiniband")
    get_link(link)
    combined = _COMBINED.match(shape)
    mixed, disagg = _MIXED.match(shape), _DISAGG.match(shape)
    if mixed:
        pooled = sorted(set(options) - {"tp", "pp", "gpu", "cap"})
        if pooled:  # a mixed cluster has no prefill or decode pool, nor transfers between them
            raise InvalidRequestError(f"cluster spec {text!r}: {', '.join(pooled)} applies to a <P>P<D>D cluster only")
        counts = {"mixed": int(mixed.group(1))}
    elif disagg:
        counts = {"prefill": int(disagg.group(1)), "decode": int(disagg.group(2))}
    elif combined:
        counts = {"mixed": int(combined.group(1)), "prefill": int(combined.group(2)), "decode": int(combined.group(3))}
    else:
        raise InvalidRequestError(f"cluster spec {text!r}: expected like 4xmixed, 2P2D, 2xmixed+1P1D or 2P2D:tp_p=2")
    if any(n <= 0 for n in counts.values()):
        raise InvalidRequestError(f"cluster spec {text!r}: every pool needs at least one worker")
    workers: list[WorkerSpec] = []
    gpus: dict[str, str] = {}
    for role, count in counts.items():
        suffix = {"mixed": "", "prefill": "_p", "decode": "_d"}[role]
        parallel = Parallelism(tp=ints.get(f"tp{suffix}", ints.get("tp", 1)),
                               pp=ints.get(f"pp{suffix}", ints.get("pp", 1)))
        gpus[role] = options.get(f"gpu{suffix}", options.get("gpu", default_gpu))
        cap = caps.get(f"cap{suffix}", caps.get("cap", 1.0))
        prefix = {"mixed": "w", "prefill": "p", "decode": "d"}[role]
        workers += [WorkerSpec(f"{prefix}{i}", role, parallel, gpus[role], cap) for i in range(count)]
    unnamed = [role for role, gpu in gpus.items() if not gpu]
    if unnamed and len(unnamed) < len(gpus):
        raise InvalidRequestError(f"cluster spec {text!r}: the {unnamed[0]} pool has no GPU; name it "
                                  f"(gpu{'_' + unnamed[0][0] if unnamed[0] != 'mixed' else ''}=...) or give a default")
    if "prefill" in gpus and gpus["prefill"] != gpus["decode"] and link in _NVLINKS:
        raise InvalidRequestError(f"cluster spec {text!r}: {gpus['prefill']} prefill and {gpus['decode']} decode "
                                  f"GPUs share no {link}; their KV takes the link between machines (e.g. infiniband)")
    return ClusterSpec(text, tuple(workers), link)
