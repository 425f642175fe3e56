"""The requests of one local scheduler: waiting, running, and finished but not yet taken; their transitions.

`RequestQueues` owns the lists and every move between them: a new request waits (FCFS, preempted ones at
the front), an admitted one runs (admission order: the tail is the preemption victim), a preempted one
gives all its blocks back and waits again, and a finished one (stopped by its token or its length, failed,
aborted) frees its blocks and waits in `finished` until `take_finished`. The scheduler's parts read
`running` and `waiting` and change them only through these methods.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence

from kvbaton.core.request import FinishReason, Request, RequestStatus
from kvbaton.core.step import SampledToken
from kvbaton.scheduler.block_manager import BlockManager


class RequestQueues:
    """Every unfinished request of a scheduler, by state, and the finished ones not yet taken."""

    def __init__(self, blocks: BlockManager, forget: Callable[[str], None] | None = None) -> None:
        self.blocks = blocks
        self._forget = forget  # told the id of each finished request (speculation's n-gram index)
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._waiting: deque[Request] = deque()  # FCFS: preempted at the front, then arrival order
        self._running: list[Request] = []  # admission order; the tail is the preemption victim
        self._finished: list[Request] = []  # finished since the last take_finished()

    # ---- read-only views ------------------------------------------------------------------------

    @property
    def running(self) -> Sequence[Request]:
        return self._running

    @property
    def waiting(self) -> Sequence[Request]:
        return self._waiting

    @property
    def finished(self) -> Sequence[Request]:
        return self._finished

    @property
    def requests(self) -> Mapping[str, Request]:
        """Every unfinished request by id (a hot loop binds its `get`: one C call per chunk)."""
        return self._requests

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __bool__(self) -> bool:
        return bool(self._requests)

    # ---- transitions ----------------------------------------------------------------------------

    def add_waiting(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self._requests[request.request_id] = request
        self._waiting.append(request)

    def add_running(self, request: Request) -> None:
        """A request that runs at once (a handed-off one, its KV computed elsewhere), holding its blocks."""
        request.status = RequestStatus.RUNNING
        self._requests[request.request_id] = request
        self._running.append(request)

    def admit(self, request: Request) -> None:
        """A waiting request runs from now on, after those running; it leaves `waiting` at `drop_admitted`."""
        request.status = RequestStatus.RUNNING
        self._running.append(request)

    def drop_admitted(self, request_ids: set[str]) -> None:
        """Take the requests admitted in this step out of the waiting queue (one pass for all of them)."""
        self._waiting = deque(r for r in self._waiting if r.request_id not in request_ids)

    def preempt(self, request: Request) -> None:
        """Recompute later: a running request gives all its blocks back and goes to the front of the queue."""
        self._running.remove(request)
        self.blocks.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self._waiting.appendleft(request)

    def finish(self, request: Request, reason: FinishReason, now: float, message: str = "") -> None:
        """Terminal transition of a waiting or running request: its blocks are freed at once."""
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
        else:
            self._waiting.remove(request)
        self.blocks.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finish_message = message
        request.finished_at = now
        del self._requests[request.request_id]
        self._finished.append(request)
        if self._forget is not None:
            self._forget(request.request_id)

    def append_token(self, request: Request, token: SampledToken, now: float) -> FinishReason | None:
        """A running request's sampled token: appended, and the request finished if it stops there."""
        token_id = token.token_id
        output = request.output_token_ids
        output.append(token_id)
        if request.first_token_at is None:
            request.first_token_at = now
        sampling = request.sampling
        # `stop_reason`'s tests, inline (once per token): the usual token stops nothing
        if ((token_id == request.eos_token_id and not sampling.ignore_eos) or sampling.stop_token_ids
                or len(output) >= sampling.max_tokens
                or len(request.prompt_token_ids) + len(output) >= request.max_model_len):
            reason = stop_reason(request, token_id)
            if reason is not None:
                self.finish(request, reason, now)
            return reason
        return None

    def take_finished(self) -> list[Request]:
        finished, self._finished = self._finished, []
        return finished

    def check_invariants(self, max_num_seqs: int) -> None:
        waiting_ids = [r.request_id for r in self._waiting]
        running_ids = [r.request_id for r in self._running]
        assert len(set(waiting_ids)) == len(waiting_ids) and len(set(running_ids)) == len(running_ids)
        assert set(waiting_ids) | set(running_ids) == set(self._requests), "request tables disagree"
        assert not set(waiting_ids) & set(running_ids), "a request is both waiting and running"
        assert len(self._running) <= max_num_seqs
        for r in self._waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), f"{r.request_id}: {r.status}"
            assert not r.block_ids and r.num_computed_tokens == 0, f"{r.request_id}: waiting but holds blocks"
        for r in self._running:
            assert r.status is RequestStatus.RUNNING, f"{r.request_id}: {r.status}"
            assert 0 < r.num_uncomputed_tokens <= r.num_tokens, f"{r.request_id}: nothing left to compute"
        for r in self._finished:
            assert r.status is RequestStatus.FINISHED and not r.block_ids


def stop_reason(request: Request, token_id: int) -> FinishReason | None:
    """Whether appending `token_id` (already in output_token_ids) ends `request`, and why."""
    sampling = request.sampling
    if token_id == request.eos_token_id and not sampling.ignore_eos:
        return FinishReason.STOP
    if sampling.stop_token_ids and token_id in sampling.stop_token_ids:
        return FinishReason.STOP
    num_output_tokens = len(request.output_token_ids)
    if (num_output_tokens >= sampling.max_tokens
            or len(request.prompt_token_ids) + num_output_tokens >= request.max_model_len):
        return FinishReason.LENGTH
    return None

