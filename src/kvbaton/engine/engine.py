"""The engine loop of one worker: schedule -> run one mixed batch -> update -> emit outputs.

It owns the request lifecycle on the live side: validation at ingress, detokenization and stop
strings (which need text, so they live here and not in the scheduler), and a final output for
every request however it ends.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvbaton.cache.block_pool import BlockPool
from kvbaton.cache.hashing import CacheKey
from kvbaton.cache.radix_cache import RadixCache
from kvbaton.core.config import EngineConfig
from kvbaton.core.errors import InvalidRequestError, KvbatonError
from kvbaton.core.request import FinishReason, Request
from kvbaton.core.sampling import SamplingParams
from kvbaton.core.step import SampledToken, StepPlan, StepResult, TokenDelta
from kvbaton.engine.kv_storage import KVStorage
from kvbaton.engine.model_runner import ModelRunner, PromptLogprobsWanted
from kvbaton.engine.rank_group import RankFailedError, RankGroup
from kvbaton.engine.sampler import Sampler
from kvbaton.engine.store_io import StoreLink, WorkerStoreIO
from kvbaton.engine.store_loads import StoreLoads
from kvbaton.model.registry import LoadedModel, load_model, load_model_front
from kvbaton.model.sharding import check_parallelism
from kvbaton.model.tokenizer import IncrementalDetokenizer
from kvbaton.scheduler.local_scheduler import LocalScheduler
from kvbaton.scheduler.outputs import SchedulerStats
from kvbaton.transfer.layout import KVLayout
from kvbaton.transfer.transport_shm import ShmKVRegion

if TYPE_CHECKING:
    from kvbaton.engine.structured import RequestGrammar


@dataclass(slots=True)
class _Tracked:
    request: Request
    detokenizer: IncrementalDetokenizer
    text: str = ""  # all output text so far (after stop-string truncation)
    num_emitted_chars: int = 0
    stop_floor: int = 0  # a stop string may only start here or later (the text of the first min_tokens is kept)
    grammar: RequestGrammar | None = None  # structured output: has consumed exactly the request's output tokens
    prompt_logprobs: list[SampledToken] | None = None  # collected so far, when the request asks for them


# How long a step with only store loads in flight waits for the first to finish, the GIL let go (rather than step
# empty in a loop while the store IO thread waits for the interpreter): a load's end is noticed at once, a new
# request or an abort at most this late.
LOAD_WAIT_S = 0.002


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 clock: Callable[[], float] = time.monotonic, kv_cache: torch.Tensor | None = None,
                 kv_region: ShmKVRegion | None = None, warm_up_rows: int = 0,
                 create_store_link: Callable[[], StoreLink] | None = None) -> None:
        """With `config.num_ranks > 1` the model runs in rank processes (`RankGroup`) over a shared KV region:
        `kv_region` when given (a decode worker's), else one of its own; `loaded` then needs no weights
        (`load_model_front`) and `warm_up_rows` is passed to the ranks' linears' warm-up.
        `create_store_link`: a connection to this host's KV store node (built on the store IO thread), the tier past
        the KV pool: write-through of new blocks, prefix loads before admission."""
        self.config = config
        if loaded is None:
            loaded = (load_model_front(config.model, config.dtype) if config.num_ranks > 1
                      else load_model(config.model, config.dtype, config.device))
        self.loaded = loaded
        model_config = self.loaded.config
        self.max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                                 model_config.max_position_embeddings)
        cache_cfg = config.cache
        dtype_name = str(self.loaded.dtype).removeprefix("torch.")
        self.kv_layout = model_config.kv_layout_id(dtype_name, cache_cfg.block_size)
        self.cache_key = CacheKey(self.loaded.revision, self.kv_layout)
        self.pool = BlockPool(cache_cfg.num_blocks)
        self.ranks: RankGroup | None = None
        if config.num_ranks > 1:
            check_parallelism(model_config, config.tensor_parallel_size, config.pipeline_parallel_size)
            layout = KVLayout(self.loaded.revision, dtype_name, cache_cfg.block_size, model_config.num_layers,
                              model_config.num_kv_heads, model_config.head_dim, config.tensor_parallel_size,
                              config.pipeline_parallel_size)
            self.ranks = RankGroup(config.model, dtype_name, self.loaded.revision, layout, cache_cfg.num_blocks,
                                   config.tensor_parallel_size, config.pipeline_parallel_size, region=kv_region,
                                   device=config.device, num_threads=config.rank_num_threads,
                                   warm_up_rows=warm_up_rows)
            kv_cache = self.ranks.kv_cache
        elif kv_region is not None:
            kv_cache = kv_region.torch_view()  # type: ignore[assignment]
        self.storage = KVStorage(model_config, cache_cfg.num_blocks, cache_cfg.block_size, self.loaded.dtype,
                                 config.device, kv_cache)
        if create_store_link is not None and not cache_cfg.enable_prefix_cache:
            raise InvalidRequestError("the KV store needs the prefix cache")
        # The KV store past the KV pool (cache.tier): write-through of new blocks, prefix loads before admission.
        self.store_io = (WorkerStoreIO(self.storage.kv_cache, create_store_link) if create_store_link is not None
                         else None)
        tier = self.store_io
        self.prefix_cache = (RadixCache(self.pool, cache_cfg.block_size, tier) if cache_cfg.enable_prefix_cache
                             else None)
        self.scheduler = LocalScheduler(config.scheduler, cache_cfg.block_size, self.pool, self.prefix_cache,
                                        self.cache_key)
        self.store_loads = (StoreLoads(self.store_io, self.pool, self.prefix_cache, self.cache_key,
                                       cache_cfg.block_size) if self.store_io is not None else None)
        self.runner: ModelRunner | RankGroup = (self.ranks if self.ranks is not None else
                                                ModelRunner(self.loaded.model, self.storage, config.device))
        self.failed = ""  # why the engine can run no more steps (a rank process died): every request ended
        self.sampler = Sampler(config.seed)
        self._clock = clock
        self._tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        self._step_id = 0
        # Called with each executed plan before the scheduler applies it: the KV of the plan's chunks is
        # written and their block tables are still held, so a prefill worker can stream them (handoff).
        self.on_executed: Callable[[StepPlan], None] | None = None
        # Called after each layer of a step's forward (the serving loop's look at its messages mid-step).
        self.between_layers: Callable[[], None] | None = None
        self.worker_id = ""  # named in every delta; a serving worker sets its id
        self.last_plan: StepPlan | None = None  # the plan of the latest step (serving workers log its shape)
        self._grammar_tokenizer = None  # llguidance's view of the tokenizer, built for the first structured request

    @property
    def tokenizer(self):  # noqa: ANN201 - kvbaton.model.tokenizer.Tokenizer
        return self.loaded.tokenizer

    # -- ingress --------------------------------------------------------------------------------

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None,
                    tenant: str = "", slo_class: str = "default", arrival_at: float | None = None,
                    output_token_ids: Sequence[int] = ()) -> str:
        """Validates and queues one request (one sample: callers expand `n`). Returns its id. `output_token_ids`:
        a request migrated from another worker resumes after the tokens it already produced there (`_resume`)."""
        if self.failed:
            raise KvbatonError(f"this engine can run no more steps: {self.failed}")
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate_prompt(token_ids)
        vocab = self.loaded.config.vocab_size
        if any(token_id >= vocab for token_id, _ in params.logit_bias):
            raise InvalidRequestError(f"logit_bias keys must be token ids in [0, {vocab})")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._tracked:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        grammar = self._grammar(params)
        request = Request(request_id, token_ids, params, self._clock() if arrival_at is None else arrival_at,
                          tenant=tenant, slo_class=slo_class, eos_token_id=self.tokenizer.eos_token_id,
                          max_model_len=self.max_model_len)
        tracked = _Tracked(request, self._detokenizer(params), grammar=grammar,
                           prompt_logprobs=[] if params.prompt_logprobs is not None and not output_token_ids else None)
        if output_token_ids:
            self._resume(tracked, output_token_ids)
        if self.store_loads is None or not self.store_loads.submit(request, idle=not self.scheduler.requests):
            self.scheduler.add_request(request)
        self._tracked[request_id] = tracked
        return request_id

    def _resume(self, tracked: _Tracked, output_token_ids: Sequence[int]) -> None:
        """A migrated request's output so far (streamed by the worker it left) becomes its output here, as a
        preempted request's does: the scheduler recomputes prompt + output and samples the next token. The text,
        the stop-string window and the grammar take those tokens exactly as they did there (nothing is emitted:
        the client has them), so they count toward max_tokens, stop rules and penalties. A seeded request's next
        draw is at the position after them: each output position has its own seeded stream (`Sampler`), so its
        tokens from here are those the lost worker would have drawn, with speculative decoding or without."""
        request = tracked.request
        vocab = self.loaded.config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in output_token_ids):
            raise InvalidRequestError(f"resumed output token ids must be integers in [0, {vocab})")
        if (len(output_token_ids) >= request.sampling.max_tokens
                or request.num_prompt_tokens + len(output_token_ids) >= self.max_model_len):
            raise InvalidRequestError(f"resumed output of {len(output_token_ids)} tokens leaves no token to generate")
        for token_id in output_token_ids:
            request.output_token_ids.append(token_id)
            # Not in the scheduler yet: a stop this replay found (it cannot, for an output its worker streamed
            # unfinished) only ends it below.
            output = self._on_token(tracked, SampledToken(token_id), None)
            if output.finished:
                raise InvalidRequestError(f"resumed output already ends the request ({output.finish_reason})")
        self.sampler.skip_draws(request.request_id, request.sampling, len(output_token_ids))

    def _detokenizer(self, params: SamplingParams) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens)

    def _grammar(self, params: SamplingParams) -> RequestGrammar | None:
        """A fresh matcher for a structured-output request (InvalidRequestError if its grammar does not build)."""
        if not params.grammar:
            return None
        # Imported with the first structured request: an engine that never constrains runs without llguidance
        # (benchmarks/gpu_check.py on a machine that has only torch and a few pure-Python packages).
        from kvbaton.engine.structured import RequestGrammar, grammar_tokenizer

        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = grammar_tokenizer(self.tokenizer, self.loaded.config.vocab_size)
        return RequestGrammar(self._grammar_tokenizer, params.grammar)

    def validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise InvalidRequestError("prompt is empty: give at least one token")
        vocab = self.loaded.config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(token_ids)} tokens but the context is {self.max_model_len} tokens "
                f"(prompt plus at least one output token must fit)"
            )

    def adopt_request(self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str,
                      first_token: SampledToken, block_ids: Sequence[int], tenant: str = "",
                      slo_class: str = "default", arrival_at: float | None = None,
                      num_cached_tokens: int = 0) -> TokenDelta | None:
        """Admit a request whose prompt KV is already in `block_ids` (a completed handoff) and decode from
        `first_token`, which the prefill worker sampled (its prefix cache supplied `num_cached_tokens`). Returns the first token's output, or None when the
        scheduler cannot take it now (the caller keeps the blocks and retries). On success the request owns
        the blocks' references (one each, handed over by the caller): nothing is copied.
        """
        token_ids = list(prompt_token_ids)
        self.validate_prompt(token_ids)
        if request_id in self._tracked:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        grammar = self._grammar(params)  # it consumes the first token in _on_token, as the prefill's did
        now = self._clock()
        request = Request(request_id, token_ids, params, now if arrival_at is None else arrival_at,
                          tenant=tenant, slo_class=slo_class, eos_token_id=self.tokenizer.eos_token_id,
                          max_model_len=self.max_model_len)
        request.output_token_ids.append(first_token.token_id)
        request.num_cached_tokens = num_cached_tokens  # the prefill worker's hit: what usage reports
        if not self.scheduler.admit_prefilled(request, len(token_ids), now, block_ids=block_ids):
            return None
        request.first_token_at = now
        self.sampler.skip_draws(request_id, params, 1)  # the prefill worker drew the first token
        tracked = _Tracked(request, self._detokenizer(params), grammar=grammar)
        self._tracked[request_id] = tracked
        reason = self.scheduler.stop_reason(request, first_token.token_id)
        if reason is not None:
            self.scheduler.finish_request(request_id, reason, now)
        output = self._on_token(tracked, first_token, reason)
        if output.finished:  # its final output is this one: step() must not emit another
            self._tracked.pop(request_id)
            self.sampler.forget(request_id)
        return output

    def abort_request(self, request_id: str) -> None:
        """Idempotent; the request's final output (finish_reason ABORT) comes from the next step()."""
        if self.store_loads is not None and self.store_loads.abort(request_id):
            return  # ends at its load's next step, in step()
        self.scheduler.abort_request(request_id, self._clock())

    # -- the loop -------------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self._tracked)

    def step(self) -> list[TokenDelta]:
        outputs: list[TokenDelta] = []
        if self.store_loads is not None:
            # With nothing but loads to run, wait for one (briefly: the caller has its own sockets to read)
            wait_s = LOAD_WAIT_S if not self.scheduler.requests else 0.0
            for request in self.store_loads.poll(lambda request: outputs.append(self._end_loading(request)), wait_s):
                self.scheduler.add_request(request)
        now = self._clock()
        plan = self.scheduler.schedule(now)
        self.last_plan = plan
        sampled: dict[str, SampledToken] = {}
        accepted: dict[str, tuple[SampledToken, ...]] = {}
        started = time.perf_counter()
        if plan.chunks:
            drafts = self._drafts_of(plan)
            try:
                logits, row_ids, prompt_logprobs = self.runner.execute(plan, self.between_layers,
                                                                       self._prompt_logprobs_wanted(plan), drafts)
            except RankFailedError as exc:
                return self._fail_all(str(exc))
            for rid, entries in prompt_logprobs.items():
                self._tracked[rid].prompt_logprobs.extend(entries)  # type: ignore[union-attr]
            if self.on_executed is not None:
                self.on_executed(plan)
            if drafts:
                logits, row_ids = self._verify(logits, row_ids, drafts, sampled, accepted)
            if row_ids:
                tracked = [self._tracked[rid] for rid in row_ids]
                requests = [t.request for t in tracked]
                params = [request.sampling for request in requests]
                allowed = ([None if t.grammar is None else t.grammar.allowed() for t in tracked]
                           if any(t.grammar is not None for t in tracked) else None)
                sampled.update(zip(row_ids, self.sampler.sample(logits, row_ids, params, requests, allowed)))
            for request_id, why in self.sampler.take_failed().items():
                # Its own failure (see engine/sampler.py), not the step's: it ends here, its token unused; update()
                # passes over a finished request's chunk and the others go on.
                sampled.pop(request_id, None)
                accepted.pop(request_id, None)
                self.scheduler.finish_request(request_id, FinishReason.ERROR, self._clock(), why)
        self._step_id += 1
        result = StepResult(plan.step_id, sampled, time.perf_counter() - started, accepted)
        token_outputs = self.scheduler.update(plan, result, self._clock())
        ended: set[str] = set()
        for out in token_outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is not None and out.request_id not in ended:  # a stop string may end it before its drafts
                output = self._on_token(tracked, out.token, out.finish_reason)
                outputs.append(output)
                if output.finished:
                    ended.add(out.request_id)
        for request in self.scheduler.take_finished():
            tracked = self._tracked.pop(request.request_id, None)
            self.sampler.forget(request.request_id)
            if tracked is not None and request.request_id not in ended:
                outputs.append(self._final_output(tracked))
        return outputs

    def _end_loading(self, request: Request) -> TokenDelta:
        """The final output of a request aborted while its prefix loaded from the store."""
        request.finish_reason = FinishReason.ABORT
        request.finished_at = self._clock()
        tracked = self._tracked.pop(request.request_id)
        self.sampler.forget(request.request_id)
        return self._final_output(tracked)

    def _fail_all(self, message: str) -> list[TokenDelta]:
        """The step could not run (a rank died): every request ends with `message` and its blocks go back (the
        failed step's KV is never inserted in the prefix cache); later `add_request`s are refused."""
        self.failed = message
        now = self._clock()
        for request_id in list(self.scheduler.requests):
            self.scheduler.finish_request(request_id, FinishReason.ERROR, now, message)
        outputs: list[TokenDelta] = []
        for request in self.scheduler.take_finished():
            tracked = self._tracked.pop(request.request_id, None)
            self.sampler.forget(request.request_id)
            if tracked is not None:
                outputs.append(self._final_output(tracked))
        return outputs

    def close(self) -> None:
        """Stop the rank processes and the store IO thread, if any (pending saves are dropped); idempotent."""
        if self.ranks is not None:
            self.ranks.close()
        if self.store_io is not None:
            self.store_io.close()

    def _drafts_of(self, plan: StepPlan) -> dict[str, tuple[int, ...]]:
        """The draft tokens of the plan's speculative chunks (those reaching past their request's known tokens)."""
        drafts: dict[str, tuple[int, ...]] = {}
        if self.scheduler.proposer is None:
            return drafts
        for chunk in plan.chunks:
            tracked = self._tracked.get(chunk.request_id)
            if tracked is not None and chunk.num_tokens > 1:
                num_drafts = chunk.end_pos - tracked.request.num_tokens
                if num_drafts > 0:
                    drafts[chunk.request_id] = chunk.token_ids[-num_drafts:]
        return drafts

    def _verify(self, logits: torch.Tensor, row_ids: list[str], drafts: dict[str, tuple[int, ...]],
                sampled: dict[str, SampledToken], accepted: dict[str, tuple[SampledToken, ...]],
                ) -> tuple[torch.Tensor, list[str]]:
        """The speculative chunks' verdicts (their rows, one per position, in `logits`) into `sampled` and
        `accepted`; returns the other rows and their ids, sampled as usual."""
        spans: dict[str, list[int]] = {}
        plain: list[int] = []
        for i, rid in enumerate(row_ids):
            if rid in drafts:
                spans.setdefault(rid, []).append(i)
            else:
                plain.append(i)
        for rid, rows in spans.items():
            tokens = self.sampler.verify(logits[rows[0]:rows[-1] + 1], drafts[rid],
                                         self._tracked[rid].request.sampling, rid)
            accepted[rid] = tuple(tokens[:-1])
            sampled[rid] = tokens[-1]
        return logits[plain], [row_ids[i] for i in plain]

    def _prompt_logprobs_wanted(self, plan: StepPlan) -> dict[str, PromptLogprobsWanted] | None:
        """The plan's requests whose prompt logprobs are not all collected yet (a recompute after preemption
        computes the prompt again; what was collected stays)."""
        wanted: dict[str, PromptLogprobsWanted] | None = None
        for chunk in plan.chunks:
            tracked = self._tracked.get(chunk.request_id)
            if tracked is None or tracked.prompt_logprobs is None:
                continue
            request = tracked.request
            first = len(tracked.prompt_logprobs) + 1
            if first < request.num_prompt_tokens and chunk.start_pos < request.num_prompt_tokens:
                wanted = wanted if wanted is not None else {}
                wanted[chunk.request_id] = PromptLogprobsWanted(request.sampling.prompt_logprobs or 0,
                                                                request.prompt_token_ids, first)
        return wanted

    def _on_token(self, tracked: _Tracked, token: SampledToken, finish_reason: FinishReason | None) -> TokenDelta:
        request = tracked.request
        stops = request.sampling.stop
        tracked.text += tracked.detokenizer.push(token.token_id)
        if tracked.grammar is not None and finish_reason in (None, FinishReason.LENGTH):
            # The grammar's end is the output's end of sequence: completed by the max_tokens-th token, the output
            # is whole and ends with "stop", as an end-of-sequence token there does (the scheduler's stop_reason).
            grammar_reason = self._advance_grammar(tracked.grammar, request, token.token_id)
            if finish_reason is None or grammar_reason is FinishReason.STOP:
                finish_reason = grammar_reason
        finished = finish_reason is not None
        holding_off = bool(stops) and len(request.output_token_ids) <= request.sampling.min_tokens
        if holding_off:
            tracked.stop_floor = len(tracked.text)  # min_tokens: no stop string ends the output yet
        elif stops:
            hit, stop = _find_stop(tracked.text, stops, tracked.num_emitted_chars, tracked.stop_floor)
            if hit >= 0:
                tracked.text = tracked.text[:hit + (len(stop) if request.sampling.include_stop_str_in_output else 0)]
                if not finished:
                    self.scheduler.finish_request(request.request_id, FinishReason.STOP, self._clock())
                finished, finish_reason = True, FinishReason.STOP
        # Hold back a tail that could still become a stop string, so no stop text is ever streamed.
        holdback = 0 if finished or not stops or holding_off else max(map(len, stops)) - 1
        emit_to = max(tracked.num_emitted_chars, len(tracked.text) - holdback)
        new_text = tracked.text[tracked.num_emitted_chars:emit_to]
        tracked.num_emitted_chars = emit_to
        prompt_logprobs: tuple[SampledToken, ...] = ()
        extra: dict[str, float] = {}
        if len(request.output_token_ids) == 1:
            if tracked.prompt_logprobs is not None:
                prompt_logprobs = tuple(tracked.prompt_logprobs)
            if request.first_scheduled_at is not None:  # vLLM's queue time, on the engine's clock
                extra = {"queue_s": max(request.first_scheduled_at - request.arrival_at, 0.0)}
        return TokenDelta(request.request_id, (token.token_id,), new_text, finished,
                          None if finish_reason is None else finish_reason.value, request.num_prompt_tokens,
                          max(request.num_cached_tokens, 0), (token,) if request.sampling.logprobs is not None else (),
                          request.finish_message if finish_reason is FinishReason.ERROR else "", self.worker_id,
                          extra, prompt_logprobs)

    def _advance_grammar(self, grammar: RequestGrammar, request: Request, token_id: int) -> FinishReason | None:
        """The grammar takes the request's new token: the request ends (stop) once the grammar is complete, or
        fails if the token does not fit (only a token sampled elsewhere can: the mask keeps it from ours)."""
        error = grammar.consume(token_id)
        if error:
            self.scheduler.finish_request(request.request_id, FinishReason.ERROR, self._clock(),
                                          f"structured output: {error}")
            return FinishReason.ERROR
        if grammar.complete:
            self.scheduler.finish_request(request.request_id, FinishReason.STOP, self._clock())
            return FinishReason.STOP
        return None

    def _final_output(self, tracked: _Tracked) -> TokenDelta:
        request = tracked.request
        new_text = tracked.text[tracked.num_emitted_chars:]
        tracked.num_emitted_chars = len(tracked.text)
        reason = request.finish_reason
        return TokenDelta(request.request_id, (), new_text, True, None if reason is None else reason.value,
                          request.num_prompt_tokens, max(request.num_cached_tokens, 0), (), request.finish_message,
                          self.worker_id)

    def reset_prefix_cache(self, clear_store: bool = False, store_wait_s: float = 0.0) -> int:
        """vLLM's reset_prefix_cache: every cached block no request holds goes back to the pool; blocks running
        requests hold stay theirs. `clear_store` (vLLM's `reset_connector`): the KV store node is emptied too of
        what no load pins, so later prompts find nothing cached anywhere; without it the store keeps its blocks
        and the next prompt loads them back. `store_wait_s`: how long to wait for the node's answer
        (`WorkerStoreIO.clear_store`; 0: ask and go on). Returns how many device blocks were freed; the cache's KV
        events tell the router, the node's events its store directory."""
        num_freed = self.prefix_cache.clear() if self.prefix_cache is not None else 0
        if clear_store and self.store_io is not None:
            self.store_io.clear_store(store_wait_s)
        return num_freed

    # -- introspection --------------------------------------------------------------------------

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def check_invariants(self) -> None:
        """Block accounting: pool, cache and scheduler agree (and store loads in flight hold their own blocks); when
        idle, only the cache holds blocks."""
        self.scheduler.check_invariants(self.store_loads.num_held_blocks if self.store_loads is not None else 0)
        self.pool.check_invariants()
        if self.prefix_cache is not None:
            self.prefix_cache.check_invariants()
        if not self.scheduler.has_unfinished_requests():
            cached = self.prefix_cache.num_cached_blocks if self.prefix_cache is not None else 0
            held = self.store_loads.num_held_blocks if self.store_loads is not None else 0
            assert self.pool.num_used_blocks == cached + held, (
                f"idle engine holds {self.pool.num_used_blocks} blocks but the prefix cache has only {cached} and "
                f"store loads {held}"
            )


def _find_stop(text: str, stops: Sequence[str], num_emitted_chars: int, floor: int = 0) -> tuple[int, str]:
    """Earliest index where a stop string starts, looking only where a new match can begin (not before `floor`),
    and that stop string; (-1, "") when none does."""
    best, found = -1, ""
    for stop in stops:
        start = max(floor, num_emitted_chars - len(stop) + 1)
        idx = text.find(stop, start)
        if idx >= 0 and (best < 0 or idx < best):
            best, found = idx, stop
    return best, found
