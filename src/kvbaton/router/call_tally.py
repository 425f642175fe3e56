"""The router's tally of the calls it routed: each worker's prefill queue and decode load as admission and adaptive
pools price them (`AdmissionPolicy`, `PoolBalancer`), in the live router and the simulator alike.

The router knows every call it routed: which worker prefills it, which decodes it, how many prompt
tokens the prefill worker must compute (uncached at routing) and how many tokens have streamed
back. From that tally it builds the policy's inputs per worker — a prefill queue (uncached tokens
of calls without a first token) and a decode load (calls streaming there, and calls still
prefilling on their way there) — for every way the cluster could serve an arriving call, and asks
`AdmissionPolicy.check_options` whether any of them meets the SLO. The tally is exact about what
the router sent and conservative about progress: a prompt counts in full until its first token.

With a `CalibratedTimeModel` the tally also closes the loop: each call's TTFT and TPOT as the router
sees them, against the uncorrected model's prediction at routing, tune the model's scales.

The same tally feeds adaptive pools (`kvbaton.router.pools`): each arrival updates both pools'
pressure, and while a worker is lent to mixed duty the arrival may go to it whole (`PoolBalancer.route`).
It is part of the placement (`kvbaton.router.placement`), which feeds it every routed call, token and end.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvbaton.router.admission import (AdmissionDecision, AdmissionPolicy, AdmissionRequest, CalibratedTimeModel,
                                      DecodeLoad, DecodeSlot, PrefillLoad, predict_decode, predict_ttft_s,
                                      queue_drain_s)
from kvbaton.transfer.source import num_due_to_reserve


@dataclass(slots=True)
class _Tracked:
    prefill_worker: str
    decode_worker: str
    num_prompt_tokens: int
    num_uncached_tokens: int  # what the prefill worker computes (the rest was cached there at routing)
    max_tokens: int
    routed_at: float = 0.0
    base_ttft_s: float = 0.0  # the uncalibrated model's TTFT and TPOT at routing (0: not calibrating)
    base_tpot_s: float = 0.0
    first_token_at: float = -1.0
    last_token_at: float = -1.0
    num_tokens_seen: int = 0
    seq: int = 0  # routing order: a prefill worker computes its queue first come, first served


def _queue_entry(tracked: _Tracked) -> tuple[int, int]:
    """A call on its prefill worker's queue: (tokens to compute, tokens of its prompt cached there)."""
    return tracked.num_uncached_tokens, tracked.num_prompt_tokens - tracked.num_uncached_tokens


class CallTally:
    def __init__(self, policy: AdmissionPolicy, block_size: int, capacity_tokens: Callable[[str], int],
                 calibration: CalibratedTimeModel | None = None, reserve_ahead_tokens: int | None = None) -> None:
        self.policy = policy
        # None: a handoff reserves its decode KV as it is routed. A number: late reservation, as the prefill workers
        # apply it (`transfer.source.num_due_to_reserve`): a call on its way holds its decode KV once the calls
        # routed to its prefill worker before it leave at most this many tokens to compute; a new call's own
        # reservation is priced at its arrival at decode, not now.
        self.reserve_ahead_tokens = reserve_ahead_tokens
        self.calibration = calibration
        self.block_size = block_size
        self._capacity_tokens = capacity_tokens  # worker -> KV tokens it can hold (from its heartbeat)
        self._calls: dict[str, _Tracked] = {}
        self._by_worker: dict[str, set[str]] = {}
        self._num_routed = 0
        self.num_rejected_by_stage: dict[str, int] = {"prefill": 0, "decode": 0}

    # -- the tally --------------------------------------------------------------------------------

    def on_routed(self, request_id: str, prefill_worker: str, decode_worker: str, num_prompt_tokens: int,
                  num_cached_tokens: int, max_tokens: int, now: float = 0.0) -> None:
        """A call placed: `prefill_worker` == `decode_worker` when one worker serves it whole."""
        uncached = max(num_prompt_tokens - num_cached_tokens, 1)
        self._num_routed += 1
        tracked = _Tracked(prefill_worker, decode_worker, num_prompt_tokens, uncached, max_tokens, now,
                           seq=self._num_routed)
        if self.calibration is not None:  # priced before the call joins the queues it is priced on
            base = self.calibration.base
            request = AdmissionRequest(request_id, num_prompt_tokens, max_tokens, num_prompt_tokens - uncached)
            tracked.base_ttft_s = predict_ttft_s(base, request, self.prefill_load(prefill_worker))
            decode = self.decode_load(decode_worker)
            tracked.base_tpot_s, _ = predict_decode(decode.decoding + decode.incoming, request,
                                                    decode.kv_capacity_tokens, base, self.policy.slo)
        self._calls[request_id] = tracked
        for worker in {prefill_worker, decode_worker}:
            self._by_worker.setdefault(worker, set()).add(request_id)

    def on_tokens(self, request_id: str, num_tokens: int, now: float = 0.0) -> None:
        tracked = self._calls.get(request_id)
        if tracked is None:
            return
        if tracked.num_tokens_seen == 0:
            tracked.first_token_at = now
            if self.calibration is not None:
                self.calibration.observe_ttft(tracked.base_ttft_s, now - tracked.routed_at)
        tracked.num_tokens_seen += num_tokens
        tracked.last_token_at = now

    def on_ended(self, request_id: str) -> None:
        tracked = self._calls.pop(request_id, None)
        if tracked is None:
            return
        if self.calibration is not None and tracked.num_tokens_seen > 1:
            tpot_s = (tracked.last_token_at - tracked.first_token_at) / (tracked.num_tokens_seen - 1)
            self.calibration.observe_tpot(tracked.base_tpot_s, tpot_s)
        for worker in {tracked.prefill_worker, tracked.decode_worker}:
            ids = self._by_worker.get(worker)
            if ids is not None:
                ids.discard(request_id)
                if not ids:
                    del self._by_worker[worker]

    @property
    def num_tracked(self) -> int:
        return len(self._calls)

    # -- per-worker loads -------------------------------------------------------------------------

    def prefill_load(self, worker: str) -> PrefillLoad:
        queue = tuple(_queue_entry(t) for _, t in self._prefilling(worker))
        return PrefillLoad(worker, sum(new_tokens for new_tokens, _ in queue), queue)

    def _prefilling(self, worker: str) -> list[tuple[str, _Tracked]]:
        """The calls `worker` still prefills (no first token yet), in routing order."""
        calls = [(r, t) for r in self._by_worker.get(worker, ())
                 if (t := self._calls[r]).prefill_worker == worker and t.num_tokens_seen == 0]
        calls.sort(key=lambda call: call[1].seq)
        return calls

    def decode_load(self, worker: str, exclude: str = "") -> DecodeLoad:
        """The calls `worker` decodes and those on their way to it, but `exclude` (a call priced joining it)."""
        decoding: list[DecodeSlot] = []
        incoming: list[DecodeSlot] = []
        arrivals_s: dict[str, dict[str, float]] = {}  # per prefill worker, computed once for all its calls
        holding: dict[str, set[str]] = {}  # per prefill worker, its calls that hold their decode KV already
        for request_id in sorted(self._by_worker.get(worker, ())):
            t = self._calls[request_id]
            if t.decode_worker != worker or request_id == exclude:
                continue
            remaining = max(t.max_tokens - t.num_tokens_seen, 0)
            if t.num_tokens_seen:
                decoding.append(DecodeSlot(t.num_prompt_tokens + t.num_tokens_seen, remaining))
            else:
                if t.prefill_worker not in arrivals_s:
                    arrivals_s[t.prefill_worker] = self._prefilled_in_s(t.prefill_worker)
                    holding[t.prefill_worker] = self._holding_kv(t.prefill_worker)
                incoming.append(DecodeSlot(t.num_prompt_tokens, remaining, arrivals_s[t.prefill_worker][request_id],
                                           holds_kv=request_id in holding[t.prefill_worker]))
        return DecodeLoad(worker, tuple(decoding), tuple(incoming), self._capacity_tokens(worker),
                          self.reserve_ahead_tokens is None)

    def _holding_kv(self, prefill_worker: str) -> set[str]:
        """The calls `prefill_worker` still prefills that hold their decode KV: all with reservation on arrival,
        else the head of its queue as `num_due_to_reserve` lets it reserve (the tokens of those ahead of each)."""
        calls = self._prefilling(prefill_worker)
        limit = self.reserve_ahead_tokens
        if limit is None:
            return {request_id for request_id, _ in calls}
        num_due = num_due_to_reserve(0, (t.num_uncached_tokens for _, t in calls), limit)
        return {request_id for request_id, _ in calls[:num_due]}

    def _prefilled_in_s(self, prefill_worker: str) -> dict[str, float]:
        """When each call `prefill_worker` still prefills should reach decode: the worker computes the uncached
        prompts routed to it before that call, then that call's (the `predicted` variant's input)."""
        model = self.policy.time_model(prefill_worker)
        arrivals_s: dict[str, float] = {}
        drained_s = 0.0
        for request_id, t in self._prefilling(prefill_worker):
            drained_s += queue_drain_s(model, (_queue_entry(t),))
            arrivals_s[request_id] = drained_s
        return arrivals_s

    # -- the decision -----------------------------------------------------------------------------

    def check(self, request_id: str, num_prompt_tokens: int, max_tokens: int, matched_blocks: Mapping[str, int],
              pairs: Sequence[tuple[str, str]], now: float) -> AdmissionDecision:
        """`pairs`: every (prefill worker, decode worker) that could serve the call; equal ids: one worker
        serves it whole. `matched_blocks`: the prompt blocks each worker holds, per the router's index."""
        options = []
        decode_loads: dict[str, DecodeLoad] = {}
        uncached = AdmissionRequest(request_id, num_prompt_tokens, max_tokens)
        for prefill_worker, decode_worker in pairs:
            request = uncached.with_cached(matched_blocks.get(prefill_worker, 0) * self.block_size)
            if decode_worker not in decode_loads:
                decode_loads[decode_worker] = self.decode_load(decode_worker)
            options.append((request, self.prefill_load(prefill_worker), decode_loads[decode_worker]))
        decision = self.policy.check_options(options, now)
        if not decision.admitted:
            stage = "prefill" if decision.reason.startswith("prefill") else "decode"
            self.num_rejected_by_stage[stage] += 1
        return decision
