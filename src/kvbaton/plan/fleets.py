"""The fleets the hardware search (`kvbaton plan --gpus`) weighs: pool sizes, GPU types and power caps per phase.

A `Fleet` is a whole deployment, not a replicated unit: a colocated pool of one GPU type, or a prefill pool
and a decode pool each of its own GPU type, tensor degree and size (Splitwise's H100 prompt machines and
A100 token machines), decode pools possibly power-capped. Pools of a disaggregated fleet sit in different
machines, so KV crosses `INTER_NODE_LINK` whatever the GPUs. `enumerate_fleets` lists, for every choice of
hardware per phase, the fleets the budget (USD per hour, kW, or both) holds that cannot take one more worker
of either pool: a fleet with room for another worker is never the best, since a worker more never lowers
the goodput a router can reach. Prices come from `kvbaton.sim.hardware.load_prices`, power from the GPUs' TDP
under their caps; both are the cluster spec's own figures (`ClusterSpec.price_per_hour`, `power_kw`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvbaton.core.errors import InvalidRequestError
from kvbaton.plan.placements import INTER_NODE_LINK, fits_memory, possible_tps
from kvbaton.sim.catalog import ModelSpec, get_gpu
from kvbaton.sim.costs import BatchShape, CostModel, Parallelism
from kvbaton.sim.hardware import check_cap
from kvbaton.sim.spec import parse_cluster_spec


@dataclass(frozen=True, slots=True)
class PoolHardware:
    """`replicas` workers of `tp` `gpu`s each, held to `cap` of their TDP."""

    gpu: str
    tp: int
    replicas: int = 1
    cap: float = 1.0

    @property
    def num_gpus(self) -> int:
        return self.tp * self.replicas

    @property
    def label(self) -> str:
        return f"{self.replicas} x {self.gpu} tp{self.tp}" + (f" cap {self.cap:g}" if self.cap < 1 else "")

    def to_json(self) -> dict[str, object]:
        return {"gpu": self.gpu, "tp": self.tp, "replicas": self.replicas, "cap": self.cap}


@dataclass(frozen=True, slots=True)
class Fleet:
    """A colocated pool, or a prefill and a decode pool."""

    prefill: PoolHardware | None = None
    decode: PoolHardware | None = None
    colocated: PoolHardware | None = None

    def __post_init__(self) -> None:
        if (self.colocated is None) == (self.prefill is None or self.decode is None):
            raise InvalidRequestError("a fleet has either both prefill and decode pools or a colocated one")

    @property
    def pools(self) -> tuple[PoolHardware, ...]:
        if self.colocated is not None:
            return (self.colocated,)
        assert self.prefill is not None and self.decode is not None
        return self.prefill, self.decode

    @property
    def disaggregated(self) -> bool:
        return self.colocated is None

    @property
    def homogeneous(self) -> bool:
        """One GPU type, uncapped: a fleet one could buy without Splitwise's idea."""
        return len({p.gpu for p in self.pools}) == 1 and all(p.cap == 1.0 for p in self.pools)

    @property
    def num_gpus(self) -> int:
        return sum(p.num_gpus for p in self.pools)

    @property
    def cluster_spec(self) -> str:
        """The `kvbaton sim --cluster` text that simulates it."""
        if self.colocated is not None:
            c = self.colocated
            return f"{c.replicas}xmixed:tp={c.tp},gpu={c.gpu}" + (f",cap={c.cap:g}" if c.cap < 1 else "")
        p, d = self.prefill, self.decode
        assert p is not None and d is not None
        caps = "".join(f",cap_{role}={pool.cap:g}" for role, pool in (("p", p), ("d", d)) if pool.cap < 1)
        return (f"{p.replicas}P{d.replicas}D:tp_p={p.tp},tp_d={d.tp},gpu_p={p.gpu},gpu_d={d.gpu}{caps},"
                f"link={INTER_NODE_LINK}")

    @property
    def label(self) -> str:
        if self.colocated is not None:
            return f"colocated {self.colocated.label}"
        assert self.prefill is not None and self.decode is not None
        return f"P {self.prefill.label} + D {self.decode.label}"

    def price_per_hour(self, prices: Mapping[str, float]) -> float:
        return parse_cluster_spec(self.cluster_spec).price_per_hour(dict(prices))

    @property
    def power_kw(self) -> float:
        return parse_cluster_spec(self.cluster_spec).power_kw

    def to_json(self) -> dict[str, object]:
        if self.colocated is not None:
            return {"colocated": self.colocated.to_json()}
        assert self.prefill is not None and self.decode is not None
        return {"prefill": self.prefill.to_json(), "decode": self.decode.to_json()}


@dataclass(frozen=True, slots=True)
class Budget:
    per_hour: float | None = None  # USD per hour for every GPU of the fleet
    power_kw: float | None = None  # kW provisioned for them (TDP under the caps)

    def __post_init__(self) -> None:
        if self.per_hour is None and self.power_kw is None:
            raise InvalidRequestError("the hardware search needs a budget: --budget-per-hour and/or --power-budget-kw")
        for name, value in (("--budget-per-hour", self.per_hour), ("--power-budget-kw", self.power_kw)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise InvalidRequestError(f"{name} must be a positive finite number, got {value}")

    def holds(self, price_per_hour: float, power_kw: float) -> bool:
        # A relative slack of 1e-9: a budget set to a fleet's exact price holds it despite float sums.
        return ((self.per_hour is None or price_per_hour <= self.per_hour * (1 + 1e-9))
                and (self.power_kw is None or power_kw <= self.power_kw * (1 + 1e-9)))


def pool_choices(model: ModelSpec, cost_model_of: Mapping[str, CostModel], gpus: Sequence[str],
                 caps: Sequence[float], max_tp: int, max_model_len: int) -> list[tuple[str, int, float]]:
    """(GPU, tp, cap) choices of one pool: every tp up to `max_tp` the model splits by and fits in, per GPU."""
    for cap in caps:
        check_cap(cap)
    choices = []
    for gpu in gpus:
        spec = get_gpu(gpu)
        for tp in possible_tps(model, cost_model_of[gpu], max_tp):
            if fits_memory(model, spec, tp, max_model_len):
                choices += [(gpu, tp, cap) for cap in caps]
    return choices


def enumerate_fleets(model: ModelSpec, cost_model_of: Mapping[str, CostModel], gpus: Sequence[str],
                     decode_caps: Sequence[float], budget: Budget, prices: Mapping[str, float], max_tp: int,
                     max_model_len: int) -> list[Fleet]:
    """Every fleet the budget holds that has no room for one more worker of either pool: colocated pools of each
    (GPU, tp), then prefill x decode pools (decode pools under each of `decode_caps`), in that order."""
    if not gpus:
        raise InvalidRequestError("--gpus names no GPU")
    plain = pool_choices(model, cost_model_of, gpus, (1.0,), max_tp, max_model_len)
    capped = pool_choices(model, cost_model_of, gpus, decode_caps, max_tp, max_model_len)

    def cost(pool: tuple[str, int, float], replicas: int) -> tuple[float, float]:
        gpu, tp, cap = pool
        return replicas * tp * prices[gpu], replicas * tp * get_gpu(gpu).tdp_w * cap / 1e3

    def most(pool: tuple[str, int, float], spent: tuple[float, float]) -> int:
        """The most workers of `pool` the budget holds beside `spent`."""
        n = 0
        while budget.holds(*(a + b for a, b in zip(spent, cost(pool, n + 1)))):
            n += 1
        return n

    fleets: list[Fleet] = []
    for pool in plain:
        n = most(pool, (0.0, 0.0))
        if n:
            fleets.append(Fleet(colocated=PoolHardware(pool[0], pool[1], n)))
    for p in plain:
        for d in capped:
            for n_p in range(1, most(p, (0.0, 0.0)) + 1):
                n_d = most(d, cost(p, n_p))
                if n_d == 0:
                    break
                if most(p, cost(d, n_d)) > n_p:  # room for one more prefill worker beside these decode workers
                    continue
                fleets.append(Fleet(PoolHardware(p[0], p[1], n_p, p[2]), PoolHardware(d[0], d[1], n_d, d[2])))
    return fleets


def fleet_bound_rps(fleet: Fleet, cost_model_of: Mapping[tuple[str, float], CostModel], prompt_tokens: float,
                    output_tokens: float, ttft_slo_s: float, batch: int = 64) -> float:
    """A rough fleet rate (req/s) that only orders the searches: each prefill worker an M/D/1 queue within the
    TTFT SLO, each decode worker a batch of `batch`; a colocated worker splits its time between the two."""
    def prefill_rps(pool: PoolHardware) -> float:
        service_s = cost_model_of[(pool.gpu, pool.cap)].prefill_s(int(prompt_tokens), 0, Parallelism(pool.tp))
        if not 0 < service_s < ttft_slo_s:
            return 0.0
        return 2 * (ttft_slo_s - service_s) / (2 * ttft_slo_s - service_s) / service_s * pool.replicas

    def decode_rps(pool: PoolHardware) -> float:
        shape = BatchShape(num_decodes=batch, decode_context_tokens=int(batch * (prompt_tokens + output_tokens / 2)))
        step_s = cost_model_of[(pool.gpu, pool.cap)].step_s(shape, Parallelism(pool.tp))
        return batch / max(step_s, 1e-9) / max(output_tokens, 1.0) * pool.replicas

    if fleet.colocated is not None:
        prefill = prefill_rps(fleet.colocated)
        return 0.0 if prefill <= 0 else 1.0 / (1.0 / prefill + 1.0 / decode_rps(fleet.colocated))
    assert fleet.prefill is not None and fleet.decode is not None
    return min(prefill_rps(fleet.prefill), decode_rps(fleet.decode))
