"""The quiet steady decode step: `LocalScheduler.update_decodes` when the step ends nothing and starts nothing.

A step from `schedule_decodes` is quiet when every request it advances is still running, has output
a token before (its first token is not this one), and neither its token nor its new length stops it
(no stop token or end of sequence can apply, and it stays under `max_tokens` and `max_model_len`), and
no finished request waits to be taken. Then `update_decodes` would only advance each request by its
token, cache its newly full block, finish nothing and return one `TokenOutput` per request: this
applies exactly that, without building the outputs, so that an executor that only needs to know the
step was quiet (the simulator's decode steps, ~half of its events) skips them. Otherwise it changes
nothing and the caller takes the general `update_decodes`. Whether a step is quiet is mostly told by the
requests alone (stop rules, lengths): `num_quiet_steps_ahead` counts how many next steps of one batch are
quiet that way, so that a caller who checks the rest (the batch is still the running list, nothing finished
waits) applies them with `apply_quiet_decodes`, untested.
`test_steady_decodes` compares the two paths; `test_quiet_steps_ahead` the counted steps.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbaton.core.request import Request, RequestStatus
from kvbaton.core.step import SampledToken
from kvbaton.scheduler.local_scheduler import LocalScheduler


def advance_quiet_decodes(scheduler: LocalScheduler, requests: list[Request], tokens: Sequence[SampledToken],
                          now: float) -> int:
    """`scheduler.update_decodes(requests, tokens, now)` when that step is quiet (see the module docstring); returns
    how many of `requests` then need one block more for their next decode (their tables cover exactly their
    computed tokens), for `schedule_decodes_after_quiet`. Else -1, changing nothing. `now` is unused: a quiet
    step stamps no time."""
    if scheduler._finished:
        return -1
    running = RequestStatus.RUNNING
    blocks = scheduler.blocks
    block_size = scheduler.block_size
    num_growing = 0
    if blocks.cache is None:
        # One pass that tests and applies; a request that is not quiet undoes the requests before it (taken
        # from the same iterator: what is left in it tells how many), then declines.
        pairs = zip(requests, tokens)
        for request, token in pairs:
            sampling = request.sampling
            output = request.output_token_ids
            num_output_tokens = len(output) + 1
            token_id = token.token_id
            if (request.status is not running or request.first_token_at is None or sampling.stop_token_ids
                    or (token_id == request.eos_token_id and not sampling.ignore_eos)
                    or num_output_tokens >= sampling.max_tokens
                    or len(request.prompt_token_ids) + num_output_tokens >= request.max_model_len):
                for done in requests[: len(requests) - len(list(pairs)) - 1]:
                    done.num_computed_tokens -= 1
                    done.output_token_ids.pop()
                return -1
            num_computed = request.num_computed_tokens = request.num_computed_tokens + 1
            output.append(token_id)
            if len(request.block_ids) * block_size <= num_computed:
                num_growing += 1
        return num_growing
    # Conservative stop test: a request whose sampling has any stop token ids is not quiet (whether its
    # token is one of them is left to the general path); the rest is `_stop_reason` with the token appended.
    for request, token in zip(requests, tokens):
        sampling = request.sampling
        num_output_tokens = len(request.output_token_ids) + 1
        if (request.status is not running or request.first_token_at is None or sampling.stop_token_ids
                or (token.token_id == request.eos_token_id and not sampling.ignore_eos)
                or num_output_tokens >= sampling.max_tokens
                or len(request.prompt_token_ids) + num_output_tokens >= request.max_model_len):
            return -1
    return apply_quiet_decodes(scheduler, requests, tokens)


def apply_quiet_decodes(scheduler: LocalScheduler, requests: list[Request], tokens: Sequence[SampledToken]) -> int:
    """`advance_quiet_decodes` of a step the caller knows is quiet, without testing it (`num_quiet_steps_ahead`);
    returns the same count."""
    blocks = scheduler.blocks
    block_size = scheduler.block_size
    num_growing = 0
    if blocks.cache is None:
        for request, token in zip(requests, tokens):
            num_computed = request.num_computed_tokens = request.num_computed_tokens + 1
            request.output_token_ids.append(token.token_id)
            if len(request.block_ids) * block_size <= num_computed:
                num_growing += 1
        return num_growing
    # With a prefix cache, `cache_computed_blocks` runs (as in `update_decodes`) only once the request's full
    # blocks outnumber those its cache hold covers; it leaves the request's table as long as it was.
    cache_computed_blocks = blocks.cache_computed_blocks
    holds = blocks._holds
    for request, token in zip(requests, tokens):
        num_computed = request.num_computed_tokens = request.num_computed_tokens + 1
        hold = holds.get(request.request_id)
        if num_computed // block_size > (hold.num_blocks if hold is not None else 0):
            cache_computed_blocks(request)
        request.output_token_ids.append(token.token_id)
        if len(request.block_ids) * block_size <= num_computed:
            num_growing += 1
    return num_growing


def batch_unchanged(scheduler: LocalScheduler, requests: list[Request]) -> bool:
    """The scheduler's side of a counted quiet step: `requests` are still exactly its running list (compared by
    identity) and no finished request waits to be taken."""
    return not scheduler._finished and scheduler._running == requests


def num_quiet_steps_ahead(requests: list[Request]) -> int:
    """How many next steps of exactly these requests decoding together are quiet as far as the requests tell, whatever
    tokens they sample: each is running, has output a token, has no stop token ids and cannot end at an
    end-of-sequence token (ignore_eos, or no eos id), and stays under max_tokens and max_model_len. The rest of
    quiet is the scheduler's state at each step (they are still its running list, no finished request waits),
    which the caller checks. Each such step adds one output token, so the count only falls by one per step."""
    running = RequestStatus.RUNNING
    num_ahead = -1
    for request in requests:
        sampling = request.sampling
        if (request.status is not running or request.first_token_at is None or sampling.stop_token_ids
                or (request.eos_token_id is not None and not sampling.ignore_eos)):
            return 0
        # A step is quiet while output + 1 < max_tokens and prompt + output + 1 < max_model_len.
        limit = min(sampling.max_tokens, request.max_model_len - len(request.prompt_token_ids))
        num_left = limit - 1 - len(request.output_token_ids)
        if num_ahead < 0 or num_left < num_ahead:
            num_ahead = num_left
    return num_ahead if num_ahead > 0 else 0


def schedule_decodes_after_quiet(scheduler: LocalScheduler, requests: list[Request],
                                 num_growing: int) -> list[Request] | None:
    """`scheduler.schedule_decodes()` when the last scheduler calls were `schedule_decodes()`, which returned
    `requests`, then `advance_quiet_decodes` of them, which returned `num_growing`.

    Each of them then still decodes one token past position 0 inside the same budget (a quiet step adds one
    computed and one output token), `num_growing` of them need a block more, and `steady_plan_context_tokens`
    grew by one per request: if the running list is still exactly `requests` (nothing admitted, aborted or
    finished since, so no table changed either) and nothing waits, only those tables are left to grow, in
    running order as `schedule_decodes` grows them. Otherwise it is `schedule_decodes()` itself.
    """
    running = scheduler._running
    # Requests compare by identity (Request has eq=False): the same objects in the same order.
    if scheduler._waiting or not scheduler.steady_fast_path or running != requests:
        return scheduler.schedule_decodes()
    if num_growing:
        blocks = scheduler.blocks
        if num_growing > blocks.pool.num_free_blocks:
            return None  # the general path evicts or preempts
        block_size = scheduler.block_size
        try_grow = blocks.try_grow
        for request in running:
            start = request.num_computed_tokens
            if len(request.block_ids) * block_size <= start:
                grown = try_grow(request, start + 1)
                assert grown, "a free block was counted for every growing decode"
    scheduler._step_id += 1
    scheduler._num_steps += 1
    scheduler.steady_plan_context_tokens += len(running)
    return running[:]
