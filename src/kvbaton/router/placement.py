"""Where each request goes, for the live router and the simulator alike: one object from a request and what the
router knows of its workers to a decision (admit or refuse with a reason; a mixed worker, a prefill/decode pair,
a local prefill on a decode worker, or a lent worker).

`ClusterPlacement` owns the router's state (prefix index, load tracker), the placement policy, the pair
choice, the tally of routed calls with SLO admission over it, and adaptive pools. Its executor (the live
`ClusterManager`, the simulated `ClusterSim`) feeds it the same events in the same terms:

1. `add_worker` when a worker starts serving (live: at its first heartbeat), `remove_worker` when it leaves;
2. heartbeats (`on_stats`) and the workers' KV events (`on_kv_events`; on False a snapshot, `apply_snapshot`);
   with a KV store, its nodes' events too (`on_store_events`; on False `apply_store_snapshot`);
3. `place(request, now)` once per request, which returns a `Placement` (and commits it: index, load,
   tally) or a `Refusal` (committing nothing);
4. `on_tokens` as the router hears a call's tokens (the first one reaches the policy as its TTFT), and
   `on_finished` once when the call ends, whatever the end.

A placement, in order: refuse when nobody serves or too many calls wait for a first token; match the prompt's
blocks in the index once; with admission, refuse what no serving option meets its SLO with; with adaptive pools,
a worker lent to mixed duty may take the call whole; with decode workers, the pair choice (`kvbaton.router.pairs`)
picks the decode worker d and the prefill worker with the least predicted queue + prefill of what it does not
cache, unless the prompt is too short to hand off (d prefills it itself, or the mixed pool takes it) or the call
wants its prompt's logprobs (`whole`: one worker serves it); a call of one output token stays on its prefill worker
(a handoff would carry the KV of nothing left to decode); otherwise the policy picks among the mixed pool (with
no mixed worker, among every serving worker). The policy (`--policy`) thus places calls on mixed workers; pairs
are the pair choice's. Pure: no clock, no I/O, the policy's tie-breaking RNG seeded from the config; the same
events give the same decisions in both executors (`tests/router/test_placement_parity.py`).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvbaton.cache.events import KVEvent
from kvbaton.cache.kv_store import StoreEvent
from kvbaton.cache.store_directory import StoreDirectory
from kvbaton.cache.store_prices import StorePrices
from kvbaton.router.admission import AdmissionDecision, AdmissionPolicy, AdmissionRequest, CalibratedTimeModel
from kvbaton.router.base import RouteRequest, WorkerId
from kvbaton.router.call_tally import CallTally
from kvbaton.router.load import LoadTracker, WorkerStats
from kvbaton.router.pairs import DEFAULT_LOCAL_PREFILL_THRESHOLD_TOKENS, PairChoiceConfig, PairChooser
from kvbaton.router.policies import create_policy
from kvbaton.router.pools import PoolBalancer, PoolSwitch
from kvbaton.router.prefill_model import PrefillTimeModel
from kvbaton.router.state import RouterState

ROLES = ("mixed", "prefill", "decode")


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    policy: str = "least_load"  # round_robin | least_load | longest_prefix | preble
    seed: int = 0  # seeds the policy's tie-breaking
    block_size: int = 16
    max_num_waiting: int = 0  # routed calls without a first token, cluster-wide; above: refused. 0: no limit
    # Disaggregation: prompts with fewer uncached tokens than this skip the handoff (prefill where they decode).
    local_prefill_threshold_tokens: int = DEFAULT_LOCAL_PREFILL_THRESHOLD_TOKENS
    kv_bytes_per_token: int = 0  # prices transfers in the decode choice (all layers, K and V)
    # None: a handoff reserves decode KV as it is routed; a number: late (--reserve-ahead-tokens, the workers' rule)
    reserve_ahead_tokens: int | None = None
    # The cluster KV store (`kvbaton.cache.kv_store`): with its link prices the router keeps a directory of it
    # from the store nodes' events (`on_store_events`) and the `conductor` policy prices loads from it.
    store_prices: StorePrices | None = None
    store_node: str = ""  # live: the one store node every worker reads from (its host's); "": each worker's own id
    # Each store node serves only its own workers (islands: one store per node), so a load never crosses the NIC.
    store_private: bool = False
    prefill_model: PrefillTimeModel | None = None  # None: the router's default (kvbaton.router.prefill_model)
    kv_read_s_per_token: float = 0.0  # RouterState's: the running batch's KV read per step (0: unpriced)
    step_tokens: int = 2048  # the workers' token budget per step


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a call goes. `worker_id` answers it (streams every token): the mixed worker, the decode worker of a
    pair, or the worker serving it whole; `prefill_worker` is set for a pair only."""

    worker_id: WorkerId
    reason: str  # pair | local_prefill | prefill_only | pool_lent | the policy's reason (round_robin, exploit...)
    num_matched_tokens: int  # prompt tokens the index believes are cached on the worker that prefills
    prefill_worker: WorkerId = ""

    @property
    def prefiller(self) -> WorkerId:
        return self.prefill_worker or self.worker_id


@dataclass(frozen=True, slots=True)
class Refusal:
    """A call refused before placement; nothing was committed for it."""

    kind: str  # not_ready | queue_full | slo_prefill | slo_decode
    reason: str  # for the person who sent it (for slo_*, what admission found over capacity)


def kv_capacity_tokens(load: LoadTracker, worker_id: WorkerId) -> int:
    """KV tokens `worker_id` can hold, from its latest heartbeat (0 before one)."""
    stats = load.stats(worker_id)
    if stats is None:
        return 0
    return (stats.num_used_blocks + stats.num_free_blocks) * stats.block_size


@dataclass(slots=True)
class _Call:
    prefill_worker: WorkerId
    routed_at: float
    num_tokens_seen: int = 0


class ClusterPlacement:
    """See the module docstring; every method is called from the router's one thread (or the simulator's loop)."""

    def __init__(self, config: PlacementConfig, admission: AdmissionPolicy | None = None,
                 pools: PoolBalancer | None = None, policy_config: object | None = None) -> None:
        self.config = config
        self.state = RouterState(block_size=config.block_size)
        if config.prefill_model is not None:
            self.state.prefill_model = config.prefill_model
        self.state.kv_read_s_per_token, self.state.step_tokens = config.kv_read_s_per_token, config.step_tokens
        if config.store_prices is not None:
            self.state.store = StoreDirectory(private=config.store_private)
            self.state.store_prices = config.store_prices
            self.state.store_node = config.store_node
        self.policy = create_policy(config.policy, self.state, random.Random(config.seed), policy_config)
        self.pairs = PairChooser(self.state, PairChoiceConfig(config.local_prefill_threshold_tokens,
                                                              config.kv_bytes_per_token))
        self.admission = admission
        self.pools = pools
        # SLO admission and adaptive pools price over the router's own tally of routed calls; with a calibrated
        # model the tally also feeds back each call's measured TTFT and TPOT.
        pricing = admission if admission is not None else (pools.admission if pools is not None else None)
        calibration = pricing.default_model if pricing is not None else None
        load = self.state.load  # (not a bound method of self: the tally must not make a reference cycle)
        self.tally = (CallTally(pricing, config.block_size, lambda worker_id: kv_capacity_tokens(load, worker_id),
                                calibration if isinstance(calibration, CalibratedTimeModel) else None,
                                config.reserve_ahead_tokens)
                      if pricing is not None else None)
        self._roles: dict[WorkerId, str] = {}
        self._links: dict[WorkerId, str] = {}  # decode worker -> the link kind prefill workers reach it by
        self._by_role: dict[str, list[WorkerId]] | None = None  # serving workers by role, sorted; None: rebuild
        self._calls: dict[str, _Call] = {}
        self.num_waiting = 0  # calls placed and not yet given a first token nor ended
        self.last_switch: PoolSwitch | None = None  # the adaptive pools' switch the latest placement made, if any

    # -- workers -----------------------------------------------------------------------------------

    def add_worker(self, worker_id: WorkerId, role: str, link_kind: str = "shm") -> None:
        """`worker_id` serves from now on, in `role` (mixed | prefill | decode); a decode worker is reached over
        `link_kind` (shm | tcp)."""
        if role not in ROLES:
            raise ValueError(f"role {role!r} is not one of {ROLES}")
        self._roles[worker_id] = role
        if role == "decode":
            self._links[worker_id] = link_kind
        self._by_role = None

    def remove_worker(self, worker_id: WorkerId) -> None:
        """Forget a worker that left (idempotent): its index entries, load history, lent duty."""
        self._roles.pop(worker_id, None)
        self._links.pop(worker_id, None)
        self._by_role = None
        if self.pools is not None:
            self.pools.remove_worker(worker_id)
        self.policy.on_worker_removed(worker_id)

    def serving(self, role: str) -> list[WorkerId]:
        """The serving workers of `role`, sorted; callers must not mutate the list."""
        if self._by_role is None:
            by_role: dict[str, list[WorkerId]] = {}
            for worker_id in sorted(self._roles):
                by_role.setdefault(self._roles[worker_id], []).append(worker_id)
            self._by_role = by_role
        return self._by_role.get(role, [])

    @property
    def num_serving(self) -> int:
        return len(self._roles)

    def on_stats(self, stats: WorkerStats, now: float) -> None:
        self.state.load.on_stats(stats, now)

    def on_kv_events(self, worker_id: WorkerId, events: Iterable[KVEvent]) -> bool:
        """False on a sequence gap: the caller fetches the worker's snapshot and calls `apply_snapshot`."""
        return self.state.index.on_kv_events(worker_id, events)

    def apply_snapshot(self, worker_id: WorkerId, events: Iterable[KVEvent]) -> None:
        self.state.index.apply_snapshot(worker_id, events)

    def on_store_events(self, node_id: str, events: Iterable[StoreEvent]) -> bool:
        """A store node's events; False on a gap: the caller fetches its snapshot (`apply_store_snapshot`).
        Ignored (True) without a store."""
        store = self.state.store
        return True if store is None else store.on_events(node_id, events)

    def apply_store_snapshot(self, node_id: str, events: Iterable[StoreEvent]) -> None:
        if self.state.store is not None:
            self.state.store.apply_snapshot(node_id, events)

    # -- the decision ------------------------------------------------------------------------------

    def place(self, request: RouteRequest, now: float, whole: bool = False) -> Placement | Refusal:
        """Place one call (`request.num_output_tokens` is its max_tokens); see the module docstring. `whole`: one
        worker must serve it start to end (it wants its prompt's logprobs, which only its prefill sees)."""
        if not self._roles:
            return Refusal("not_ready", "no worker is serving")
        limit = self.config.max_num_waiting
        if limit and self.num_waiting >= limit:
            return Refusal("queue_full", f"too many queued requests ({self.num_waiting} waiting, limit {limit})")
        matched = self.state.index.match(request.block_hashes)
        if self.admission is not None:
            decision = self._admit(request, matched, now)
            if not decision.admitted:
                stage = "prefill" if decision.reason.startswith("prefill") else "decode"
                return Refusal(f"slo_{stage}", decision.reason)
        placement = self._choose(request, matched, now, whole)
        self._calls[request.request_id] = _Call(placement.prefill_worker, now)
        self.num_waiting += 1
        if self.tally is not None:
            prefiller = placement.prefiller
            self.tally.on_routed(request.request_id, prefiller, placement.worker_id, request.num_prompt_tokens,
                                 self.state.matched_tokens(request, matched.get(prefiller, 0)),
                                 request.num_output_tokens, now)
        return placement

    def _choose(self, request: RouteRequest, matched: Mapping[WorkerId, int], now: float,
                whole: bool) -> Placement:
        state = self.state
        decode_workers = self.serving("decode")
        prefill_workers = self.serving("prefill")
        mixed = self.serving("mixed")
        if decode_workers and self.pools is not None:
            lent = self._lent_worker(request, matched, prefill_workers, decode_workers, now)
            if lent is not None:
                num_blocks = matched.get(lent, 0)
                state.commit(request, lent, num_blocks, now)
                return Placement(lent, "pool_lent", state.matched_tokens(request, num_blocks))
        if decode_workers:
            pairs = self.pairs
            decode = pairs.choose_decode(request, {d: self._links[d] for d in decode_workers})
            if prefill_workers and not whole and pairs.worth_handing_off(request, decode, matched):
                prefill, prefill_s = pairs.choose_prefill(request, prefill_workers, matched)
                num_blocks = matched.get(prefill, 0)
                state.commit(request, prefill, num_blocks, now, prefill_s=prefill_s)
                if request.num_output_tokens <= 1:
                    return Placement(prefill, "prefill_only", state.matched_tokens(request, num_blocks))
                pairs.on_handed_off(request, decode, now)
                return Placement(decode, "pair", state.matched_tokens(request, num_blocks), prefill_worker=prefill)
            if not mixed:
                num_blocks = matched.get(decode, 0)
                state.commit(request, decode, num_blocks, now)
                return Placement(decode, "local_prefill", state.matched_tokens(request, num_blocks))
        chosen = self.policy.choose(request, mixed or prefill_workers, now, matched)
        return Placement(chosen.worker_id, chosen.reason, chosen.num_matched_tokens)

    def _admit(self, request: RouteRequest, matched: Mapping[WorkerId, int], now: float) -> AdmissionDecision:
        """Whether some serving option (a prefill worker with what it caches, and the decode worker it would
        hand to; or one worker whole) meets the SLO (`CallTally.check`)."""
        assert self.tally is not None
        prefill, decode, mixed = self.serving("prefill"), self.serving("decode"), self.serving("mixed")
        pairs = ([(p, d) for p in prefill for d in decode] + [(d, d) for d in decode if not prefill]
                 + [(w, w) for w in mixed])
        if not pairs:  # only prefill workers serve: placement runs calls whole on them, so price them so
            pairs = [(p, p) for p in prefill]
        return self.tally.check(request.request_id, request.num_prompt_tokens, request.num_output_tokens, matched,
                                pairs, now)

    def _lent_worker(self, request: RouteRequest, matched: Mapping[WorkerId, int], prefill: list[WorkerId],
                     decode: list[WorkerId], now: float) -> WorkerId | None:
        """Adaptive pools: update both pools' pressure, then the lent worker to take this call whole, if any."""
        assert self.pools is not None and self.tally is not None
        cached = {w: num_blocks * self.config.block_size for w, num_blocks in matched.items()}
        lent, self.last_switch = self.pools.route(
            AdmissionRequest(request.request_id, request.num_prompt_tokens, request.num_output_tokens), cached,
            prefill, decode, self.tally.prefill_load, self.tally.decode_load, now)
        return lent

    def check_decode(self, request_id: str, num_prompt_tokens: int, max_tokens: int, decode_worker: WorkerId,
                     now: float) -> AdmissionDecision | None:
        """The decode stage's own gate when a prefilled call's KV reaches `decode_worker` (admission's
        `check_decode` over the tally, the call itself left out); None without admission. The simulator asks as
        it adopts the KV, the live router as the call's first token comes from its decode worker."""
        if self.admission is None or self.tally is None:
            return None
        request = AdmissionRequest(request_id, num_prompt_tokens, max_tokens)
        return self.admission.check_decode(request, self.tally.decode_load(decode_worker, exclude=request_id), now)

    # -- the call's life ---------------------------------------------------------------------------

    @property
    def tracks_tokens(self) -> bool:
        """True when every token the router hears matters (`on_tokens` after the first): admission or pools."""
        return self.tally is not None

    def on_tokens(self, request_id: str, num_tokens: int, now: float) -> None:
        """The router heard `num_tokens` more of a call's tokens (unknown ids are ignored)."""
        call = self._calls.get(request_id)
        if call is None or num_tokens <= 0:
            return
        if call.num_tokens_seen == 0:
            self.num_waiting -= 1
            self.policy.on_first_token(request_id, now - call.routed_at, now)
        call.num_tokens_seen += num_tokens
        if self.tally is not None:
            self.tally.on_tokens(request_id, num_tokens, now)

    def on_finished(self, request_id: str, now: float) -> None:
        """The call ended, whatever the end (idempotent)."""
        call = self._calls.pop(request_id, None)
        if call is None:
            return
        if call.num_tokens_seen == 0:
            self.num_waiting -= 1
        if self.tally is not None:
            self.tally.on_ended(request_id)
        self.policy.on_finished(request_id, now)

    def num_tokens_seen(self, request_id: str) -> int:
        call = self._calls.get(request_id)
        return 0 if call is None else call.num_tokens_seen

    def check_invariants(self) -> None:
        assert self.num_waiting == sum(1 for c in self._calls.values() if c.num_tokens_seen == 0)
        assert set(self._links) <= set(self._roles)
        if self.tally is not None:
            assert self.tally.num_tracked == len(self._calls)
        self.state.load.check_invariants()
