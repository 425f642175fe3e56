"""The placements the planner searches: DistServe's per-phase tp/pp enumeration and the colocated baseline.

A `Placement` is one deployment *unit* — one prefill instance and one decode instance, or one
colocated (mixed, chunked-prefill) instance — that is replicated to reach a target rate, as
DistServe reports it. Two enumerations, after DistServe (OSDI'24 §4, and its simulator's search):

- Algorithm 1, high node affinity (`affinity="high"`: fast links between nodes): each phase
  picks its own tensor (inside a node) and pipeline degree; the pair may span nodes, so KV moves
  over the inter-node link when the unit does not fit in one node.
- Algorithm 2, node-constrained (`affinity="low"`): the model is cut into `pp_cross` segments
  across nodes, and inside a node each segment holds one prefill stage and one decode stage
  (tp_p·pp_p + tp_d·pp_d <= GPUs per node), so every KV transfer stays on NVLink.

Pipeline degrees go up to `max_pp` (default 1): the simulator prices a pp-stage worker's step at
1/pp of the whole step for latency as well as throughput (`kvbaton.sim.costs.linear`), which
flatters pipelines on TTFT; raise it once stage latency is modelled.
Only parallel degrees the cost model can price and the model can be split by are enumerated
(tp dividing the attention and KV heads, and among a linear model's coefficient sets; pp
dividing the layers), and a worker must hold its weights plus at least one full-context request
of KV. A node-constrained unit's segments must each fit inside one node.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbaton.core.errors import InvalidRequestError
from kvbaton.sim.catalog import GpuSpec, ModelSpec
from kvbaton.sim.costs import CostModel, LinearCostModel
from kvbaton.sim.run import KV_MEMORY_FRACTION

AFFINITIES = ("low", "high")
INTER_NODE_LINK = "infiniband"


@dataclass(frozen=True, slots=True)
class PoolConfig:
    tp: int
    pp: int
    replicas: int = 1

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp * self.replicas

    def to_json(self) -> dict[str, int]:
        return {"tp": self.tp, "pp": self.pp, "replicas": self.replicas}


@dataclass(frozen=True, slots=True)
class Placement:
    """One unit: `prefill` + `decode` pools (disaggregated) or a `colocated` pool."""

    algorithm: str  # "node-constrained" | "high-affinity" | "colocated"
    prefill: PoolConfig | None = None
    decode: PoolConfig | None = None
    colocated: PoolConfig | None = None
    link: str = ""  # prefill -> decode KV link preset (kvbaton.sim.links); "" when colocated

    def __post_init__(self) -> None:
        if (self.colocated is None) == (self.prefill is None or self.decode is None):
            raise InvalidRequestError("a placement has either both prefill and decode pools or a colocated one")

    @property
    def disaggregated(self) -> bool:
        return self.colocated is None

    @property
    def num_gpus(self) -> int:
        if self.colocated is not None:
            return self.colocated.num_gpus
        assert self.prefill is not None and self.decode is not None
        return self.prefill.num_gpus + self.decode.num_gpus

    @property
    def cluster_spec(self) -> str:
        """The `kvbaton sim --cluster` text that simulates this unit."""
        if self.colocated is not None:
            c = self.colocated
            return f"{c.replicas}xmixed:tp={c.tp},pp={c.pp}"
        p, d = self.prefill, self.decode
        assert p is not None and d is not None
        return f"{p.replicas}P{d.replicas}D:tp_p={p.tp},pp_p={p.pp},tp_d={d.tp},pp_d={d.pp},link={self.link}"

    @property
    def label(self) -> str:
        if self.colocated is not None:
            c = self.colocated
            return f"colocated tp{c.tp} pp{c.pp} x{c.replicas}"
        p, d = self.prefill, self.decode
        assert p is not None and d is not None
        return f"P tp{p.tp} pp{p.pp} x{p.replicas} + D tp{d.tp} pp{d.pp} x{d.replicas}"

    def to_json(self) -> dict[str, object]:
        if self.colocated is not None:
            return {"colocated": self.colocated.to_json()}
        assert self.prefill is not None and self.decode is not None
        return {"prefill": self.prefill.to_json(), "decode": self.decode.to_json()}


@dataclass(frozen=True, slots=True)
class Hardware:
    gpu: GpuSpec
    num_gpus: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        if self.num_gpus <= 0 or self.gpus_per_node <= 0:
            raise InvalidRequestError("num_gpus and gpus_per_node must be positive")

    @property
    def num_nodes(self) -> int:
        return -(-self.num_gpus // self.gpus_per_node)

    def num_fitting(self, group_gpus: int) -> int:
        """How many groups of `group_gpus` GPUs, each inside one node, the nodes hold (the last may be partial)."""
        full_nodes, rest = divmod(self.num_gpus, self.gpus_per_node)
        return full_nodes * (self.gpus_per_node // group_gpus) + rest // group_gpus


def possible_tps(model: ModelSpec, cost_model: CostModel, limit: int) -> list[int]:
    # A linear model prices only the degrees it has (published/profiled) coefficients for.
    tps = list(cost_model.by_tp) if isinstance(cost_model, LinearCostModel) else range(1, limit + 1)
    return [t for t in tps if t <= limit and model.num_kv_heads % t == 0 and model.num_heads % t == 0]


def possible_pps(model: ModelSpec, limit: int) -> list[int]:
    return [p for p in range(1, limit + 1) if model.num_layers % p == 0]


def fits_memory(model: ModelSpec, gpu: GpuSpec, num_gpus: int, max_model_len: int) -> bool:
    """Weights plus one full-context request of KV fit in `num_gpus` GPUs (the simulator's KV sizing)."""
    free_bytes = gpu.mem_bytes * num_gpus * KV_MEMORY_FRACTION - model.weight_bytes
    return free_bytes >= model.kv_bytes_per_token * max_model_len


def disaggregated_placements(model: ModelSpec, cost_model: CostModel, hw: Hardware, affinity: str,
                             max_model_len: int, max_pp: int = 1) -> list[Placement]:
    """One prefill + one decode instance per unit, enumerated as DistServe's Algorithm 1 or 2 (module docstring)."""
    if affinity not in AFFINITIES:
        raise InvalidRequestError(f"affinity must be one of {AFFINITIES}, got {affinity!r}")
    tps = possible_tps(model, cost_model, hw.gpus_per_node)
    pps = possible_pps(model, min(hw.num_gpus, max_pp))
    found: list[Placement] = []
    if affinity == "high":
        for tp_p in tps:
            for pp_p in pps:
                for tp_d in tps:
                    for pp_d in pps:
                        unit_gpus = tp_p * pp_p + tp_d * pp_d
                        if unit_gpus > hw.num_gpus:
                            continue
                        link = hw.gpu.intra_node_link if unit_gpus <= hw.gpus_per_node else INTER_NODE_LINK
                        found.append(Placement("high-affinity", PoolConfig(tp_p, pp_p), PoolConfig(tp_d, pp_d),
                                               link=link))
    else:
        local_pps = [p for p in pps if p <= hw.gpus_per_node]
        for pp_cross in (p for p in pps if p <= hw.num_nodes):
            for tp_p in tps:
                for pp_p in local_pps:
                    for tp_d in tps:
                        for pp_d in local_pps:
                            segment_gpus = tp_p * pp_p + tp_d * pp_d
                            if segment_gpus > hw.gpus_per_node or hw.num_fitting(segment_gpus) < pp_cross:
                                continue
                            if pp_cross * pp_p not in pps or pp_cross * pp_d not in pps:
                                continue
                            found.append(Placement("node-constrained", PoolConfig(tp_p, pp_cross * pp_p),
                                                   PoolConfig(tp_d, pp_cross * pp_d), link=hw.gpu.intra_node_link))
    return [p for p in found if p.prefill is not None and p.decode is not None
            and fits_memory(model, hw.gpu, p.prefill.tp * p.prefill.pp, max_model_len)
            and fits_memory(model, hw.gpu, p.decode.tp * p.decode.pp, max_model_len)]


def colocated_placements(model: ModelSpec, cost_model: CostModel, hw: Hardware, max_model_len: int,
                         max_pp: int = 1) -> list[Placement]:
    """One mixed (chunked-prefill) instance per unit, every tp (inside a node) x pp that fits."""
    return [Placement("colocated", colocated=PoolConfig(tp, pp))
            for tp in possible_tps(model, cost_model, hw.gpus_per_node)
            for pp in possible_pps(model, min(hw.num_gpus, max_pp))
            if tp * pp <= hw.num_gpus and fits_memory(model, hw.gpu, tp * pp, max_model_len)]
