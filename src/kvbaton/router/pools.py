"""Adaptive pools: lend a worker of the idle pool to mixed duty while the other pool queues (Splitwise's mixed
pool, P/D-Serve's dynamic ratio).

A disaggregated cluster is sized for one prompt/output mix; when the mix shifts (long prompts -> long
outputs) one pool queues while the other idles. `PoolBalancer` watches each pool's pressure — the
least loaded worker's predicted latency over its SLO, from the same `StageTimeModel` and queue view
as admission (`kvbaton.router.admission`) — and, when one pool stays over `high_pressure` for
`sustain_s` while the other stays under `low_pressure`, lends the least loaded worker of the idle
pool to mixed duty: the router may then send it whole requests (it prefills and decodes them itself,
as every worker can), but only when that option's predicted latency beats the disaggregated pair's
(`choose`). A lent worker keeps its own role's work, so lending never empties a pool; at most
`max_lent_per_pool` of a pool's workers are lent at once. It returns when the pool it helps has
stayed under `low_pressure` for `sustain_s`, or at once when its own pool comes under pressure. One
switch per `cooldown_s`.

Pure policy: time comes in as `now`, ties break by worker id, and the same inputs give the same
decisions in the live router and in the simulator.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from kvbaton.core.errors import InvalidRequestError
from kvbaton.router.admission import (AdmissionPolicy, AdmissionRequest, AdmissionSLO, DecodeLoad, PrefillLoad,
                                      StageTimeModel)


@dataclass(frozen=True, slots=True)
class PoolConfig:
    high_pressure: float = 1.0  # a pool queues: its least loaded worker's predicted latency over the SLO
    low_pressure: float = 0.7  # a pool idles (a decode step's fixed cost alone is a good part of a TPOT SLO)
    sustain_s: float = 2.0  # a condition must hold this long before a switch
    cooldown_s: float = 5.0  # at least this long between two switches
    max_lent_per_pool: int = 1

    def __post_init__(self) -> None:
        if not 0 < self.low_pressure < self.high_pressure:
            raise InvalidRequestError(f"need 0 < low_pressure < high_pressure, got {self.low_pressure}, "
                                      f"{self.high_pressure}")
        if self.sustain_s < 0 or self.cooldown_s < 0 or self.max_lent_per_pool < 1:
            raise InvalidRequestError("sustain_s and cooldown_s must be >= 0 and max_lent_per_pool >= 1")


@dataclass(frozen=True, slots=True)
class PoolSwitch:
    """A change of duty: `lent` True when `worker_id` starts taking whole requests, False when it returns."""

    at_s: float
    worker_id: str
    role: str  # its home pool: "prefill" | "decode"
    lent: bool
    reason: str


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one request goes: a pair (prefill != decode) or one worker serving it whole."""

    prefill_worker: str
    decode_worker: str

    @property
    def whole(self) -> bool:
        return self.prefill_worker == self.decode_worker


class PoolBalancer:
    def __init__(self, slo: AdmissionSLO, time_models: Mapping[str, StageTimeModel],
                 default_model: StageTimeModel | None = None, config: PoolConfig = PoolConfig()) -> None:
        # Prices pools and options the way `predicted` admission does: decode load when the request gets there.
        self.admission = AdmissionPolicy("predicted", slo, time_models, default_model=default_model)
        self.config = config
        self.lent: dict[str, str] = {}  # worker id -> home role, for workers on mixed duty
        self.switches: list[PoolSwitch] = []
        self._since: dict[str, float] = {}  # condition name -> when it started holding
        self._last_switch_s = float("-inf")

    # -- pressure --------------------------------------------------------------------------------

    def prefill_pressure(self, request: AdmissionRequest, loads: Sequence[PrefillLoad]) -> float:
        """The least loaded prefill worker's predicted TTFT for `request`, over the TTFT SLO."""
        if not loads:
            return 0.0
        return min(self.admission.predict_ttft_s(request, load) for load in loads) / self.admission.slo.ttft_s

    def decode_pressure(self, request: AdmissionRequest, loads: Sequence[DecodeLoad]) -> float:
        """The least loaded decode worker's load (TPOT over its SLO, or KV reserved over capacity) with
        `request` joining it and the requests on their way there (still prefilling) counted as decoding."""
        if not loads:
            return 0.0
        return min(self.admission.check_decode(request, replace(load, decoding=load.decoding + load.incoming,
                                                                incoming=()), 0.0).decode_load
                   for load in loads)

    # -- switching -------------------------------------------------------------------------------

    def observe(self, now: float, prefill_pressure: float, decode_pressure: float,
                idle_by_role: Mapping[str, Sequence[str]]) -> PoolSwitch | None:
        """Feed both pools' pressure at `now`; `idle_by_role` lists each pool's workers, least loaded first.
        Returns the switch made now, if any (also kept in `switches`)."""
        cfg = self.config
        pressure = {"prefill": prefill_pressure, "decode": decode_pressure}
        conditions = {}
        for busy, idle in (("prefill", "decode"), ("decode", "prefill")):
            conditions[f"lend:{idle}"] = pressure[busy] > cfg.high_pressure and pressure[idle] < cfg.low_pressure
            conditions[f"calm:{busy}"] = pressure[busy] < cfg.low_pressure
        for name, holds in conditions.items():
            if not holds:
                self._since.pop(name, None)
            else:
                self._since.setdefault(name, now)
        # A lent worker whose own pool is under pressure goes home at once (its role's work comes first).
        for worker_id, role in sorted(self.lent.items()):
            if pressure[role] > cfg.high_pressure:
                return self._switch(now, worker_id, role, False, f"its {role} pool is under pressure")
        if now - self._last_switch_s < cfg.cooldown_s:
            return None
        for worker_id, role in sorted(self.lent.items()):
            helped = "decode" if role == "prefill" else "prefill"
            if self._held(f"calm:{helped}", now):
                return self._switch(now, worker_id, role, False, f"the {helped} pool is calm again")
        for idle in ("decode", "prefill"):
            if not self._held(f"lend:{idle}", now):
                continue
            candidates = [w for w in idle_by_role.get(idle, ()) if w not in self.lent]
            num_lent = sum(role == idle for role in self.lent.values())
            if candidates and num_lent < cfg.max_lent_per_pool:
                busy = "prefill" if idle == "decode" else "decode"
                return self._switch(now, candidates[0], idle, True, f"the {busy} pool queues while {idle} idles")
        return None

    def _held(self, condition: str, now: float) -> bool:
        since = self._since.get(condition)
        return since is not None and now - since >= self.config.sustain_s

    def _switch(self, now: float, worker_id: str, role: str, lent: bool, reason: str) -> PoolSwitch:
        if lent:
            self.lent[worker_id] = role
        else:
            self.lent.pop(worker_id, None)
        self._last_switch_s = now
        self._since.clear()  # conditions restart: the switch changed the pools
        switch = PoolSwitch(now, worker_id, role, lent, reason)
        self.switches.append(switch)
        return switch

    def remove_worker(self, worker_id: str) -> None:
        self.lent.pop(worker_id, None)

    # -- routing ---------------------------------------------------------------------------------

    def choose(self, options: Sequence[tuple[Placement, AdmissionRequest, PrefillLoad, DecodeLoad]],
               now: float) -> Placement:
        """The option with the lowest predicted latency over SLO (max of its TTFT and decode loads); ties go
        to the earlier one. `options`: the router's disaggregated pair first, then each lent worker whole."""
        if not options:
            raise InvalidRequestError("choose needs at least the disaggregated pair")
        scores = [self.score(request, prefill, decode, now) for _, request, prefill, decode in options]
        return options[min(range(len(options)), key=lambda i: (scores[i], i))][0]

    def route(self, request: AdmissionRequest, cached_tokens: Mapping[str, int], prefill_workers: Sequence[str],
              decode_workers: Sequence[str], prefill_load: Callable[[str], PrefillLoad],
              decode_load: Callable[[str], DecodeLoad], now: float) -> tuple[str | None, PoolSwitch | None]:
        """One arrival: update both pools' pressure (maybe switching a worker), then pick the lent worker to
        serve `request` whole, or None for the disaggregated pair. The pair is priced on its best prefill
        worker (least predicted TTFT, with the prompt tokens each caches: `cached_tokens`) and best decode
        worker; the router's own pair choice may differ, never by much. Returns (lent worker, switch)."""
        if not prefill_workers or not decode_workers:
            return None, None
        prefills = {w: prefill_load(w) for w in prefill_workers}
        decodes = {w: decode_load(w) for w in decode_workers}

        def with_cache(worker: str) -> AdmissionRequest:
            return request.with_cached(cached_tokens.get(worker, 0))

        ttft_s = {w: self.admission.predict_ttft_s(with_cache(w), load) for w, load in prefills.items()}
        decode_loads = {w: self.decode_pressure(request, [load]) for w, load in decodes.items()}
        by_prefill = sorted(prefills, key=lambda w: (ttft_s[w], w))
        by_decode = sorted(decodes, key=lambda w: (decode_loads[w], w))
        switch = self.observe(now, ttft_s[by_prefill[0]] / self.admission.slo.ttft_s, decode_loads[by_decode[0]],
                              {"prefill": by_prefill, "decode": by_decode})
        lent = [w for w in sorted(self.lent) if w in prefills or w in decodes]
        if not lent:
            return None, switch
        pair = Placement(by_prefill[0], by_decode[0])
        options = [(pair, with_cache(pair.prefill_worker), prefills[pair.prefill_worker], decodes[pair.decode_worker])]
        for worker in lent:
            own_prefill = prefills[worker] if worker in prefills else prefill_load(worker)
            own_decode = decodes[worker] if worker in decodes else decode_load(worker)
            options.append((Placement(worker, worker), with_cache(worker), own_prefill, own_decode))
        chosen = self.choose(options, now)
        return (chosen.prefill_worker if chosen.whole else None), switch

    def score(self, request: AdmissionRequest, prefill: PrefillLoad, decode: DecodeLoad, now: float) -> float:
        decision = self.admission.check_arrival(request, prefill, decode, now)
        return max(decision.prefill_load, decision.decode_load)
