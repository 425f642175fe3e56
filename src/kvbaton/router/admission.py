"""SLO-aware admission control: predict an arriving request's TTFT and TPOT and refuse early what cannot meet them.

Mooncake's three variants (seed on overload-oriented scheduling), one `AdmissionPolicy` each. Every
variant keeps the decode stage's own gate (`check_decode`, when the prefilled request reaches its
decode worker: refused if that worker is over capacity, the prefill already paid for); they differ
in what they refuse at arrival (`check_arrival`):

- `baseline`: only a prefill stage over capacity (predicted TTFT over the SLO);
- `early`: the larger of the prefill load and the decode load *as the decode worker reports it
  now* (the requests decoding there) — blind to what is still prefilling on its way there, so it
  over-admits after a dip and the decode gate throws the surplus away later;
- `predicted`: the decode load predicted for the moment the request would reach decode: requests
  admitted earlier still arrive first (FCFS prefill), decodes that will have finished by then leave
  (the worker's batch followed step by step); its KV must fit both then and now, since the handoff
  holds the prompt's blocks from arrival.

A prefill queue drains prompt by prompt (`queue_drain_s`): each prompt attends only to itself, so a
queue of long prompts is not priced as one prompt of their summed length.

A load is "predicted latency / SLO" (prefill: TTFT / ttft_s; decode: the step time with this
request added / tpot_s) or, for decode, the share of the worker's KV capacity reserved by its
requests (prompt + full output, the conservative reservation a decode worker needs to never
preempt). A stage is over capacity when its load exceeds `max_load` (1.0: exactly at the SLO).

The policy is pure: the caller (live router or simulator) passes the queue state it knows as
plain values and the time `now`; step times come from a `StageTimeModel` per worker (the sim's
cost models and a profiled live model both fit). Nothing here reads a clock or keeps state, so
the same inputs always give the same decision.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from kvbaton.core.errors import InvalidRequestError

ADMISSION_POLICIES = ("none", "baseline", "early", "predicted")


class StageTimeModel(Protocol):
    """Step times of one worker (its parallelism already bound)."""

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """One prefill of `new_tokens` on top of `cached_tokens` already in KV, alone on the worker."""
        ...

    def decode_s(self, num_seqs: int, context_tokens: int) -> float:
        """One decode step of `num_seqs` sequences attending over `context_tokens` in total."""
        ...


class CalibratedTimeModel:
    """A `StageTimeModel` corrected by what serving measures: a profile taken on an idle core misses what a
    live worker pays around its steps (the router, HTTP, other processes on the host, the handoff), so
    the router feeds back each call's measured TTFT and TPOT against this model's *uncorrected*
    prediction for it, and scales prefill and decode times by an exponential moving average of those
    ratios (bounded, so one outlier cannot blind admission)."""

    __slots__ = ("base", "smoothing", "min_scale", "max_scale", "prefill_scale", "decode_scale",
                 "num_ttft_observations", "num_tpot_observations")

    def __init__(self, base: StageTimeModel, smoothing: float = 0.2, min_scale: float = 0.25,
                 max_scale: float = 8.0) -> None:
        if not 0.0 < smoothing <= 1.0 or not 0.0 < min_scale <= 1.0 <= max_scale:
            raise InvalidRequestError(f"bad calibration settings: smoothing {smoothing}, scale in "
                                      f"[{min_scale}, {max_scale}]")
        self.base = base
        self.smoothing = smoothing
        self.min_scale = min_scale
        self.max_scale = max_scale
        self.prefill_scale = 1.0
        self.decode_scale = 1.0
        self.num_ttft_observations = 0
        self.num_tpot_observations = 0

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        return self.prefill_scale * self.base.prefill_s(new_tokens, cached_tokens)

    def decode_s(self, num_seqs: int, context_tokens: int) -> float:
        return self.decode_scale * self.base.decode_s(num_seqs, context_tokens)

    def _updated(self, scale: float, base_predicted_s: float, measured_s: float) -> float:
        ratio = min(max(measured_s / base_predicted_s, self.min_scale), self.max_scale)
        return (1.0 - self.smoothing) * scale + self.smoothing * ratio

    def observe_ttft(self, base_predicted_s: float, measured_s: float) -> None:
        """A call's first token came `measured_s` after routing; `base.prefill_s` predicted `base_predicted_s`."""
        if base_predicted_s > 0 and measured_s >= 0:
            self.prefill_scale = self._updated(self.prefill_scale, base_predicted_s, measured_s)
            self.num_ttft_observations += 1

    def observe_tpot(self, base_predicted_s: float, measured_s: float) -> None:
        """A call's mean time per output token after the first, against `base.decode_s` at its admission."""
        if base_predicted_s > 0 and measured_s >= 0:
            self.decode_scale = self._updated(self.decode_scale, base_predicted_s, measured_s)
            self.num_tpot_observations += 1


@dataclass(frozen=True, slots=True)
class AdmissionSLO:
    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0:
            raise InvalidRequestError(f"SLO targets must be positive, got ttft {self.ttft_s} tpot {self.tpot_s}")


@dataclass(frozen=True, slots=True)
class AdmissionRequest:
    request_id: str
    num_prompt_tokens: int
    num_output_tokens: int  # expected (max_tokens): prices its decode work and KV reservation
    num_cached_tokens: int = 0  # prompt tokens the chosen prefill worker already holds

    def with_cached(self, cached_tokens: int) -> AdmissionRequest:
        """This request on a worker caching `cached_tokens` of its prompt; the last prompt token is always
        computed (it yields the first output token)."""
        return replace(self, num_cached_tokens=max(0, min(cached_tokens, self.num_prompt_tokens - 1)))


@dataclass(frozen=True, slots=True)
class DecodeSlot:
    """One request on (or bound for) a decode worker, as the router tracks it."""

    num_context_tokens: int  # prompt + tokens generated so far
    num_remaining_tokens: int  # tokens still to generate
    # Incoming only: predicted seconds until its KV reaches the decode worker (its prefill queue drained);
    # None when unknown, and then `predicted` counts it there from now to the end of the horizon.
    arrives_in_s: float | None = None
    # Incoming only: its prompt's blocks are reserved on the worker already (late reservation: not before its
    # prefill worker gets close to it).
    holds_kv: bool = True


@dataclass(frozen=True, slots=True)
class PrefillLoad:
    worker_id: str
    num_queued_tokens: int  # prompt tokens admitted to the worker and not yet computed
    # The same queue prompt by prompt, first come first served: (tokens still to compute, tokens of that prompt
    # already in KV). Each prompt attends only to itself, so draining the queue costs the sum of their prefills,
    # not one prefill of the summed tokens (whose attention grows with the square of the sum). Empty when the
    # caller only knows the total; the total is then priced as one prompt.
    queue: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class DecodeLoad:
    worker_id: str
    decoding: tuple[DecodeSlot, ...]  # on the worker now (running, or KV arrived and waiting for blocks)
    incoming: tuple[DecodeSlot, ...]  # admitted, still prefilling or in transfer, bound for this worker
    kv_capacity_tokens: int  # KV tokens the worker can hold
    # True: a handoff reserves its prompt's blocks as it is admitted; False: shortly before its prefill runs.
    reserves_on_arrival: bool = True

    @property
    def num_reserved_tokens(self) -> int:
        return sum(s.num_context_tokens + s.num_remaining_tokens for s in self.decoding)


@dataclass(frozen=True, slots=True)
class AdmissionDecision:
    admitted: bool
    reason: str  # "" when admitted; else what was over capacity, for the HTTP 429 body
    predicted_ttft_s: float
    predicted_tpot_s: float  # 0.0 when the decode stage was not looked at
    prefill_load: float  # predicted TTFT / SLO
    decode_load: float  # max(step time / TPOT SLO, KV reserved / capacity); 0.0 when not looked at


def queue_drain_s(time_model: StageTimeModel, queue: Sequence[tuple[int, int]]) -> float:
    """Seconds to compute the prefills of `queue` ((new tokens, tokens already in KV) per prompt), one after
    another."""
    return sum(time_model.prefill_s(new_tokens, context_tokens) for new_tokens, context_tokens in queue
               if new_tokens > 0)


def predict_ttft_s(time_model: StageTimeModel, request: AdmissionRequest, prefill: PrefillLoad) -> float:
    """Queue drain plus this prefill: the worker computes everything ahead of it first (FCFS)."""
    new_tokens = max(request.num_prompt_tokens - request.num_cached_tokens, 1)
    if prefill.queue:
        return queue_drain_s(time_model, prefill.queue) + time_model.prefill_s(new_tokens, request.num_cached_tokens)
    return time_model.prefill_s(prefill.num_queued_tokens + new_tokens, request.num_cached_tokens)


def predict_tpot_s(slots: Sequence[DecodeSlot], request: AdmissionRequest, time_model: StageTimeModel) -> float:
    """The decode step time with `request` joining the batch `slots`."""
    context_tokens = sum(s.num_context_tokens for s in slots) + request.num_prompt_tokens
    return time_model.decode_s(len(slots) + 1, context_tokens)


def kv_share(slots: Sequence[DecodeSlot], request: AdmissionRequest, capacity_tokens: int) -> float:
    """KV reserved (prompt + full output of each of `slots` and of `request`) over the worker's capacity."""
    reserved_tokens = (sum(s.num_context_tokens + s.num_remaining_tokens for s in slots)
                       + request.num_prompt_tokens + request.num_output_tokens)
    return reserved_tokens / max(capacity_tokens, 1)


def predict_decode(slots: Sequence[DecodeSlot], request: AdmissionRequest, capacity_tokens: int,
                   time_model: StageTimeModel, slo: AdmissionSLO) -> tuple[float, float]:
    """(predicted TPOT, load) with `request` joining `slots` on one decode worker."""
    tpot_s = predict_tpot_s(slots, request, time_model)
    return tpot_s, max(tpot_s / slo.tpot_s, kv_share(slots, request, capacity_tokens))


def present_at(slots: Sequence[DecodeSlot], time_model: StageTimeModel, max_step_s: float,
               at_s: float) -> list[DecodeSlot]:
    """The slots decoding on the worker `at_s` from now, advanced by the tokens they generate by then.

    The worker's batch is followed step by step as it changes: a slot joins at the first step boundary at or
    after its `arrives_in_s` (0 for one decoding now) and leaves after `num_remaining_tokens` steps; every step
    takes the time model's decode time of the batch then, at most `max_step_s` (the TPOT admission holds it
    to). A slot whose arrival is unknown is counted in every batch but not advanced, whatever `at_s`. Runs in
    O(n log n): all present slots advance together, so a slot's end is a count of the worker's steps."""
    eps = 1e-9  # float slack on step-boundary arithmetic
    unknown = [s for s in slots if s.arrives_in_s is None]
    static_seqs = len(unknown)
    static_context = sum(s.num_context_tokens for s in unknown)
    timed = sorted((s.arrives_in_s, i) for i, s in enumerate(slots) if s.arrives_in_s is not None)
    joined_at: dict[int, int] = {}  # slot index -> the worker's step count when it joined
    ends: list[tuple[int, int]] = []  # heap of (step count at which it leaves, slot index)
    context_base = 0  # sum over active slots of (context - step count at join): context now = base + n x steps
    steps = 0
    t = 0.0
    next_arrival = 0
    while True:
        while next_arrival < len(timed) and timed[next_arrival][0] <= t + eps:
            index = timed[next_arrival][1]
            next_arrival += 1
            slot = slots[index]
            if slot.num_remaining_tokens > 0:
                joined_at[index] = steps
                heapq.heappush(ends, (steps + slot.num_remaining_tokens, index))
                context_base += slot.num_context_tokens - steps
        while ends and ends[0][0] <= steps:
            index = heapq.heappop(ends)[1]
            context_base -= slots[index].num_context_tokens - joined_at.pop(index)
        arrival_s = timed[next_arrival][0] if next_arrival < len(timed) else None
        if not ends:  # idle until the next arrival
            if arrival_s is None or arrival_s > at_s:
                break
            t = arrival_s
            continue
        num_active = len(ends)
        step_s = min(time_model.decode_s(num_active + static_seqs,
                                         context_base + num_active * steps + static_context), max_step_s)
        step_s = max(step_s, eps)
        num_steps = min(ends[0][0] - steps, math.floor((at_s - t) / step_s + eps))
        if arrival_s is not None:
            num_steps = min(num_steps, max(math.ceil((arrival_s - t) / step_s - eps), 1))
        if num_steps <= 0:
            break
        steps += num_steps
        t += num_steps * step_s
    present = []
    for index, slot in enumerate(slots):
        if slot.arrives_in_s is None:
            present.append(slot)
        elif index in joined_at:
            done = steps - joined_at[index]
            present.append(DecodeSlot(slot.num_context_tokens + done, slot.num_remaining_tokens - done, 0.0))
    return present


class AdmissionPolicy:
    """One Mooncake variant (see the module docstring); `name` is one of ADMISSION_POLICIES."""

    def __init__(self, name: str, slo: AdmissionSLO, time_models: Mapping[str, StageTimeModel],
                 max_load: float = 1.0, default_model: StageTimeModel | None = None) -> None:
        if name not in ADMISSION_POLICIES:
            raise InvalidRequestError(f"unknown admission policy {name!r}; choose from {', '.join(ADMISSION_POLICIES)}")
        if max_load <= 0:
            raise InvalidRequestError(f"max_load must be positive, got {max_load}")
        self.name = name
        self.slo = slo
        self.time_models = dict(time_models)
        self.max_load = max_load
        self.default_model = default_model  # for workers not in `time_models` (a live pool of identical workers)

    def time_model(self, worker_id: str) -> StageTimeModel:
        """The step-time model admission prices `worker_id` with."""
        return self._model(worker_id)

    def _model(self, worker_id: str) -> StageTimeModel:
        model = self.time_models.get(worker_id, self.default_model)
        if model is None:
            raise InvalidRequestError(f"admission has no step-time model for worker {worker_id!r}")
        return model

    def predict_ttft_s(self, request: AdmissionRequest, prefill: PrefillLoad) -> float:
        return predict_ttft_s(self._model(prefill.worker_id), request, prefill)

    def check_arrival(self, request: AdmissionRequest, prefill: PrefillLoad, decode: DecodeLoad | None,
                      now: float) -> AdmissionDecision:
        """Decide at arrival on the chosen prefill (or mixed) worker and, when disaggregated, decode worker."""
        ttft_s = self.predict_ttft_s(request, prefill)
        prefill_load = ttft_s / self.slo.ttft_s
        if self.name == "none":
            return AdmissionDecision(True, "", ttft_s, 0.0, prefill_load, 0.0)
        if self.name == "baseline" or decode is None:
            return self._decide(prefill_load, ttft_s, 0.0, 0.0)
        model = self._model(decode.worker_id)
        if self.name == "early":  # the decode gate's own check, applied at arrival to today's decode load
            tpot_s, decode_load = self._decode_now(request, decode)
            return self._decide(prefill_load, ttft_s, decode_load, tpot_s)
        # Predicted. The batch it joins is the one there when it arrives, a TTFT from now: decodes that end
        # before then are gone, and the requests admitted before it are there if their prefill ends first and
        # their decode has not ended by then (`present_at`).
        decoding = [replace(s, arrives_in_s=0.0) for s in decode.decoding]
        everyone = decoding + list(decode.incoming)
        present = present_at(everyone, model, self.slo.tpot_s, ttft_s)
        tpot_s = predict_tpot_s(present, request, model)
        # KV, at two moments. Now, when the handoff reserves on arrival: the prompt's blocks, next to the decodes
        # running now (which hold theirs, growing, until they end) and the prompts held for the others on their
        # way. On arrival: the full reservations of those present then, the prompts held for those still on
        # their way, and its own in full (what the decode gate checks then). Decodes that end before it arrives
        # free room for its output and, with late reservation, for its prompt too.
        held_tokens = sum(s.num_context_tokens for s in decode.incoming if s.holds_kv)
        now_tokens = (decode.num_reserved_tokens + held_tokens + request.num_prompt_tokens
                      if decode.reserves_on_arrival else 0)
        later_tokens = sum(s.num_context_tokens for s in decode.incoming
                           if s.holds_kv and s.arrives_in_s is not None and s.arrives_in_s > ttft_s)
        then_tokens = (sum(s.num_context_tokens + s.num_remaining_tokens for s in present) + later_tokens
                       + request.num_prompt_tokens + request.num_output_tokens)
        reserved = max(now_tokens, then_tokens) / max(decode.kv_capacity_tokens, 1)
        return self._decide(prefill_load, ttft_s, max(tpot_s / self.slo.tpot_s, reserved), tpot_s)

    def check_options(self, options: Sequence[tuple[AdmissionRequest, PrefillLoad, DecodeLoad | None]],
                      now: float) -> AdmissionDecision:
        """Stage-level admission before placement: admit when some option (a prefill worker with the prompt
        tokens it caches, and the decode worker it would hand to; None when it decodes itself or the
        variant ignores decode) meets the SLO; else refuse with the least loaded option's reason. Deciding on
        the best option, not on the one the placement policy will pick, keeps the router's routing state
        free of requests it then refuses."""
        if not options:
            raise InvalidRequestError("admission needs at least one serving worker to price the request on")
        decisions = [self.check_arrival(request, prefill, decode, now) for request, prefill, decode in options]
        admitted = [d for d in decisions if d.admitted]
        pool = admitted or decisions
        return min(pool, key=lambda d: max(d.prefill_load, d.decode_load))

    def check_decode(self, request: AdmissionRequest, decode: DecodeLoad, now: float) -> AdmissionDecision:
        """The decode stage's gate, when the prefilled request reaches its decode worker (every variant)."""
        if self.name == "none":
            return AdmissionDecision(True, "", 0.0, 0.0, 0.0, 0.0)
        tpot_s, decode_load = self._decode_now(request, decode)
        return self._decide(0.0, 0.0, decode_load, tpot_s)

    def _decode_now(self, request: AdmissionRequest, decode: DecodeLoad) -> tuple[float, float]:
        """(TPOT, load) of `request` joining the decode worker as it stands now: the batch decoding there, and
        KV reserved by those requests (in full) plus the prompt blocks held for the handoffs on their way
        (granted before their prefill; each checks its own growth at the gate when it arrives). Leaving the
        held blocks out lets admitted decodes outgrow the worker's KV: preemptions."""
        tpot_s = predict_tpot_s(decode.decoding, request, self._model(decode.worker_id))
        held_tokens = sum(s.num_context_tokens for s in decode.incoming if s.holds_kv)
        reserved = kv_share(decode.decoding, request, decode.kv_capacity_tokens)
        return tpot_s, max(tpot_s / self.slo.tpot_s, reserved + held_tokens / max(decode.kv_capacity_tokens, 1))

    def _decide(self, prefill_load: float, ttft_s: float, decode_load: float, tpot_s: float) -> AdmissionDecision:
        if prefill_load > self.max_load and prefill_load >= decode_load:
            reason = f"prefill over capacity: predicted TTFT {ttft_s:.3f} s > SLO {self.slo.ttft_s:g} s"
        elif decode_load > self.max_load:
            reason = (f"decode over capacity: load {decode_load:.2f} (predicted TPOT {tpot_s:.3f} s, "
                      f"SLO {self.slo.tpot_s:g} s)")
        else:
            reason = ""
        return AdmissionDecision(not reason, reason, ttft_s, tpot_s, prefill_load, decode_load)


def create_admission(name: str, slo: AdmissionSLO, time_models: Mapping[str, StageTimeModel],
                     max_load: float = 1.0, default_model: StageTimeModel | None = None) -> AdmissionPolicy | None:
    """The policy for `--admission NAME`; None for "none" (admit everything without predicting)."""
    policy = AdmissionPolicy(name, slo, time_models, max_load, default_model)
    return None if name == "none" else policy
