"""Per-GPU goodput of one placement: bisection on the request rate with the simulator, both SLOs.

A probe replays the same requests (a fixed length mix, Poisson arrivals at rate 1 rescaled to
the probed rate) through `kvbaton.sim` and checks the attainment target: TTFT and TPOT
attainment each >= target (DistServe's definition), or both at once with `joint`. Two things
keep a search fast without changing its answer:

- a probe stops as soon as more requests have missed than the target allows (the remainder
  are recorded as failed with the reason `STOPPED_REASON`), since it cannot pass any more;
- rates live on a grid (multiples of `step_rps` per GPU) and the bisection finds the largest
  grid rate that passes. Under the usual assumption that attainment falls as the rate rises,
  that answer does not depend on where the search starts, so a candidate can start at the best
  rate found so far by the other searches (`floor_rps`), and give up (`pruned`) once another
  search has passed a rate this one has seen fail — the winner is the same whatever floor a
  search gets, since nothing passes above it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kvbaton.bench.metrics import SLO, summarize
from kvbaton.bench.records import RequestRecord
from kvbaton.bench.workloads.base import WorkloadRequest
from kvbaton.core.errors import InvalidRequestError
from kvbaton.sim.run import SimSetup, simulate

STOPPED_REASON = "planner probe stopped: the attainment target was already out of reach"


@dataclass(frozen=True, slots=True)
class SearchSettings:
    slo: SLO
    attainment: float = 0.9
    joint: bool = False  # False: TTFT and TPOT attainment each >= target (DistServe); True: both at once
    step_rps: float = 0.05  # per-GPU rate grid
    max_per_gpu_rps: float = 80.0  # the search's limit (a candidate meeting it is reported as capped)
    ceiling_rps: float = 5.0  # first top of the bisection bracket, doubled while it passes (DistServe: 5)
    # A probe's arrivals span at least this long at the probed rate (the mix repeated, `lasting`), so a large fleet's
    # probe is not one burst that ends before queues build; 0: the mix as it is.
    min_probe_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.attainment <= 1 or not 0 < self.step_rps <= self.ceiling_rps <= self.max_per_gpu_rps:
            raise InvalidRequestError("need 0 < attainment <= 1 and 0 < step_rps <= ceiling_rps <= max_per_gpu_rps")
        if not (math.isfinite(self.min_probe_s) and self.min_probe_s >= 0):
            raise InvalidRequestError(f"min_probe_s must be a finite number >= 0, got {self.min_probe_s}")

    @property
    def max_steps(self) -> int:
        """The largest grid index, whose rate stays within `max_per_gpu_rps`."""
        return int(math.floor(self.max_per_gpu_rps / self.step_rps + 1e-9))


@dataclass(frozen=True, slots=True)
class Probe:
    per_gpu_rps: float
    ttft_attainment: float
    tpot_attainment: float
    slo_attainment: float
    met: bool
    stopped_early: bool


@dataclass(frozen=True, slots=True)
class GoodputResult:
    per_gpu_rps: float  # largest grid rate that met the target; 0.0 when none did (or pruned)
    pruned: bool  # known to lie below a rate another search passed; its own value not searched further
    capped: bool  # met the ceiling: the true goodput may be higher
    probes: tuple[Probe, ...]


class _Hopeless(Exception):
    """Raised from inside the simulation once the probe can no longer meet the target."""


def grid_rate(k: int, step_rps: float) -> float:
    """Grid index `k`'s rate, `k * step_rps` to 12 significant digits: no float noise (0.15, not
    0.15000000000000002), and never 0 for k >= 1, however fine the step."""
    return float(f"{k * step_rps:.12g}")


def scaled(requests: Sequence[WorkloadRequest], rate_rps: float) -> list[WorkloadRequest]:
    """The same requests with arrival times of a rate-1 process divided by `rate_rps`."""
    return [replace(r, arrival_s=r.arrival_s / rate_rps) for r in requests]


def lasting(requests: Sequence[WorkloadRequest], rate_rps: float, min_s: float) -> Sequence[WorkloadRequest]:
    """`requests` (timed at rate 1) followed by copies of themselves (new indices, so new ids; each copy's arrivals
    after the previous one's, one mean gap on) until their arrivals at `rate_rps` span `min_s` seconds; the
    requests themselves when they already do. The copies repeat the prompts: a search runs without prefix cache."""
    if min_s <= 0 or not requests or requests[-1].arrival_s >= min_s * rate_rps:
        return requests
    period_s = requests[-1].arrival_s * (1 + 1 / len(requests))
    if period_s <= 0:
        return requests
    out = list(requests)
    copy = 0
    while out[-1].arrival_s < min_s * rate_rps:
        copy += 1
        out += [replace(r, index=copy * len(requests) + r.index, arrival_s=r.arrival_s + copy * period_s)
                for r in requests]
    return out


def probe(requests: Sequence[WorkloadRequest], setup: SimSetup, num_gpus: int, per_gpu_rps: float,
          settings: SearchSettings) -> Probe:
    """Simulate `requests` (timed at rate 1) at `per_gpu_rps` x `num_gpus` and check the target (with
    `settings.min_probe_s`, on the mix repeated until it lasts that long)."""
    requests = lasting(requests, per_gpu_rps * num_gpus, settings.min_probe_s)
    slo = settings.slo
    allowed_misses = math.floor((1.0 - settings.attainment) * len(requests) + 1e-9)
    misses = {"ttft": 0, "tpot": 0, "both": 0}
    records: list[RequestRecord] = []

    def on_record(record: RequestRecord) -> None:
        records.append(record)
        ttft_ok = record.completed and record.ttft_s is not None and record.ttft_s <= slo.ttft_s
        tpot_ok = record.completed and (record.tpot_s is None or record.tpot_s <= slo.tpot_s)
        misses["ttft"] += not ttft_ok
        misses["tpot"] += not tpot_ok
        misses["both"] += not (ttft_ok and tpot_ok)
        worst = misses["both"] if settings.joint else max(misses["ttft"], misses["tpot"])
        if worst > allowed_misses:
            raise _Hopeless

    timed = scaled(requests, per_gpu_rps * num_gpus)
    stopped = False
    try:
        simulate(timed, setup, on_record=on_record)
    except _Hopeless:
        stopped = True
        seen = {r.request_id for r in records}
        records += [RequestRecord(r.request_id, r.arrival_s, status="failed", reason=STOPPED_REASON,
                                  prompt_tokens=r.num_prompt_tokens) for r in timed if r.request_id not in seen]
    o = summarize(records, slo).overall
    ttft_a, tpot_a, both_a = o.ttft_attainment or 0.0, o.tpot_attainment or 0.0, o.slo_attainment or 0.0
    met = both_a >= settings.attainment if settings.joint else min(ttft_a, tpot_a) >= settings.attainment
    return Probe(per_gpu_rps, ttft_a, tpot_a, both_a, met and not stopped, stopped)


def largest_passing(met: Callable[[int], bool], floor: int, ceiling: int, limit: int | None = None,
                    floor_now: Callable[[], int] | None = None) -> tuple[int, bool, bool]:
    """Largest grid index k in 1..limit with met(k), assuming met is monotone (true, then false).

    The bracket's top starts at `ceiling` and doubles while it passes (up to `limit`, default
    `ceiling`); then bisection. Starts from `floor` (0: nothing assumed). Returns (k, pruned,
    capped). Pruned (k = 0): the answer is known to lie below a rate another search already
    passed — met(floor) failed, or `floor_now()` (re-read before each bisection probe) reached an
    index this search saw fail. Capped: met(limit) holds. The answer of an unpruned search is the same
    whatever the floors (the bracket tops are ceiling x 2^i either way), and the overall winner is
    never pruned (nothing passes above it).
    """
    limit = max(limit or ceiling, ceiling)
    low = min(floor, limit)
    if low > 0 and not met(low):
        return 0, True, False
    high = ceiling
    while True:  # find the first failing bracket top
        if high <= low:  # known to pass already (at or under the floor)
            if high == limit:
                return limit, False, True
            high = min(high * 2, limit)
            continue
        if not met(high):  # (no pruning before: a bracket top not yet probed bounds nothing)
            break
        if high == limit:
            return limit, False, True
        low, high = high, min(high * 2, limit)
    while high - low > 1:
        if floor_now is not None and floor_now() >= high:
            return 0, True, False
        mid = (low + high) // 2
        if met(mid):
            low = mid
        else:
            high = mid
    return low, False, False


def distserve_bisection(met: Callable[[float], bool], high_rps: float = 5.0, esp_rps: float = 0.25) -> float:
    """The per-GPU rate DistServe's simulator reports (`simdistserve/simulate.py --max-per-gpu-rate 5 --esp
    0.25`, `benchmarks/search_binary.py`): plain bisection of [0, high] on the midpoints, stopping once
    high - low < esp, and the last midpoint that passed (0.0 if none). Its answer is a lower bound up to one
    bracket below the true threshold: README's "1.56" is the midpoint 1.5625 (pass at 1.25, fail at 1.875).
    """
    low, best = 0.0, 0.0
    while high_rps - low >= esp_rps:
        mid = (low + high_rps) / 2
        if met(mid):
            low = best = mid
        else:
            high_rps = mid
    return best


def search_goodput(requests: Sequence[WorkloadRequest], setup: SimSetup, num_gpus: int, settings: SearchSettings,
                   floor_rps: float = 0.0) -> GoodputResult:
    """Largest per-GPU grid rate meeting the target, by doubling brackets from the ceiling, then bisection.

    `floor_rps` (the best rate other searches passed) only prunes: the search gives up once its bracket
    top is at or under it, as it can no longer win. It never moves the probes: near its limit a simulated
    placement's pass/fail need not be monotone in the rate, so a bisection started from another search's
    floor could land elsewhere. With a fixed probe sequence and a fixed floor the result is a function of
    the inputs; the winner's (its answer is the largest rate any search passes) is never pruned.
    """
    step = settings.step_rps
    probes: list[Probe] = []

    def to_index(rate_rps: float) -> int:
        return int(math.floor(rate_rps / step + 1e-9))

    def met(k: int) -> bool:
        result = probe(requests, setup, num_gpus, grid_rate(k, step), settings)
        probes.append(result)
        return result.met

    floor = to_index(floor_rps)
    k, pruned, capped = largest_passing(met, 0, to_index(settings.ceiling_rps), settings.max_steps, lambda: floor)
    return GoodputResult(grid_rate(k, step), pruned, capped, tuple(probes))
