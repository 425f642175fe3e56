"""`FleetPlanner`: the hardware search — the goodput of every fleet a budget buys, per GPU, per dollar-hour, per kW.

`kvbaton plan --gpus h100,a100 --budget-per-hour 40` enumerates fleets (`kvbaton.plan.fleets`), simulates each
with per-pool GPUs (`kvbaton.sim`, the roofline model of each pool's GPU under its cap) and bisects its request
rate for the largest one meeting the SLO attainment target (`kvbaton.plan.goodput`). The objective is the
fleet's goodput (req/s meeting the SLOs): the budget fixes what may be spent, so the best fleet is the one that
serves the most under it; goodput per GPU, per dollar-hour and per kW are reported beside it. Searches go out
best-guess first (`fleet_bound_rps`) in waves, homogeneous fleets first: a search gives up once it cannot beat
the best goodput of its own group's earlier waves (homogeneous), or of any earlier wave (the rest), so the best
homogeneous fleet, reported beside the best, is never pruned by a heterogeneous one. As in `GoodputPlanner`,
the plan is the same whatever the number of processes. Ties go to the cheaper fleet, then enumeration order.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvbaton.core.errors import InvalidRequestError
from kvbaton.plan.fleets import Budget, Fleet, enumerate_fleets, fleet_bound_rps
from kvbaton.plan.goodput import GoodputResult, SearchSettings
from kvbaton.plan.planner import init_search_worker, search_one, search_requests
from kvbaton.sim.catalog import get_model
from kvbaton.sim.costs import CostModel, create_cost_model
from kvbaton.sim.hardware import load_prices
from kvbaton.sim.run import SimSetup


@dataclass(frozen=True, slots=True)
class FleetRequest:
    model: str
    gpus: tuple[str, ...]
    budget: Budget
    settings: SearchSettings
    decode_caps: tuple[float, ...] = (1.0,)  # power caps tried for decode pools (1.0: uncapped)
    prices: tuple[tuple[str, float], ...] = ()  # USD per GPU-hour overriding the default table
    max_tp: int = 8  # largest tensor degree of one worker (one node)
    workload: str = "sharegpt-like"
    workload_params: tuple[tuple[str, Any], ...] = ()
    num_requests: int = 300
    seed: int = 0
    colocated_chunk_tokens: int = 512
    disaggregated_batch_tokens: int = 2048
    num_processes: int = 0  # 0: every core
    wave_size: int = 4

    @property
    def price_table(self) -> dict[str, float]:
        return {**load_prices(None), **dict(self.prices)}


@dataclass(frozen=True, slots=True)
class FleetCandidate:
    fleet: Fleet
    price_per_hour: float
    power_kw: float
    bound_rps: float  # the guess that orders the search
    result: GoodputResult

    @property
    def goodput_rps(self) -> float:
        return float(f"{self.result.per_gpu_rps * self.fleet.num_gpus:.12g}")


@dataclass(frozen=True, slots=True)
class FleetPlan:
    request: FleetRequest
    candidates: tuple[FleetCandidate, ...]  # in enumeration order
    best: FleetCandidate
    best_homogeneous: FleetCandidate | None
    search_s: float
    workload_means: tuple[float, float]  # (prompt, output) tokens


class FleetPlanner:
    def __init__(self, request: FleetRequest) -> None:
        self.request = request
        self.model = get_model(request.model)
        self.prices = request.price_table
        self.max_model_len = self.model.max_context_tokens
        self.cost_models: dict[tuple[str, float], CostModel] = {
            (gpu, cap): create_cost_model("roofline", request.model, gpu, cap)
            for gpu in request.gpus for cap in (1.0, *request.decode_caps)}

    def fleets(self) -> list[Fleet]:
        by_gpu = {gpu: self.cost_models[(gpu, 1.0)] for gpu in self.request.gpus}
        return enumerate_fleets(self.model, by_gpu, self.request.gpus, self.request.decode_caps, self.request.budget,
                                self.prices, self.request.max_tp, self.max_model_len)

    def setup_for(self, fleet: Fleet) -> SimSetup:
        budget = self.request.colocated_chunk_tokens if fleet.colocated is not None else \
            self.request.disaggregated_batch_tokens
        # The first token reaches the client from the decode worker, after the KV crossed between the machines.
        return SimSetup(model=self.request.model, gpu=fleet.pools[0].gpu, cluster=fleet.cluster_spec,
                        policy="least_load", cost_model="roofline", seed=self.request.seed,
                        max_num_batched_tokens=budget, max_model_len=self.max_model_len, enable_prefix_cache=False,
                        heartbeat_s=0.1)

    def run(self) -> FleetPlan:
        started = time.perf_counter()
        req = self.request
        requests = search_requests(req.workload, req.workload_params, req.num_requests, req.seed, self.max_model_len)
        prompt_mean = sum(r.num_prompt_tokens for r in requests) / len(requests)
        output_mean = sum(r.output_tokens for r in requests) / len(requests)
        prompt_p90 = sorted(r.num_prompt_tokens for r in requests)[int(0.9 * (len(requests) - 1))]
        fleets = self.fleets()
        if not fleets:
            raise InvalidRequestError(f"the budget buys no fleet of {', '.join(req.gpus)} that holds {req.model}")
        bounds = [fleet_bound_rps(f, self.cost_models, prompt_p90, output_mean, req.settings.slo.ttft_s)
                  for f in fleets]
        groups = [[i for i in range(len(fleets)) if fleets[i].homogeneous],
                  [i for i in range(len(fleets)) if not fleets[i].homogeneous]]
        outcomes: dict[int, GoodputResult] = {}
        num_processes = min(req.num_processes or os.cpu_count() or 1, len(fleets))
        pool = (multiprocessing.get_context("fork").Pool(num_processes, init_search_worker, (requests,))
                if num_processes > 1 else None)
        if pool is None:
            init_search_worker(requests)
        try:
            for group in groups:
                order = sorted(group, key=lambda i: (-bounds[i], i))
                for start in range(0, len(order), max(1, req.wave_size)):
                    wave = order[start:start + max(1, req.wave_size)]
                    best_rps = max((r.per_gpu_rps * fleets[i].num_gpus for i, r in outcomes.items()), default=0.0)
                    jobs = [(i, self.setup_for(fleets[i]), fleets[i].num_gpus, req.settings,
                             best_rps / fleets[i].num_gpus) for i in wave]
                    done = pool.imap_unordered(search_one, jobs) if pool is not None else map(search_one, jobs)
                    outcomes.update({index: result for index, result, _ in done})
        finally:
            if pool is not None:
                pool.close()
                pool.join()
        candidates = tuple(FleetCandidate(f, f.price_per_hour(self.prices), f.power_kw, bounds[i], outcomes[i])
                           for i, f in enumerate(fleets))
        best = best_fleet(candidates)
        assert best is not None
        return FleetPlan(req, candidates, best, best_fleet([c for c in candidates if c.fleet.homogeneous]),
                         time.perf_counter() - started, (prompt_mean, output_mean))


def best_fleet(candidates: Sequence[FleetCandidate]) -> FleetCandidate | None:
    """The most goodput; ties to the cheaper fleet, then the lower power, then enumeration order."""
    if not candidates:
        return None
    return min(candidates, key=lambda c: (-c.goodput_rps, c.price_per_hour, c.power_kw))


def _per(value: float, unit: float) -> float | None:
    return round(value / unit, 6) if unit > 0 else None


def candidate_json(c: FleetCandidate) -> dict[str, Any]:
    r = c.result
    return {
        **c.fleet.to_json(), "label": c.fleet.label, "cluster": c.fleet.cluster_spec, "num_gpus": c.fleet.num_gpus,
        "homogeneous": c.fleet.homogeneous, "price_per_hour": round(c.price_per_hour, 6),
        "power_kw": round(c.power_kw, 6), "goodput_rps": c.goodput_rps, "per_gpu_goodput_rps": r.per_gpu_rps,
        "goodput_per_dollar_hour": _per(c.goodput_rps, c.price_per_hour), "goodput_per_kw": _per(c.goodput_rps,
                                                                                                c.power_kw),
        "pruned": r.pruned, "capped": r.capped, "num_probes": len(r.probes), "bound_rps": round(c.bound_rps, 4),
    }


def fleet_plan_json(plan: FleetPlan) -> dict[str, Any]:
    req, s = plan.request, plan.request.settings
    return {
        "best": candidate_json(plan.best),
        "best_homogeneous": candidate_json(plan.best_homogeneous) if plan.best_homogeneous else None,
        "candidates": [candidate_json(c) for c in plan.candidates],
        "settings": {
            "model": req.model, "gpus": list(req.gpus), "decode_caps": list(req.decode_caps),
            "budget_per_hour": req.budget.per_hour, "power_budget_kw": req.budget.power_kw,
            "prices_per_gpu_hour": {g: req.price_table[g] for g in req.gpus}, "max_tp": req.max_tp,
            "cost_model": "roofline", "workload": req.workload, "workload_params": dict(req.workload_params),
            "num_requests": req.num_requests, "mean_prompt_tokens": round(plan.workload_means[0], 1),
            "mean_output_tokens": round(plan.workload_means[1], 1), "ttft_slo_s": s.slo.ttft_s,
            "tpot_slo_s": s.slo.tpot_s, "attainment": s.attainment, "joint": s.joint, "rate_step_rps": s.step_rps,
            "min_probe_s": s.min_probe_s, "seed": req.seed,
        },
    }


def _goodput_cell(c: FleetCandidate) -> str:
    if c.result.pruned:
        failed = [p.per_gpu_rps for p in c.result.probes if not p.met]
        return f"< {min(failed) * c.fleet.num_gpus:.2f}" if failed else "pruned"
    return (">= " if c.result.capped else "") + f"{c.goodput_rps:.2f}"


def fleet_plan_text(plan: FleetPlan) -> str:
    req, s = plan.request, plan.request.settings
    budget = " and ".join(part for part in (
        f"${req.budget.per_hour:g}/h" if req.budget.per_hour is not None else "",
        f"{req.budget.power_kw:g} kW" if req.budget.power_kw is not None else "") if part)
    lines = [f"kvbaton plan: {req.model} on {', '.join(req.gpus)} under {budget}, TTFT {s.slo.ttft_s:g} s / TPOT "
             f"{s.slo.tpot_s:g} s at {100 * s.attainment:g} %, {req.workload} (mean prompt "
             f"{plan.workload_means[0]:.0f}, output {plan.workload_means[1]:.0f} tokens)"]
    for name, c in (("best", plan.best), ("best homogeneous", plan.best_homogeneous)):
        if c is None:
            continue
        lines.append(f"{name}: {c.fleet.label} ({c.fleet.num_gpus} GPUs, ${c.price_per_hour:.2f}/h, "
                     f"{c.power_kw:.2f} kW): {c.goodput_rps:.2f} req/s, {c.result.per_gpu_rps:.3f} per GPU, "
                     f"{c.goodput_rps / c.price_per_hour:.3f} per $/h, {c.goodput_rps / c.power_kw:.3f} per kW")
        if c is plan.best and plan.best_homogeneous is plan.best:
            break
    if plan.best.goodput_rps <= 0:
        lines.append(f"  no fleet meets the SLOs at any searched rate (the lowest: {s.step_rps:g} req/s per GPU)")
    lines += [f"searched {len(plan.candidates)} fleets in {plan.search_s:.1f} s", "",
              f"{'fleet':<52} {'GPUs':>4} {'$/h':>7} {'kW':>6} {'req/s':>8} {'/GPU':>6} {'/($/h)':>7} {'/kW':>6}",
              "-" * 102]
    rows = sorted(plan.candidates, key=lambda c: (c.result.pruned, -c.goodput_rps, c.price_per_hour))
    for c in rows:
        per = "-" if c.result.pruned else None
        lines.append(f"{c.fleet.label:<52} {c.fleet.num_gpus:>4} {c.price_per_hour:>7.2f} {c.power_kw:>6.2f} "
                     f"{_goodput_cell(c):>8} {per or f'{c.result.per_gpu_rps:.3f}':>6} "
                     f"{per or f'{c.goodput_rps / c.price_per_hour:.3f}':>7} "
                     f"{per or f'{c.goodput_rps / c.power_kw:.3f}':>6}")
    return "\n".join(lines)

