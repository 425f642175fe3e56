"""One simulated run from names: workload requests + model/GPU/cost model/cluster spec/policy -> records.

`SimSetup` is what `kvbaton sim` and the benchmarks describe a run with; `simulate` builds the
cost model, sizes each worker's KV pool from the GPU's memory (catalog models) unless
`num_blocks` is given, runs `ClusterSim` and returns the records with per-worker figures.
A cluster spec naming pools' own GPUs or power caps (`2P3D:gpu_p=h100,gpu_d=a100,cap_d=0.7`) prices and
sizes each such pool from its own GPU (`worker_hardware`); the others run on `gpu`.
`kv_store_gb` / `kv_store_disk_gb` give the cluster one KV store over every front worker's node
(`kvbaton.cache.kv_store`), its loads priced over the GPU's host link (`GpuSpec.host_link`), the NIC and
the disk (`store_settings`); with `kv_store_private` each worker's node serves that worker alone (islands).
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvbaton.bench.records import RequestRecord
from kvbaton.bench.workloads.base import WorkloadRequest
from kvbaton.cache.kv_store import capacity_blocks
from kvbaton.cache.store_prices import StorePrices
from kvbaton.core.config import CacheConfig, SchedulerConfig
from kvbaton.core.errors import InvalidRequestError
from kvbaton.router.admission import AdmissionSLO, create_admission
from kvbaton.router.pairs import DEFAULT_LOCAL_PREFILL_THRESHOLD_TOKENS
from kvbaton.router.policies import local_queue_policy
from kvbaton.router.pools import PoolBalancer, PoolConfig
from kvbaton.sim.catalog import MODELS, get_gpu
from kvbaton.sim.cluster import ClusterSim
from kvbaton.sim.config import SimConfig, StoreNodeLoss, StoreReport, WorkerHardware, WorkerReport
from kvbaton.sim.outputs import CopyingOutputs
from kvbaton.sim.stage_loads import stage_time_models
from kvbaton.sim.costs import CostModel, create_cost_model
from kvbaton.sim.links import get_link
from kvbaton.sim.spec import ClusterSpec, parse_cluster_spec

DEFAULT_NUM_BLOCKS = CacheConfig().num_blocks
KV_MEMORY_FRACTION = 0.9  # of GPU memory, like vLLM's gpu_memory_utilization; weights come out of it


@dataclass(frozen=True, slots=True)
class SimSetup:
    model: str = "llama-3-8b"  # catalog model name (kv bytes, weights) or the name inside a cost file
    gpu: str = "h100"
    cluster: str = "4xmixed"
    policy: str = "round_robin"
    cost_model: str = "roofline"  # roofline | distserve | zero | path/to/coefficients.json
    seed: int = 0
    block_size: int = 16
    num_blocks: int = 0  # per worker; 0 = from GPU memory (catalog models), else the live default
    enable_prefix_cache: bool = True
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    heartbeat_s: float = 0.05
    max_model_len: int = 0  # 0 = the catalog model's context (8192 when unknown)
    admission: str = "none"  # none | baseline | early | predicted (kvbaton.router.admission)
    admission_slo: tuple[float, float] | None = None  # (TTFT s, TPOT s) admission protects; needed unless none
    admission_max_load: float = 1.0  # a stage is over capacity above this predicted latency / SLO
    # Adaptive pools (kvbaton.router.pools): lend workers of the idle pool to mixed duty; prices with admission_slo.
    adaptive_pools: bool = False
    pools: PoolConfig = PoolConfig()
    first_token_at: str = "decode"  # "decode" (kvbaton's live PD path) | "prefill" (DistServe's); see SimConfig
    reserve_ahead_tokens: int | None = None  # late KV reservation (see SimConfig); None: on arrival
    # Speculative decoding by prompt lookup (SchedulerConfig.num_speculative_tokens; 0 = off) while at most
    # spec_max_running requests run (None: SchedulerConfig's default, tuned on a 2-core CPU). Drafts only find
    # something when outputs repeat their prompts: output_copy_fraction > 0 makes each output copy spans of its
    # prompt (kvbaton.sim.outputs.CopyingOutputs, spans of output_copy_span tokens on average).
    num_speculative_tokens: int = 0
    spec_max_running: int | None = None
    output_copy_fraction: float = 0.0
    output_copy_span: float = 16.0
    # The cluster KV store (kvbaton.cache.kv_store): DRAM and disk per front worker's node (1e9 bytes); 0 and 0: none.
    # Its loads cross the GPU's host link, `store_nic` between nodes and a disk of `store_disk_gb_per_s`.
    kv_store_gb: float = 0.0
    kv_store_disk_gb: float = 0.0
    # Each worker's node serves that worker alone (islands: a store per worker, the router told the same); False:
    # one store over all the nodes (Mooncake's).
    kv_store_private: bool = False
    store_nic: str = "infiniband"
    store_disk_gb_per_s: float = 5.0
    store_node_losses: tuple[StoreNodeLoss, ...] = ()  # store nodes lost mid-run (and back, empty)
    # The live router's placement settings (SimConfig): conditional disaggregation's threshold, and the limit on
    # calls waiting for a first token (0: none; the live router's default is 256).
    local_prefill_threshold_tokens: int = DEFAULT_LOCAL_PREFILL_THRESHOLD_TOKENS
    max_num_waiting: int = 0
    decode_runs: bool = True  # runs of quiet decode steps applied at once (SimConfig; the same figures either way)


@dataclass(frozen=True, slots=True)
class SimResult:
    records: list[RequestRecord]
    workers: list[WorkerReport]
    num_gpus: int
    num_blocks_per_worker: int
    cost_model: str
    store: StoreReport | None = None  # with a cluster KV store


def check_setup(setup: SimSetup) -> None:
    """Refuses a setup whose numbers are out of range, before anything is built from it."""
    counts = {"block_size": setup.block_size, "max_num_batched_tokens": setup.max_num_batched_tokens,
              "max_num_seqs": setup.max_num_seqs}
    for name, value in counts.items():
        if value < 1:
            raise InvalidRequestError(f"{name} must be at least 1, got {value}")
    non_negative = {"seed": setup.seed, "num_blocks": setup.num_blocks, "max_model_len": setup.max_model_len,
                    "num_speculative_tokens": setup.num_speculative_tokens,
                    "local_prefill_threshold_tokens": setup.local_prefill_threshold_tokens,
                    "max_num_waiting": setup.max_num_waiting}
    for name, value in non_negative.items():
        if value < 0:
            raise InvalidRequestError(f"{name} must be >= 0, got {value}")
    for name, gb in (("kv_store_gb", setup.kv_store_gb), ("kv_store_disk_gb", setup.kv_store_disk_gb),
                     ("store_disk_gb_per_s", setup.store_disk_gb_per_s)):
        if not (math.isfinite(gb) and gb >= 0):
            raise InvalidRequestError(f"{name} must be a finite number >= 0, got {gb}")
    has_store = bool(setup.kv_store_gb or setup.kv_store_disk_gb)
    if has_store and not setup.enable_prefix_cache:
        raise InvalidRequestError("the KV store needs the prefix cache (the store is its tier past the device)")
    if setup.store_node_losses and not has_store:
        raise InvalidRequestError("a store node loss needs a KV store (kv_store_gb or kv_store_disk_gb)")
    if setup.kv_store_private and not has_store:
        raise InvalidRequestError("kv_store_private needs a KV store (kv_store_gb or kv_store_disk_gb)")
    if setup.kv_store_disk_gb and not setup.store_disk_gb_per_s > 0:
        raise InvalidRequestError("a store disk needs store_disk_gb_per_s > 0")
    if not 0.0 <= setup.output_copy_fraction <= 1.0:
        raise InvalidRequestError(f"output_copy_fraction must be in [0, 1], got {setup.output_copy_fraction}")
    if not (math.isfinite(setup.output_copy_span) and setup.output_copy_span >= 1.0):
        raise InvalidRequestError(f"output_copy_span must be a finite number >= 1, got {setup.output_copy_span}")
    if not (math.isfinite(setup.heartbeat_s) and setup.heartbeat_s > 0):
        raise InvalidRequestError(f"heartbeat_s must be a positive finite number, got {setup.heartbeat_s}")
    if setup.admission_slo is not None and not all(math.isfinite(s) and s > 0 for s in setup.admission_slo):
        raise InvalidRequestError(f"admission_slo must be positive finite seconds, got {setup.admission_slo}")
    if setup.spec_max_running is not None and setup.spec_max_running < 0:
        raise InvalidRequestError(f"spec_max_running must be >= 0, got {setup.spec_max_running}")


def kv_blocks_for(setup: SimSetup, spec: ClusterSpec, cost_model: CostModel, gpu: str = "") -> int:
    """KV blocks one worker holds: (memory x GPUs x fraction - weights) / block bytes, per worker of the spec,
    for a cost model of a catalog GPU (roofline, distserve, a coefficient file naming its `gpu`). `gpu`: the
    workers of a pool of that GPU ("": those of --gpu, or all of a one-GPU cluster), sized from its memory."""
    if setup.num_blocks > 0:
        return setup.num_blocks
    model = MODELS.get(setup.model)
    if cost_model.gpu_name is None or model is None:
        return DEFAULT_NUM_BLOCKS  # a CPU profile or a constant model: size the pool like the live engine
    gpu = gpu or setup.gpu
    if cost_model.gpu_name != gpu:
        named = f"--gpu {gpu}" if gpu == setup.gpu else gpu
        raise InvalidRequestError(f"cost model {cost_model.name} prices {cost_model.gpu_name}, not {named}")
    if cost_model.kv_bytes_per_token <= 0:
        raise InvalidRequestError(f"cost model {cost_model.name} has no kv_bytes_per_token to size {gpu}'s pool")
    gpus_per_worker = min(w.parallel.num_gpus for w in spec.workers if w.gpu in ("", gpu))
    free_bytes = get_gpu(gpu).mem_bytes * gpus_per_worker * KV_MEMORY_FRACTION - model.weight_bytes
    num_blocks = int(free_bytes // (cost_model.kv_bytes_per_token * setup.block_size))
    if num_blocks < 16:
        raise InvalidRequestError(f"{setup.model} leaves no room for KV on {gpus_per_worker} x {gpu}; "
                                  "raise tp or pp")
    return num_blocks


def worker_hardware(setup: SimSetup, spec: ClusterSpec) -> dict[str, WorkerHardware]:
    """Per worker id, its own cost model and KV pool, for each worker whose pool's GPU or power cap is not the
    first worker's (the run's cost model); empty for a one-GPU cluster. A pool's KV comes from its GPU's memory."""
    own: dict[str, WorkerHardware] = {}
    for gpu, cap in spec.hardware[1:]:
        cost_model = create_cost_model(setup.cost_model, setup.model, gpu, cap)
        pool = WorkerHardware(cost_model, kv_blocks_for(setup, spec, cost_model, gpu))
        own.update({w.worker_id: pool for w in spec.workers if (w.gpu, w.power_cap) == (gpu, cap)})
    return own


def store_settings(setup: SimSetup, cost_model: CostModel) -> dict[str, Any]:
    """SimConfig's store fields: blocks per node in DRAM and on disk, and the prices of the links loads take."""
    if cost_model.kv_bytes_per_token <= 0:
        raise InvalidRequestError(f"a KV store needs the KV bytes per token, which {cost_model.name} lacks")
    block_bytes = cost_model.kv_bytes_per_token * setup.block_size
    host = get_link(get_gpu(setup.gpu).host_link)
    nic = get_link(setup.store_nic)
    prices = StorePrices(block_bytes, host.bytes_per_s, nic.bytes_per_s, setup.store_disk_gb_per_s * 1e9,
                         max(host.latency_s, nic.latency_s))
    return {"store_prices": prices, "store_dram_blocks": capacity_blocks(setup.kv_store_gb, block_bytes),
            "store_disk_blocks": capacity_blocks(setup.kv_store_disk_gb, block_bytes),
            "store_private": setup.kv_store_private, "store_node_losses": setup.store_node_losses}


def build_sim(setup: SimSetup) -> tuple[ClusterSim, ClusterSpec, int]:
    check_setup(setup)
    spec = parse_cluster_spec(setup.cluster, setup.gpu)
    model = MODELS.get(setup.model)
    deepest = max(w.parallel.pp for w in spec.workers)
    if model is not None and deepest > model.num_layers:
        raise InvalidRequestError(f"{setup.cluster!r}: {deepest} pipeline stages, but {setup.model} has only "
                                  f"{model.num_layers} layers")
    unsplit = sorted({w.parallel.tp for w in spec.workers if model is not None
                      and (model.num_heads % w.parallel.tp or model.num_kv_heads % w.parallel.tp)})
    if unsplit and model is not None:
        raise InvalidRequestError(f"{setup.cluster!r}: tp={unsplit[0]} does not divide {setup.model}'s "
                                  f"{model.num_heads} attention heads and {model.num_kv_heads} KV heads")
    base_gpu, base_cap = spec.hardware[0]  # the first pool's: the run's cost model; other pools get their own
    cost_model = create_cost_model(setup.cost_model, setup.model, base_gpu, base_cap)
    num_blocks = kv_blocks_for(setup, spec, cost_model, base_gpu)
    hardware = worker_hardware(setup, spec)
    own_costs = {wid: hw.cost_model for wid, hw in hardware.items()}
    max_model_len = setup.max_model_len or (model.max_context_tokens if model else 8192)
    config = SimConfig(
        policy=setup.policy, seed=setup.seed,
        cache=CacheConfig(block_size=setup.block_size, num_blocks=num_blocks,
                          enable_prefix_cache=setup.enable_prefix_cache),
        scheduler=SchedulerConfig(max_num_batched_tokens=setup.max_num_batched_tokens,
                                  max_num_seqs=setup.max_num_seqs, queue_policy=local_queue_policy(setup.policy),
                                  num_speculative_tokens=setup.num_speculative_tokens,
                                  **({} if setup.spec_max_running is None
                                     else {"spec_max_running": setup.spec_max_running})),
        heartbeat_s=setup.heartbeat_s, max_model_len=max_model_len, first_token_at=setup.first_token_at,
        reserve_ahead_tokens=setup.reserve_ahead_tokens,
        local_prefill_threshold_tokens=setup.local_prefill_threshold_tokens, max_num_waiting=setup.max_num_waiting,
        decode_runs=setup.decode_runs)
    if setup.kv_store_gb or setup.kv_store_disk_gb:
        config = replace(config, **store_settings(setup, cost_model))
    admission = pools = None
    if (setup.admission != "none" or setup.adaptive_pools) and setup.admission_slo is None:
        raise InvalidRequestError("admission and adaptive pools need admission_slo (TTFT s, TPOT s)")
    if setup.admission != "none":
        admission = create_admission(setup.admission, AdmissionSLO(*setup.admission_slo),
                                     stage_time_models(spec, cost_model, own_costs), setup.admission_max_load)
    if setup.adaptive_pools:
        if not any(w.role == "decode" for w in spec.workers) or not any(w.role == "prefill" for w in spec.workers):
            raise InvalidRequestError(f"adaptive pools need prefill and decode workers; {setup.cluster!r} has not")
        pools = PoolBalancer(AdmissionSLO(*setup.admission_slo), stage_time_models(spec, cost_model, own_costs),
                             config=setup.pools)
    # The default tokens count up from 100, so drafts from a prompt holding such a run would be accepted by accident:
    # a speculating run draws its tokens from CopyingOutputs, fresh ones only with a copy fraction of 0.
    token_for = (CopyingOutputs(setup.output_copy_fraction, setup.output_copy_span, setup.seed)
                 if setup.output_copy_fraction > 0 or setup.num_speculative_tokens > 0 else None)
    return (ClusterSim(spec, cost_model, config, token_for=token_for, admission=admission, pools=pools,
                       hardware=hardware), spec, num_blocks)


def simulate(requests: Sequence[WorkloadRequest], setup: SimSetup,
             on_record: Callable[[RequestRecord], None] | None = None) -> SimResult:
    # The cyclic collector stays paused (as `ClusterSim.run` pauses it) until the sim is closed and dropped, and
    # so freed by reference counting: re-enabled while the sim lived, its first pass would traverse every object
    # the run left (~4 % of a run), and a sim dropped with its cycles would cost a later pass as much again.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _simulate_and_drop(requests, setup, on_record)
    finally:
        if gc_was_enabled:
            gc.enable()


def _simulate_and_drop(requests: Sequence[WorkloadRequest], setup: SimSetup,
                       on_record: Callable[[RequestRecord], None] | None) -> SimResult:
    """The run; the sim is closed, and freed as this returns."""
    sim, spec, num_blocks = build_sim(setup)
    records = sim.run(requests, on_record)
    result = SimResult(records, sim.worker_reports(), spec.num_gpus, num_blocks, sim.cost_model.name,
                       sim.store_report())
    sim.close()
    return result

