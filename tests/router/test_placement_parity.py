"""One placement for both executors: what the simulator's placement decided, the live router decides from the same
requests and worker states, for mixed, disaggregated and combined pools, with admission and adaptive pools.

A simulated run records every event its `ClusterPlacement` hears (a worker joining, heartbeats, KV events, each
placement, tokens, ends). The same events are then replayed into a live `ClusterManager` the way its workers would
send them (register, `Stats` and `KVEvents` messages, token deltas, calls submitted with the prompt's token ids),
its clock set to each event's time, and every call must land where the simulator placed it (or be refused for the
same reason). The live manager builds its own placement from its `ClusterConfig`, hashes the prompts itself
and converts the wire messages: a difference anywhere in that path shows here as a different decision.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from kvbaton.bench.workloads import create_workload
from kvbaton.bench.workloads.base import WorkloadRequest
from kvbaton.core.sampling import SamplingParams
from kvbaton.router.admission import create_admission
from kvbaton.router.load import WorkerStats
from kvbaton.router.placement import ClusterPlacement, Placement, Refusal
from kvbaton.router.pools import PoolBalancer, PoolConfig
from kvbaton.server import rpc
from kvbaton.server.base import GenerateCall, RejectedError, TokenDelta
from kvbaton.server.cluster import ClusterConfig, ClusterManager
from kvbaton.sim.cluster import ClusterSim
from kvbaton.sim.prompts import SimPrompts
from kvbaton.sim.run import SimSetup, build_sim

pytestmark = pytest.mark.timeout(240)


@dataclass
class _Event:
    kind: str  # add | stats | kv | place | tokens | finished
    now: float
    args: tuple[Any, ...]
    result: object = None


def _record(sim: ClusterSim) -> list[_Event]:
    """Wrap the sim's placement so that every call into it is logged (with `place`'s answer)."""
    placement = sim.placement
    events: list[_Event] = []
    clock = lambda: sim.now  # noqa: E731

    def logged(kind: str, method: Callable[..., Any], now_arg: int | None) -> Callable[..., Any]:
        def wrapper(*args: Any) -> Any:
            result = method(*args)
            now = args[now_arg] if now_arg is not None else clock()
            events.append(_Event(kind, now, args, result))
            return result
        return wrapper

    placement.add_worker = logged("add", placement.add_worker, None)  # type: ignore[method-assign]
    placement.on_stats = logged("stats", placement.on_stats, 1)  # type: ignore[method-assign]
    placement.on_kv_events = logged(  # type: ignore[method-assign]
        "kv", lambda worker_id, batch: ClusterPlacement.on_kv_events(placement, worker_id, list(batch)), None)
    placement.place = logged("place", placement.place, 1)  # type: ignore[method-assign]
    placement.on_tokens = logged("tokens", placement.on_tokens, 2)  # type: ignore[method-assign]
    placement.on_finished = logged("finished", placement.on_finished, 1)  # type: ignore[method-assign]
    placement.check_decode = logged("check_decode", placement.check_decode, 4)  # type: ignore[method-assign]

    def no_snapshot(*args: Any) -> None:
        raise AssertionError("the simulator's KV events had a gap: replay it with a snapshot")
    placement.apply_snapshot = no_snapshot  # type: ignore[method-assign]
    return events


class _Socket:
    """The router socket as the manager uses it; snapshot requests would desynchronise the replay."""

    def send(self, worker_id: str, message: rpc.Message) -> None:
        assert not isinstance(message, rpc.SnapshotRequest), "the live router asked a snapshot the sim never did"


def _replay(events: list[_Event], setup: SimSetup, sim: ClusterSim,
            requests: list[WorkloadRequest]) -> list[tuple[str, object]]:
    """Feed `events` to a live ClusterManager as its workers and clients would; returns each call's decision."""
    now = [0.0]
    cost_model = sim.cost_model
    config = ClusterConfig(model_name="sim", policy=setup.policy, block_size=setup.block_size, seed=setup.seed,
                           max_num_waiting=setup.max_num_waiting,
                           local_prefill_threshold_tokens=setup.local_prefill_threshold_tokens,
                           kv_bytes_per_token=cost_model.kv_bytes_per_token,
                           reserve_ahead_tokens=setup.reserve_ahead_tokens)
    live = ClusterManager(config, clock=lambda: now[0], admission=_fresh(sim.placement.admission, sim),
                          pools=_fresh_pools(sim.placement.pools, sim))
    live.pool.socket = _Socket()  # type: ignore[assignment]
    roles = {w.worker_id: w.spec.role for w in sim.workers.values()}
    prompts = SimPrompts(sim.config.cache_key, setup.block_size)
    by_id = {r.request_id: r for r in requests}
    registered: set[str] = set()
    decisions: list[tuple[str, object]] = []
    first_heard: set[str] = set()  # handed-off calls whose first token reached the live router with the gate
    for event in events:
        now[0] = event.now
        if event.kind == "add":
            continue  # the live router adds a worker at its first heartbeat, which comes next
        if event.kind == "stats":
            stats: WorkerStats = event.args[0]
            if stats.worker_id not in registered:
                registered.add(stats.worker_id)
                role = roles[stats.worker_id]
                live.pool.handle(stats.worker_id, rpc.Register(
                    stats.worker_id, role, "sim", sim.config.cache_key.model_revision, sim.config.cache_key.kv_layout,
                    setup.block_size, 64, "", 1, kv_address=f"{sim.spec.link}://sim:1" if role == "decode" else ""))
            live.pool.handle(stats.worker_id, rpc.Stats(
                stats.worker_id, stats.num_waiting, stats.num_running, stats.num_queued_prefill_tokens,
                stats.num_used_blocks, stats.num_free_blocks, stats.num_cached_blocks, 0, 0, 0, 0, event.now))
        elif event.kind == "kv":
            worker_id, batch = event.args
            live.pool.handle(worker_id, rpc.KVEvents(worker_id, tuple(e.to_wire() for e in batch)))
        elif event.kind == "place":
            route = event.args[0]
            wr = by_id[route.request_id]
            call = GenerateCall(route.request_id, tuple(prompts.ids(wr)),
                                SamplingParams(max_tokens=wr.output_tokens, temperature=0.0, ignore_eos=True),
                                arrival_at=event.now, tenant=wr.tenant)
            try:
                live.submit(call, lambda delta: None)
            except RejectedError as exc:
                decisions.append((route.request_id, ("refused", exc.status_code, str(exc))))
                continue
            entry = live._calls[route.request_id]
            decisions.append((route.request_id, (entry.worker_id, entry.prefill_worker)))
        elif event.kind == "check_decode":  # the KV reached the decode worker: it streams the first token
            request_id = event.args[0]
            entry = live._calls[request_id]
            live._on_delta(TokenDelta(request_id, (7,), "", False, worker_id=entry.worker_id))
            refused = event.result is not None and not event.result.admitted  # type: ignore[attr-defined]
            assert (request_id not in live._calls) == refused, request_id  # the live gate decided alike
            decisions.append((request_id, ("at decode", refused)))
            first_heard.add(request_id)
        elif event.kind == "tokens":
            request_id, num_tokens, _ = event.args
            if request_id in first_heard:  # the sim's on_tokens for that first token: the delta above was it
                first_heard.discard(request_id)
                continue
            entry = live._calls[request_id]
            live._on_delta(TokenDelta(request_id, (7,) * num_tokens, "", False, worker_id=entry.worker_id))
        elif event.kind == "finished":
            request_id = event.args[0]
            entry = live._calls.get(request_id)
            if entry is not None:
                live._on_delta(TokenDelta(request_id, (), "", True, "stop", worker_id=entry.worker_id))
    live.placement.check_invariants()
    assert live.placement.num_waiting == 0 and not live._calls
    return decisions


def _fresh(admission: object, sim: ClusterSim) -> object:
    """A second admission policy like the simulator's (the live router must not share the sim's objects)."""
    if admission is None:
        return None
    return create_admission(admission.name, admission.slo, admission.time_models,  # type: ignore[attr-defined]
                            admission.max_load)  # type: ignore[attr-defined]


def _fresh_pools(pools: PoolBalancer | None, sim: ClusterSim) -> PoolBalancer | None:
    if pools is None:
        return None
    return PoolBalancer(pools.admission.slo, pools.admission.time_models, config=pools.config)


def _sim_decisions(events: list[_Event]) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    for event in events:
        if event.kind == "check_decode":
            refused = event.result is not None and not event.result.admitted  # type: ignore[attr-defined]
            out.append((event.args[0], ("at decode", refused)))
        if event.kind != "place":
            continue
        decision = event.result
        if isinstance(decision, Refusal):
            out.append((event.args[0].request_id, decision))
        else:
            assert isinstance(decision, Placement)
            out.append((event.args[0].request_id, (decision.worker_id, decision.prefill_worker)))
    return out


def _run_both(requests: list[WorkloadRequest],
              setup: SimSetup) -> tuple[list[tuple[str, object]], list[tuple[str, object]], set[str]]:
    sim, _, _ = build_sim(setup)
    events = _record(sim)
    sim.run(requests)
    simulated = _sim_decisions(events)
    live = _replay(events, setup, sim, requests)
    sim.close()
    reasons = {d.reason for e in events if e.kind == "place" and isinstance(d := e.result, Placement)}
    return simulated, live, reasons


def _same(simulated: list[tuple[str, object]], live: list[tuple[str, object]]) -> None:
    assert [r for r, _ in simulated] == [r for r, _ in live]
    for (request_id, sim_decision), (_, live_decision) in zip(simulated, live):
        if isinstance(sim_decision, Refusal):
            assert isinstance(live_decision, tuple) and live_decision[0] == "refused", (request_id, live_decision)
            assert live_decision[1] == 429 and sim_decision.reason in live_decision[2], (request_id, live_decision)
        else:
            assert live_decision == sim_decision, request_id


def test_mixed_pool_preble_with_evictions() -> None:
    requests = create_workload("tool-use", num_requests=120, seed=5, rate=60.0, num_tools=6)
    simulated, live, reasons = _run_both(requests, SimSetup(cluster="3xmixed", policy="preble", num_blocks=400,
                                                            max_model_len=8192))
    _same(simulated, live)
    assert {"exploit", "explore"} <= reasons


def test_disaggregated_pools_with_short_prompts_and_one_token_calls() -> None:
    requests = create_workload("sharegpt-like", num_requests=150, seed=2, rate=30.0, prompt_mean_tokens=120,
                               prompt_std_tokens=100, output_mean_tokens=4, output_std_tokens=6)
    simulated, live, reasons = _run_both(requests, SimSetup(cluster="2P2D", policy="round_robin"))
    _same(simulated, live)
    assert {"pair", "local_prefill", "prefill_only"} <= reasons


def test_combined_pools_send_short_prompts_to_the_mixed_workers() -> None:
    requests = create_workload("sharegpt-like", num_requests=150, seed=4, rate=30.0, prompt_mean_tokens=150,
                               prompt_std_tokens=120, output_mean_tokens=16, output_std_tokens=8)
    simulated, live, reasons = _run_both(requests, SimSetup(cluster="2xmixed+1P2D", policy="least_load"))
    _same(simulated, live)
    assert {"pair", "least_load"} <= reasons


def test_admission_and_queue_limit_refuse_the_same_calls() -> None:
    requests = create_workload("sharegpt-like", num_requests=200, seed=1, rate=400.0, prompt_mean_tokens=2000,
                               prompt_std_tokens=500, output_mean_tokens=8, output_std_tokens=4)
    setup = SimSetup(cluster="2xmixed", policy="least_load", admission="baseline", admission_slo=(1.0, 1.0),
                     max_num_waiting=40)
    simulated, live, _ = _run_both(requests, setup)
    _same(simulated, live)
    kinds = {d.kind for _, d in simulated if isinstance(d, Refusal)}
    assert {"slo_prefill", "queue_full"} <= kinds


def test_adaptive_pools_lend_the_same_workers() -> None:
    requests = create_workload("shifting-mix", num_requests=200, seed=0, rate=40.0, shift_fraction=0.2,
                               second_output_mean_tokens=400)
    setup = SimSetup(cluster="3P1D", gpu="a100", enable_prefix_cache=False, admission_slo=(1.0, 0.012),
                     adaptive_pools=True, pools=PoolConfig(sustain_s=0.3, cooldown_s=0.5, max_lent_per_pool=2))
    simulated, live, reasons = _run_both(requests, setup)
    _same(simulated, live)
    assert "pool_lent" in reasons


@pytest.mark.parametrize(("reserve_ahead_tokens", "tpot_slo_s"), [(None, 0.03), (2048, 0.015)])
def test_the_decode_stage_gate_refuses_the_same_prefilled_calls(reserve_ahead_tokens: int | None,
                                                                 tpot_slo_s: float) -> None:
    rows = create_workload("mooncake", num_requests=120, rate=10.0 if reserve_ahead_tokens is None else 20.0)
    requests = [r for r in rows if r.num_prompt_tokens + r.output_tokens <= 32768]
    setup = SimSetup(cluster="4P1D:link=nvlink-a100", model="mistral-7b", gpu="a100", enable_prefix_cache=False,
                     admission="baseline", admission_slo=(30.0, tpot_slo_s), max_model_len=32768,
                     reserve_ahead_tokens=reserve_ahead_tokens)
    simulated, live, _ = _run_both(requests, setup)
    _same(simulated, live)
    gated = [refused for _, d in simulated if isinstance(d, tuple) and d[0] == "at decode" for refused in d[1:]]
    assert True in gated and False in gated
