"""`GoodputPlanner`: search every placement's per-GPU goodput in parallel and pick the best deployment unit.

The request mix is built once (the named workload, requests longer than the model's context
dropped as DistServe does, arrivals at rate 1); each candidate's search (`search_goodput`) runs
in a worker process. Candidates go out best-guess first — a roofline-style bound from the cost
model — in waves of `wave_size`: every search of a wave gives up once it knows it falls under the
best per-GPU goodput the earlier waves passed, so weak candidates are pruned after a few probes
(that rate only prunes, never moves a search's probes). Within a wave the searches share nothing,
so what each reports (its rate, whether it was pruned, its probes) is a function of the inputs
alone: the same plan, byte for byte in `--json`, whatever the number of processes or the order
they finish in. The winner is the highest per-GPU goodput; ties go to fewer GPUs, then to
enumeration order (see goodput.py).
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvbaton.bench.metrics import SLO, summarize
from kvbaton.bench.workloads import create_workload
from kvbaton.bench.workloads.base import WorkloadRequest
from kvbaton.core.errors import InvalidRequestError
from kvbaton.plan.goodput import GoodputResult, SearchSettings, scaled, search_goodput
from kvbaton.plan.placements import Hardware, Placement, colocated_placements, disaggregated_placements
from kvbaton.sim.catalog import get_gpu, get_model
from kvbaton.sim.costs import BatchShape, CostModel, Parallelism, create_cost_model
from kvbaton.sim.run import SimSetup, simulate


@dataclass(frozen=True, slots=True)
class PlanRequest:
    model: str
    gpu: str
    num_gpus: int
    settings: SearchSettings
    gpus_per_node: int = 8
    affinity: str = "low"  # "low": Algorithm 2 (node-constrained), "high": Algorithm 1
    workload: str = "sharegpt-like"
    workload_params: tuple[tuple[str, Any], ...] = ()
    num_requests: int = 300
    seed: int = 0
    cost_model: str = "roofline"  # roofline | distserve | coefficient file
    colocated_chunk_tokens: int = 512  # chunked-prefill token budget of colocated workers
    disaggregated_batch_tokens: int = 2048  # token budget of prefill and decode workers
    num_processes: int = 0  # 0: every core
    wave_size: int = 4  # searches that run side by side, pruned only by the rates of the waves before theirs
    max_pp: int = 1  # pipeline degrees searched (see placements.py on why 1 by default)


@dataclass(frozen=True, slots=True)
class Candidate:
    placement: Placement
    bound_per_gpu_rps: float  # the analytic guess that orders the search
    result: GoodputResult
    search_s: float  # wall time of its search


@dataclass(frozen=True, slots=True)
class Plan:
    request: PlanRequest
    candidates: tuple[Candidate, ...]  # in enumeration order
    best: Candidate  # over every candidate
    best_colocated: Candidate | None
    best_disaggregated: Candidate | None
    search_s: float
    num_requests: int  # after dropping requests over the context
    workload_means: tuple[float, float] = field(default=(0.0, 0.0))  # (prompt, output) tokens

    def units_for(self, rate_rps: float) -> int:
        unit_rps = self.best.result.per_gpu_rps * self.best.placement.num_gpus
        if unit_rps <= 0:
            raise InvalidRequestError("no placement meets the SLOs at any searched rate")
        return math.ceil(rate_rps / unit_rps - 1e-9)


def plan_requests(request: PlanRequest, max_model_len: int) -> list[WorkloadRequest]:
    """The search's request mix: `num_requests` that fit the context, Poisson arrivals at 1 req/s."""
    return search_requests(request.workload, request.workload_params, request.num_requests, request.seed,
                           max_model_len)


def search_requests(workload: str, workload_params: tuple[tuple[str, Any], ...], num_requests: int, seed: int,
                    max_model_len: int) -> list[WorkloadRequest]:
    """`plan_requests` from its parts (the hardware search's mix too)."""
    # An explicit Poisson process: a self-timed workload (mooncake, hot-prefix-burst) would otherwise keep its own
    # times, whose mean rate is not 1, and the probes, which rescale these times, would run slower than they claim.
    drawn = create_workload(workload, num_requests=num_requests * 2, seed=seed, rate=1.0, arrival="poisson",
                            **dict(workload_params))
    fitting = [r for r in drawn if r.num_prompt_tokens + r.output_tokens <= max_model_len][:num_requests]
    if not fitting:
        raise InvalidRequestError(f"no request of {workload} fits the {max_model_len}-token context")
    # Dropping requests thins the process; the kept ones take the first arrival times of the drawn rate-1 process
    # in order (unchanged when nothing was dropped), so they too arrive at 1 req/s.
    return [replace(r, index=i, arrival_s=drawn[i].arrival_s) for i, r in enumerate(fitting)]


def bound_per_gpu_rps(placement: Placement, cost: CostModel, prompt_tokens: float, output_tokens: float,
                      slo: SLO, batch: int = 64) -> float:
    """A rough rate used only to order the searches (strong candidates first prune the rest sooner).

    Prefill: an M/D/1 queue serving a `prompt_tokens` prompt (pass a high percentile) whose mean
    wait plus service stays within the TTFT SLO; decode: a fixed batch of `batch` sequences.
    """
    def prefill_rps(par: Parallelism) -> float:
        service_s = cost.prefill_s(int(prompt_tokens), 0, par)
        if not service_s > 0:
            raise InvalidRequestError(f"cost model {cost.name} gives a {int(prompt_tokens)}-token prefill no time; "
                                      "the planner needs one that prices steps (roofline, distserve, a profile)")
        if service_s >= slo.ttft_s:
            return 0.0
        # M/D/1: TTFT = t + rho t / (2 (1 - rho)) <= S  <=>  rho <= 2 (S - t) / (2 S - t)
        rho = 2 * (slo.ttft_s - service_s) / (2 * slo.ttft_s - service_s)
        return rho / service_s

    def decode_rps(par: Parallelism) -> float:
        ctx = int(batch * (prompt_tokens + output_tokens / 2))
        step_s = cost.step_s(BatchShape(num_decodes=batch, decode_context_tokens=ctx), par)
        return batch / max(step_s, 1e-9) / max(output_tokens, 1.0)

    if placement.colocated is not None:
        par = Parallelism(placement.colocated.tp, placement.colocated.pp)
        prefill = prefill_rps(par)
        rps = 0.0 if prefill <= 0 else 1.0 / (1.0 / prefill + 1.0 / decode_rps(par))
    else:
        assert placement.prefill is not None and placement.decode is not None
        rps = min(prefill_rps(Parallelism(placement.prefill.tp, placement.prefill.pp)),
                  decode_rps(Parallelism(placement.decode.tp, placement.decode.pp)))
    return rps / placement.num_gpus


# ---- worker processes --------------------------------------------------------------------------------

_requests: list[WorkloadRequest] = []


def init_search_worker(requests: list[WorkloadRequest]) -> None:
    global _requests
    _requests = requests


def search_one(job: tuple[int, SimSetup, int, SearchSettings, float]) -> tuple[int, GoodputResult, float]:
    index, setup, num_gpus, settings, floor_rps = job
    started = time.perf_counter()
    result = search_goodput(_requests, setup, num_gpus, settings, floor_rps=floor_rps)
    return index, result, time.perf_counter() - started


def _sweep_one(job: tuple[int, SimSetup, int, float, SLO]) -> tuple[int, float, float, float]:
    index, setup, num_gpus, per_gpu_rps, slo = job
    records = simulate(scaled(_requests, per_gpu_rps * num_gpus), setup).records
    summary = summarize(records, slo, num_gpus)
    return index, per_gpu_rps, summary.goodput_per_gpu_rps or 0.0, summary.overall.slo_attainment or 0.0


class GoodputPlanner:
    def __init__(self, request: PlanRequest) -> None:
        self.request = request
        self.model = get_model(request.model)
        self.gpu = get_gpu(request.gpu)
        self.cost_model = create_cost_model(request.cost_model, request.model, request.gpu)
        self.hardware = Hardware(self.gpu, request.num_gpus, min(request.gpus_per_node, request.num_gpus))
        self.max_model_len = self.model.max_context_tokens

    def placements(self) -> list[Placement]:
        disagg = (disaggregated_placements(self.model, self.cost_model, self.hardware, self.request.affinity,
                                           self.max_model_len, self.request.max_pp)
                  if self.request.num_gpus >= 2 else [])
        return disagg + colocated_placements(self.model, self.cost_model, self.hardware, self.max_model_len,
                                             self.request.max_pp)

    def setup_for(self, placement: Placement) -> SimSetup:
        budget = (self.request.colocated_chunk_tokens if placement.colocated is not None
                  else self.request.disaggregated_batch_tokens)
        # One instance per pool: the placement policies have nothing to choose, so heartbeats can be sparse. TTFT
        # as DistServe defines it: the first token leaves the prefill instance.
        return SimSetup(model=self.request.model, gpu=self.request.gpu, cluster=placement.cluster_spec,
                        policy="round_robin", cost_model=self.request.cost_model, seed=self.request.seed,
                        max_num_batched_tokens=budget, max_model_len=self.max_model_len,
                        enable_prefix_cache=False, heartbeat_s=1.0, first_token_at="prefill")

    def run(self) -> Plan:
        started = time.perf_counter()
        requests = plan_requests(self.request, self.max_model_len)
        prompt_mean = sum(r.num_prompt_tokens for r in requests) / len(requests)
        output_mean = sum(r.output_tokens for r in requests) / len(requests)
        prompt_p90 = sorted(r.num_prompt_tokens for r in requests)[int(0.9 * (len(requests) - 1))]
        placements = self.placements()
        if not placements:
            raise InvalidRequestError(f"{self.request.model} fits no placement on {self.request.num_gpus} x "
                                      f"{self.request.gpu}")
        bounds = [bound_per_gpu_rps(p, self.cost_model, prompt_p90, output_mean, self.request.settings.slo)
                  for p in placements]
        order = sorted(range(len(placements)), key=lambda i: (-bounds[i], i))
        outcomes = self._search_in_waves(placements, order, requests)
        candidates = tuple(Candidate(placements[i], bounds[i], *outcomes[i]) for i in range(len(placements)))
        best = _best(candidates)
        assert best is not None
        return Plan(self.request, candidates, best,
                    _best([c for c in candidates if not c.placement.disaggregated]),
                    _best([c for c in candidates if c.placement.disaggregated]),
                    time.perf_counter() - started, len(requests), (prompt_mean, output_mean))

    def sweep(self, placements: Sequence[Placement],
              per_gpu_rates: Sequence[float]) -> list[list[tuple[float, float, float]]]:
        """Full runs (no early stop) of each placement at each per-GPU rate: (rate, goodput/GPU, attainment)."""
        requests = plan_requests(self.request, self.max_model_len)
        slo = self.request.settings.slo
        jobs = [(i, self.setup_for(p), p.num_gpus, rate, slo) for i, p in enumerate(placements)
                for rate in per_gpu_rates]
        curves: list[list[tuple[float, float, float]]] = [[] for _ in placements]
        for index, rate, goodput, attained in sorted(self._map(_sweep_one, jobs, requests)):
            curves[index].append((rate, goodput, attained))
        return curves

    def _search_in_waves(self, placements: Sequence[Placement], order: Sequence[int],
                         requests: list[WorkloadRequest]) -> dict[int, tuple[GoodputResult, float]]:
        """Each candidate's search, `order` cut into waves; a wave's floor is the best rate the waves before
        it passed (`max` of exact grid rates: the same number in any order)."""
        wave_size = max(1, self.request.wave_size)
        waves = [order[i:i + wave_size] for i in range(0, len(order), wave_size)]
        outcomes: dict[int, tuple[GoodputResult, float]] = {}
        with self._pool(requests, len(order)) as run:
            for wave in waves:
                floor_rps = max((result.per_gpu_rps for result, _ in outcomes.values()), default=0.0)
                jobs = [(i, self.setup_for(placements[i]), placements[i].num_gpus, self.request.settings, floor_rps)
                        for i in wave]
                outcomes.update({index: (result, seconds) for index, result, seconds in run(search_one, jobs)})
        return outcomes

    def _map(self, fn: Callable[[Any], Any], jobs: Sequence[Any], requests: list[WorkloadRequest]) -> list[Any]:
        """`fn` over `jobs` on every core (results in completion order), or inline with one process."""
        with self._pool(requests, len(jobs)) as run:
            return run(fn, jobs)

    @contextlib.contextmanager
    def _pool(self, requests: list[WorkloadRequest],
              num_jobs: int) -> Iterator[Callable[[Callable[[Any], Any], Sequence[Any]], list[Any]]]:
        """A function mapping `fn` over jobs: on a process pool of up to every core, or inline with one."""
        num_processes = min(self.request.num_processes or os.cpu_count() or 1, num_jobs)
        if num_processes <= 1:
            init_search_worker(requests)
            yield lambda fn, jobs: [fn(job) for job in jobs]
            return
        with multiprocessing.get_context("fork").Pool(num_processes, init_search_worker, (requests,)) as pool:
            yield lambda fn, jobs: list(pool.imap_unordered(fn, jobs))


def _best(candidates: Sequence[Candidate]) -> Candidate | None:
    """Highest per-GPU goodput; ties to fewer GPUs, then enumeration order (candidates come in that order)."""
    if not candidates:
        return None
    return max(candidates, key=lambda c: (c.result.per_gpu_rps, -c.placement.num_gpus))
