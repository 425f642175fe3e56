"""One simulated worker: the real LocalScheduler, BlockPool and RadixCache, with a cost model as executor.

A step is scheduled at its start time (`start_step`, which prices it) and applied at its end
(`finish_step`), exactly as the live engine schedules, runs, then updates, through the scheduler's own
`schedule` and `update`; requests that arrive meanwhile wait for the next step. A step in which every
running request decodes comes with its context size (`decode_context_tokens`) and is priced from
that (`CostModel.decode_pricer`) without reading its chunks. Sampled tokens are
deterministic: `token_for(request_id, output_index)` (by default 100 + index mod 1000, never an
end-of-sequence id in the workloads, which run with ignore_eos and an exact output length).

With the cluster KV store (`store`: the cluster's, or this worker's own with a private store), a `StoreTier`
is the radix cache's tier past the device: new blocks are written through, prefix hits past the device are
loaded from the store, priced by `SimStoreIO` over the links all workers share (`store_links`) and charged to
the next step, serial with its compute (the step-time noise scales the whole step). Only `scheduler.schedule`
loads: its admissions bring store blocks in; a handoff is adopted into blocks its reservation holds, with no
load; any load made elsewhere waits for the next step.

A run of quiet decode steps (`LocalScheduler.quiet_decode_steps`: the same requests only decode, no block
fills or is added, nobody stops) that all end before `until` (the cluster's next lease expiry, if any) is
priced step by step at its start (each step's price and noise draw, in order) and applied whole at its end:
the scheduler appends the first m - 1 steps' tokens at once, schedules step m as it would have at step m - 1's
end and updates it as usual. The cluster hears the steps that have ended (`take_quiet`: their tokens and
heartbeats, with their times) whenever something reads the router's state mid-run, and at the run's end before
step m's update. When something outside the worker is about to change it mid-run (an arrival routed to it, a
KV handoff's message or adoption, a lease expiry), `cut_run` ends the run with the step in flight then: the
steps that ended are applied, that step is scheduled as it was, and the later steps' noise draws are kept, in
order, for the steps that follow. Every figure of the run equals the step-by-step one
(`test_sim_decode_runs`).
"""

from __future__ import annotations

import math
import random
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Callable

from kvbaton.cache.block_pool import BlockPool
from kvbaton.cache.hashing import CacheKey
from kvbaton.cache.kv_store import KVStore
from kvbaton.cache.store_prices import StorePrices
from kvbaton.cache.store_tier import StoreTier
from kvbaton.cache.radix_cache import RadixCache
from kvbaton.core.config import CacheConfig, SchedulerConfig
from kvbaton.core.request import Request
from kvbaton.core.step import SampledToken, StepPlan, StepResult
from kvbaton.router.load import WorkerStats
from kvbaton.scheduler.local_scheduler import LocalScheduler
from kvbaton.scheduler.outputs import TokenOutput
from kvbaton.sim.costs.base import CostModel
from kvbaton.sim.spec import WorkerSpec
from kvbaton.sim.store_io import SimStoreIO, StoreLinks

TokenFn = Callable[[str, int], int]  # (request id, output index) -> token id
FIRST_SIM_TOKEN = 100
_TOKENS = [SampledToken(FIRST_SIM_TOKEN + i) for i in range(1000)]
MAX_RUN_STEPS = 4096  # quiet decode steps applied at once, at most


def _recompute_pricer(cost_model: CostModel, spec: WorkerSpec, block_size: int) -> Callable[[int], float]:
    """Seconds to prefill one block at a depth (in blocks) on this worker, priced once per depth."""
    prices: dict[int, float] = {}

    def recompute_s(depth: int) -> float:
        price = prices.get(depth)
        if price is None:
            price = prices[depth] = cost_model.prefill_s(block_size, depth * block_size, spec.parallel)
        return price

    return recompute_s


def default_token(request_id: str, output_index: int) -> int:
    return FIRST_SIM_TOKEN + output_index % 1000


class SimWorker:
    def __init__(self, spec: WorkerSpec, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 cache_key: CacheKey, cost_model: CostModel, token_for: TokenFn | None = None,
                 rng: random.Random | None = None, store: KVStore | None = None,
                 store_prices: StorePrices | None = None, store_links: StoreLinks | None = None) -> None:
        self.spec = spec
        self.worker_id = spec.worker_id
        self.pool = BlockPool(cache_config.num_blocks)
        # The store's loads and saves, counted and priced (None: no store); this worker's host is the store node
        # of its id.
        self.store_io: SimStoreIO | None = None
        tier = None
        if cache_config.enable_prefix_cache and store is not None:
            assert store_prices is not None, "a store needs the prices of its links"
            self.store_io = SimStoreIO(store_prices, spec.worker_id, spec.parallel.num_gpus, store_links)
            tier = StoreTier(store, spec.worker_id, self.store_io, _recompute_pricer(cost_model, spec,
                                                                                      cache_config.block_size))
        self.cache = (RadixCache(self.pool, cache_config.block_size, tier=tier) if cache_config.enable_prefix_cache
                      else None)
        self.scheduler = LocalScheduler(scheduler_config, cache_config.block_size, self.pool, self.cache, cache_key)
        self.block_size = cache_config.block_size
        self.cost_model = cost_model
        self._decode_price = cost_model.decode_pricer(spec.parallel)  # decode_s with this worker's parallelism
        self.token_for = token_for
        # Step-time noise (cost_model.step_noise_sigma, _rho): lognormal with mean 1, from this worker's own
        # stream; its log follows a stationary AR(1) with lag-1 correlation rho (independent steps at rho 0).
        self._noise_sigma = cost_model.step_noise_sigma
        self._noise_rho = min(max(cost_model.step_noise_rho, 0.0), 0.999)
        self._noise_innovation = math.sqrt(1.0 - self._noise_rho * self._noise_rho)
        self._noise_z: float | None = None  # the standard-normal state; drawn from its stationary law at first
        self._rng = rng if self._noise_sigma > 0 else None
        self.plan: StepPlan | None = None  # the step in flight; `busy` while there is one
        self.busy = False
        self.step_s = 0.0
        self.step_end_at = 0.0  # when the step in flight ends
        # KV arrived (in adopted blocks), waiting for a running slot, FIFO: (request, computed tokens, blocks).
        self.pending_handoffs: deque[tuple[Request, int, tuple[int, ...]]] = deque()
        self.on_executed: Callable[[StepPlan, float], None] | None = None  # after the forward, before update
        self.busy_s = 0.0
        self.num_steps = 0
        self.num_quiet_steps = 0  # of which applied at once, in runs (all but each run's last)
        self.last_heartbeat_at = float("-inf")
        self.rank = 1  # where its step ends sort among simultaneous events (the cluster numbers its workers 1, 2, ...)
        # The run in flight, if the step in flight is one: its steps' end times, prices and noise factors (steps 2..m;
        # None without noise), and how many of its steps the cluster has heard of (`take_quiet`).
        self._run: tuple[list[float], list[float], list[float] | None] | None = None
        self._run_heard = 0
        # The next steps' noise factors, drawn already by a run's pricing, in the order they are used.
        self._drawn_noise: deque[float] = deque()
        self.step_seq = 0  # the cluster's number for this worker's step-end event in flight (a cut run's is stale)

    def _noise(self) -> float:
        """This step's time factor: exp(sigma * z - sigma^2 / 2), z the worker's AR(1) standard-normal state."""
        if self._drawn_noise:
            return self._drawn_noise.popleft()
        rng = self._rng
        assert rng is not None
        z = self._noise_z
        z = rng.gauss(0.0, 1.0) if z is None else self._noise_rho * z + self._noise_innovation * rng.gauss(0.0, 1.0)
        self._noise_z = z
        sigma = self._noise_sigma
        return math.exp(sigma * z - sigma * sigma / 2)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.pending_handoffs)

    def start_step(self, now: float, until: float | None = None, heartbeat_s: float = math.inf) -> float | None:
        """Schedule the next step at `now`; returns when it ends, or None if there is nothing to run. With `until`,
        a quiet decode step may start a run of them that ends before `until` (the module docstring); the time
        returned is then the run's end. A run stops at a heartbeat (due `heartbeat_s` after the last) that would
        carry radix cache events."""
        assert not self.busy, "a step is already in flight"
        scheduler = self.scheduler
        plan = scheduler.schedule(now)
        if not plan.chunks and (plan.preempted_ids or plan.finished_ids) and scheduler.has_unfinished_requests():
            plan = scheduler.schedule(now)  # the previous plan only freed memory; try again once
        if not plan.chunks:
            return None
        self.plan = plan
        context_tokens = scheduler.decode_context_tokens
        if context_tokens >= 0:  # all decodes: the same price as plan_s, without reading the chunks again
            step_s = self._decode_price(len(plan.chunks), context_tokens)
        else:
            step_s = self.cost_model.plan_s(plan, self.spec.parallel)
        if self.store_io is not None:  # the store's loads since the last step, before this one's compute
            step_s += self.store_io.take_copy_s(now)
        self.busy = True
        if self._rng is not None:
            step_s *= self._noise()
        self.step_s = step_s
        self.step_end_at = now + step_s
        if until is not None and context_tokens >= 0 and self.step_end_at < until and self.on_executed is None:
            self._plan_run(plan, context_tokens, until, heartbeat_s)
        return self.step_end_at

    def _plan_run(self, plan: StepPlan, context_tokens: int, until: float, heartbeat_s: float) -> None:
        """Price the quiet decode steps after `plan` (step 1, priced) while they end before `until`; a run of two or
        more becomes the step in flight. Step 2's end is tested before the run's limit is asked for (a pass over the
        batch), which a run cut short by `until` then never pays for."""
        if self.store_io is not None:
            return
        end = self.step_end_at
        # A heartbeat at the end of one of the run's first m - 1 steps must carry no KV events: the router would
        # apply them after other workers' later ones. The first after the run starts carries what is pending.
        last_heartbeat_at = self.last_heartbeat_at
        events_pending = self.cache is not None and self.cache.has_events
        if events_pending and end - last_heartbeat_at >= heartbeat_s:
            return
        num_seqs = len(plan.chunks)
        times = [end]
        prices = [self.step_s]
        rng = self._rng
        factors: list[float] | None = [] if rng is not None else None
        limit = MAX_RUN_STEPS
        while len(times) < limit:
            context_tokens += num_seqs
            step_s = self._decode_price(num_seqs, context_tokens)
            factor = None
            if rng is not None:
                factor = self._noise()
                step_s *= factor
            over = end + step_s >= until
            if not over and len(times) == 1:  # step 2 ends in time: how far may the run go?
                limit = self.scheduler.quiet_decode_steps(plan, MAX_RUN_STEPS)
                over = limit < 2
            if over:
                if factor is not None:
                    self._drawn_noise.appendleft(factor)  # the worker's next step, whichever it is, draws this one
                break
            end += step_s
            times.append(end)
            prices.append(step_s)
            if factors is not None:
                factors.append(factor)  # type: ignore[arg-type]
            if events_pending and end - last_heartbeat_at >= heartbeat_s:
                break
        if len(times) > 1:
            self._run = (times, prices, factors)
            self._run_heard = 0
            self.step_end_at = end

    @property
    def has_run(self) -> bool:
        """True when the step in flight is a run of quiet decode steps (`cut_run`, `take_quiet`)."""
        return self._run is not None

    def _steps_done(self, now: float, rank: int) -> int:
        """How many of the run's steps before its last have ended by an event at (`now`, `rank`): those whose end
        sorts before it, the heap's order (time, then rank; its own steps at one time in order, before its last)."""
        run = self._run
        assert run is not None
        times = run[0]
        done = bisect_right(times, now) if rank >= self.rank else bisect_left(times, now)
        return min(done, len(times) - 1)

    def take_quiet(self, now: float, rank: int) -> tuple[list[str], list[float]]:
        """The run's steps that ended by (`now`, `rank`) and the cluster has not heard of yet: their requests' ids and
        end times. The cluster hears them (their tokens and heartbeats) before anything reads the router's state."""
        run = self._run
        assert run is not None and self.plan is not None
        done = self._steps_done(now, rank)
        heard, self._run_heard = self._run_heard, max(self._run_heard, done)
        if done <= heard:
            return [], []
        return [chunk.request_id for chunk in self.plan.chunks], run[0][heard:done]

    def cut_run(self, now: float, rank: int) -> None:
        """Something outside the worker is about to change it at (`now`, `rank`) mid-run: the run ends with the step
        in flight then. The steps that ended are applied (the cluster heard them: `take_quiet` first), the step in
        flight is scheduled as it was at the previous one's end and becomes the step in flight, as if stepped one by
        one, and the later steps' noise factors go back to be drawn in order. The step's end (`step_end_at`) is then
        earlier: the cluster's event for the run's end is stale (`step_seq`)."""
        done = self._steps_done(now, rank)
        assert self._run_heard == done, "cut a run before the cluster heard its steps"
        run, self._run = self._run, None
        assert run is not None and self.plan is not None
        times, prices, factors = run
        if done:
            self.plan = self._advance_run(self.plan, times, prices, done)
        self.step_s = prices[done]
        self.step_end_at = times[done]
        if factors is not None:
            self._drawn_noise.extendleft(reversed(factors[done:]))

    def finish_step(self, now: float) -> tuple[list[TokenOutput], list[Request]]:
        """Apply the step in flight at its end time; returns its tokens and the requests that ended."""
        assert self.busy, "no step in flight"
        self.busy = False
        plan, self.plan = self.plan, None
        assert plan is not None
        if self._run is not None:
            plan = self._apply_run(plan)
        if self.on_executed is not None:
            self.on_executed(plan, now)
        outputs = self.scheduler.update(plan, self._execute(plan), now)
        self.busy_s += self.step_s
        self.num_steps += 1
        if self.pending_handoffs:
            self.admit_handoffs(now)
        return outputs, self.scheduler.take_finished()

    def _apply_run(self, plan: StepPlan) -> StepPlan:
        """The run in flight from `plan` (its step 1): its first m - 1 steps applied at once, step m scheduled as at
        step m - 1's end; returns step m's plan, which `finish_step` applies as any step."""
        run, self._run = self._run, None
        assert run is not None
        times, prices, _ = run
        num_quiet = len(times) - 1
        last = self._advance_run(plan, times, prices, num_quiet)
        self.step_s = prices[-1]
        return last

    def _advance_run(self, plan: StepPlan, times: list[float], prices: list[float], num_quiet: int) -> StepPlan:
        """Apply the first `num_quiet` steps of the run from `plan` at once; returns step num_quiet + 1's plan,
        scheduled at step num_quiet's end."""
        get = self.scheduler.requests.get
        token_for = self.token_for or default_token  # `_execute`'s tokens
        tokens: dict[str, list[int]] = {}
        for chunk in plan.chunks:
            request_id = chunk.request_id
            request = get(request_id)
            assert request is not None
            first = chunk.start_pos + 1 - len(request.prompt_token_ids)  # output index of step 1's token (`_execute`)
            tokens[request_id] = [token_for(request_id, i) for i in range(first, first + num_quiet)]
        scheduler = self.scheduler
        scheduler.advance_quiet_decodes(plan, tokens)
        for step_s in prices[:num_quiet]:
            self.busy_s += step_s
        self.num_steps += num_quiet
        self.num_quiet_steps += num_quiet
        last = scheduler.schedule(times[num_quiet - 1])
        assert len(last.chunks) == len(plan.chunks) and scheduler.decode_context_tokens >= 0, "a run changed shape"
        return last

    def take_finished(self) -> list[Request]:
        """Requests that ended outside a step (failed at scheduling time)."""
        return self.scheduler.take_finished()

    def _execute(self, plan: StepPlan) -> StepResult:
        sampled: dict[str, SampledToken] = {}
        accepted: dict[str, tuple[SampledToken, ...]] | None = None  # speculative chunks' accepted drafts, if any
        get = self.scheduler.requests.get
        token_for = self.token_for
        for chunk in plan.chunks:
            if not chunk.samples:
                continue
            request_id = chunk.request_id
            request = get(request_id)
            if request is None:
                continue  # aborted while the step ran; update() ignores its chunk
            prompt_len = len(request.prompt_token_ids)
            end_pos = chunk.start_pos + len(chunk.token_ids)
            num_drafts = end_pos - prompt_len - len(request.output_token_ids)  # past the request's tokens
            if num_drafts > 0:  # speculative decoding: the request's decode carries draft tokens
                if accepted is None:
                    accepted = {}
                sampled[request_id] = self._verify(request, chunk.token_ids[-num_drafts:], accepted)
                continue
            index = end_pos - prompt_len  # output index
            if token_for is None:
                sampled[request_id] = _TOKENS[index % 1000]
            else:
                sampled[request_id] = SampledToken(token_for(request_id, index))
        if accepted is None:
            return StepResult(plan.step_id, sampled, self.step_s)
        return StepResult(plan.step_id, sampled, self.step_s, accepted)

    def _verify(self, request: Request, drafts: tuple[int, ...], accepted: dict[str, tuple[SampledToken, ...]]
                ) -> SampledToken:
        """A greedy model's verdict on `request`'s drafts: it keeps those equal to the tokens the request outputs next
        (`token_for` knows them), in `accepted`, and samples the one after them; returns that token."""
        index = len(request.output_token_ids)  # output index of the first draft
        token_for = self.token_for
        kept: list[SampledToken] = []
        for draft in drafts:
            token = _TOKENS[(index + len(kept)) % 1000] if token_for is None else SampledToken(
                token_for(request.request_id, index + len(kept)))
            if token.token_id != draft:
                break
            kept.append(token)
        if kept:
            accepted[request.request_id] = tuple(kept)
        index += len(kept)
        return _TOKENS[index % 1000] if token_for is None else SampledToken(token_for(request.request_id, index))

    # ---- disaggregation: the decode side of a handoff ----------------------------------------------

    def can_ever_hold(self, num_tokens: int) -> bool:
        return -(-num_tokens // self.block_size) < self.pool.num_blocks

    def offer_handoff(self, request: Request, num_computed_tokens: int, block_ids: tuple[int, ...],
                      now: float) -> None:
        """The request's KV has arrived in `block_ids` (adopted from the handoff): run it now or when a slot frees."""
        self.pending_handoffs.append((request, num_computed_tokens, block_ids))
        self.admit_handoffs(now)

    def admit_handoffs(self, now: float) -> None:
        while self.pending_handoffs:
            request, num_computed, block_ids = self.pending_handoffs[0]
            if not self.scheduler.admit_prefilled(request, num_computed, now, block_ids=block_ids):
                return
            self.pending_handoffs.popleft()

    # ---- what the router hears ----------------------------------------------------------------------

    def stats(self) -> WorkerStats:
        # The figures of `scheduler.stats()` (same pool and cache), without building its full record.
        scheduler, pool = self.scheduler, self.pool
        num_cached_blocks = self.cache.num_cached_blocks if self.cache is not None else 0
        num_free_blocks = pool.num_free_blocks
        return WorkerStats(self.worker_id, scheduler.num_queued_prefill_tokens(), pool.num_blocks - num_free_blocks,
                           num_free_blocks, scheduler.num_running, scheduler.num_waiting + len(self.pending_handoffs),
                           num_cached_blocks, self.block_size)
