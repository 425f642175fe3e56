"""Per-worker load as the router sees it: heartbeat stats plus a sliding window of assigned work.

Two views, for two kinds of policy:
- instantaneous `load_tokens` = queued prefill tokens + KV tokens in use, from the latest heartbeat,
  plus the prefill tokens routed since (so back-to-back decisions between heartbeats do not herd);
- windowed `window_load_s` = predicted prefill+decode seconds assigned within the last `window_s`
  (Preble's L_i). Window entries may carry a prefix group so rebalancing can re-attribute a
  group's recent work to the worker it moves to.
Time is passed in; nothing here reads a clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from heapq import merge
from operator import attrgetter
from dataclasses import dataclass

from kvbaton.core.errors import InvalidRequestError
from kvbaton.router.base import WorkerId


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """One heartbeat from a worker: the load figures of its scheduler's stats (`SchedulerStats`, and the heartbeat
    `rpc.Stats`), under the same names and meanings."""

    worker_id: WorkerId
    num_queued_prefill_tokens: int  # prompt tokens admitted or waiting but not yet computed
    num_used_blocks: int  # blocks not free: those requests hold, and those only the prefix cache keeps
    num_free_blocks: int  # blocks allocatable without evicting cached prefixes
    num_running: int = 0
    num_waiting: int = 0
    num_cached_blocks: int = 0  # of the used blocks, those the prefix cache keeps and no request holds (evictable)
    block_size: int = 16

    @property
    def num_held_blocks(self) -> int:
        """Blocks running requests hold (low when they lock cached blocks, which count as cached)."""
        return max(self.num_used_blocks - self.num_cached_blocks, 0)


class _Entry:
    __slots__ = ("seq", "at", "worker", "group", "work_s")

    def __init__(self, seq: int, at: float, worker: WorkerId, group: int | None, work_s: float) -> None:
        self.seq = seq  # assignment order: the window's order
        self.at = at
        self.worker = worker  # rewritten when rebalancing moves the group
        self.group = group
        self.work_s = work_s


class _WorkerLoad:
    __slots__ = (
        "stats", "pending", "pending_prefill_tokens", "pending_blocks", "work_s", "num_entries", "groups", "group_window"
    )

    def __init__(self) -> None:
        self.stats: WorkerStats | None = None
        self.pending: deque[tuple[float, int, int]] = deque()  # (assigned_at, prefill tokens, blocks) since heartbeat
        self.pending_prefill_tokens = 0
        self.pending_blocks = 0
        self.work_s = 0.0  # window sum
        self.num_entries = 0  # window entries; the sum is reset to exactly 0 when this reaches 0
        self.groups: dict[int, list[float]] = {}  # group -> [window work_s, num entries]
        # group -> this worker's window entries of it, in window order (same keys as `groups`), so
        # moving a group reads its entries, not the whole window.
        self.group_window: dict[int, deque[_Entry]] = {}


_BY_SEQ = attrgetter("seq")


class LoadTracker:
    def __init__(self, window_s: float = 180.0, pending_grace_s: float = 0.0) -> None:
        if window_s <= 0:
            raise InvalidRequestError(f"window_s must be positive, got {window_s}")
        self.window_s = window_s
        # A heartbeat received within this many seconds of a routing decision may not reflect it yet.
        self.pending_grace_s = pending_grace_s
        self._workers: dict[WorkerId, _WorkerLoad] = {}
        self._window: deque[_Entry] = deque()  # in assignment order, so oldest first
        self._num_assigned = 0  # next entry's seq
        self._group_entries: dict[int, int] = {}  # window entries per group, over all workers
        self._requests: dict[str, tuple[WorkerId, int | None]] = {}  # outstanding request -> (worker, group)
        # Flat mirror of each worker's (`work_s`, free blocks = stats free - pending, None before a
        # heartbeat), kept in step with `_workers`, so a cost-based hot loop reads both with one
        # dict lookup (`cost_lookup`).
        self._costs: dict[WorkerId, tuple[float, int | None]] = {}

    def _worker(self, worker: WorkerId) -> _WorkerLoad:
        load = self._workers.get(worker)
        if load is None:
            load = self._workers[worker] = _WorkerLoad()
            self._costs[worker] = (0.0, None)
        return load

    def _mirror(self, worker: WorkerId, load: _WorkerLoad) -> None:
        stats = load.stats
        self._costs[worker] = (load.work_s, None if stats is None else stats.num_free_blocks - load.pending_blocks)

    # ---- inputs --------------------------------------------------------------------------------
    def on_stats(self, stats: WorkerStats, now: float) -> None:
        load = self._worker(stats.worker_id)
        load.stats = stats
        horizon = now - self.pending_grace_s
        while load.pending and load.pending[0][0] <= horizon:
            _, tokens, blocks = load.pending.popleft()
            load.pending_prefill_tokens -= tokens
            load.pending_blocks -= blocks
        self._mirror(stats.worker_id, load)

    def on_assigned(
        self,
        worker: WorkerId,
        request_id: str,
        now: float,
        num_prefill_tokens: int,
        num_blocks: int,
        work_s: float,
        group: int | None = None,
    ) -> None:
        """Record a routing decision: pending tokens/blocks until the next heartbeat, work into the window."""
        load = self._worker(worker)
        load.pending.append((now, num_prefill_tokens, num_blocks))
        load.pending_prefill_tokens += num_prefill_tokens
        load.pending_blocks += num_blocks
        entry = _Entry(self._num_assigned, now, worker, group, work_s)
        self._num_assigned += 1
        self._window.append(entry)
        self._add(load, group, work_s, 1)
        self._mirror(worker, load)
        if group is not None:
            self._group_entries[group] = self._group_entries.get(group, 0) + 1
            group_window = load.group_window.get(group)
            if group_window is None:
                load.group_window[group] = deque((entry,))
            else:
                group_window.append(entry)
        self._requests[request_id] = (worker, group)

    def on_reserved(self, worker: WorkerId, now: float, num_blocks: int) -> None:
        """A decode worker was picked to receive a handoff: its blocks count as pending until the next heartbeat
        (its prefill work is the prefill worker's, assigned there)."""
        load = self._worker(worker)
        load.pending.append((now, 0, num_blocks))
        load.pending_blocks += num_blocks
        self._mirror(worker, load)

    def on_finished(self, request_id: str) -> tuple[WorkerId, int | None] | None:
        """Forget an outstanding request; returns (worker, group) or None if unknown (idempotent)."""
        return self._requests.pop(request_id, None)

    def assignment(self, request_id: str) -> tuple[WorkerId, int | None] | None:
        return self._requests.get(request_id)

    # ---- reads ---------------------------------------------------------------------------------
    def load_tokens(self, worker: WorkerId) -> int:
        load = self._workers.get(worker)
        if load is None:
            return 0
        stats = load.stats
        base = 0 if stats is None else stats.num_queued_prefill_tokens + stats.num_held_blocks * stats.block_size
        return base + load.pending_prefill_tokens

    def queued_prefill_tokens(self, worker: WorkerId) -> int:
        """Prompt tokens waiting to be prefilled on the worker: its heartbeat's queue plus those routed since."""
        load = self._workers.get(worker)
        if load is None:
            return 0
        stats = load.stats
        return (0 if stats is None else stats.num_queued_prefill_tokens) + load.pending_prefill_tokens

    def kv_tokens_in_use(self, worker: WorkerId) -> int:
        """KV tokens the worker's running requests hold: its heartbeat's blocks in use plus those routed since."""
        load = self._workers.get(worker)
        if load is None or load.stats is None:
            return 0
        return (load.stats.num_held_blocks + max(load.pending_blocks, 0)) * load.stats.block_size

    def num_pending(self, worker: WorkerId) -> int:
        """Requests routed or handed off to the worker that its latest heartbeat may not reflect yet."""
        load = self._workers.get(worker)
        return 0 if load is None else len(load.pending)

    def free_blocks(self, worker: WorkerId) -> int | None:
        """Free KV blocks after the decisions since the last heartbeat; None before the first heartbeat."""
        load = self._workers.get(worker)
        if load is None or load.stats is None:
            return None
        return load.stats.num_free_blocks - load.pending_blocks

    def cost_inputs(self, workers: Sequence[WorkerId]) -> list[tuple[float, int | None]]:
        """(window_load_s, free_blocks) per worker in one pass; the hot loop of cost-based placement."""
        get = self._workers.get
        out: list[tuple[float, int | None]] = []
        for worker in workers:
            load = get(worker)
            if load is None:
                out.append((0.0, None))
            else:
                stats = load.stats
                out.append((load.work_s, None if stats is None else stats.num_free_blocks - load.pending_blocks))
        return out

    def cost_lookup(self) -> Callable[[WorkerId, tuple[float, None]], tuple[float, int | None]]:
        """`lookup(worker, default)` -> (window_load_s, free_blocks) as one bound dict read, for per-worker hot loops.

        Same values as `window_load_s` and `free_blocks` (None before the first heartbeat); an
        unknown worker gets `default`. Valid until the tracker's next update.
        """
        return self._costs.get

    def stats(self, worker: WorkerId) -> WorkerStats | None:
        load = self._workers.get(worker)
        return None if load is None else load.stats

    def prune(self, now: float) -> None:
        """Drop window entries assigned before `now - window_s`."""
        horizon = now - self.window_s
        window = self._window
        while window and window[0].at < horizon:
            entry = window.popleft()
            load = self._workers.get(entry.worker)
            if load is not None:
                self._add(load, entry.group, -entry.work_s, -1)
                self._mirror(entry.worker, load)
                if entry.group is not None:
                    group_window = load.group_window[entry.group]
                    group_window.popleft()  # the oldest in the window is the oldest of its group there
                    if not group_window:
                        del load.group_window[entry.group]
            if entry.group is not None:
                left = self._group_entries[entry.group] - 1
                if left:
                    self._group_entries[entry.group] = left
                else:
                    del self._group_entries[entry.group]

    def window_load_s(self, worker: WorkerId) -> float:
        """L_i as of the last `prune`: predicted work assigned to the worker within the window."""
        load = self._workers.get(worker)
        return 0.0 if load is None else load.work_s

    def group_loads_s(self, worker: WorkerId) -> dict[int, float]:
        """Window work per prefix group attributed to the worker."""
        load = self._workers.get(worker)
        return {} if load is None else {g: v[0] for g, v in load.groups.items()}

    def group_is_active(self, group: int) -> bool:
        return group in self._group_entries

    # ---- rebalancing support -------------------------------------------------------------------
    def move_group(self, group: int, src: WorkerId, dst: WorkerId, fraction: float = 1.0) -> float:
        """Re-attribute (a fraction of, oldest first) the group's window work from src to dst; returns seconds moved."""
        src_load = self._workers.get(src)
        if src_load is None or group not in src_load.groups or src == dst:
            return 0.0
        target = src_load.groups[group][0] * fraction
        dst_load = self._worker(dst)
        moved = 0.0
        src_window = src_load.group_window[group]
        moved_entries: list[_Entry] = []
        while src_window and moved < target - 1e-12:
            entry = src_window.popleft()
            entry.worker = dst
            self._add(src_load, group, -entry.work_s, -1)
            self._add(dst_load, group, entry.work_s, 1)
            moved += entry.work_s
            moved_entries.append(entry)
        if not src_window:
            del src_load.group_window[group]
        if moved_entries:
            dst_window = dst_load.group_window.get(group)
            merged = moved_entries if dst_window is None else merge(dst_window, moved_entries, key=_BY_SEQ)
            dst_load.group_window[group] = deque(merged)
        self._mirror(src, src_load)
        self._mirror(dst, dst_load)
        return moved

    def remove_worker(self, worker: WorkerId) -> None:
        """Forget a worker: its stats and its window entries (outstanding request ids stay until finished)."""
        if self._workers.pop(worker, None) is None:
            return
        del self._costs[worker]
        kept: deque[_Entry] = deque()
        for entry in self._window:
            if entry.worker != worker:
                kept.append(entry)
            elif entry.group is not None:
                left = self._group_entries[entry.group] - 1
                if left:
                    self._group_entries[entry.group] = left
                else:
                    del self._group_entries[entry.group]
        self._window = kept

    @staticmethod
    def _add(load: _WorkerLoad, group: int | None, work_s: float, num_entries: int) -> None:
        load.num_entries += num_entries
        load.work_s = load.work_s + work_s if load.num_entries else 0.0
        if group is not None:
            slot = load.groups.get(group)
            if slot is None:
                slot = load.groups[group] = [0.0, 0]
            slot[1] += num_entries
            if slot[1]:
                slot[0] += work_s
            else:
                del load.groups[group]

    def check_invariants(self) -> None:
        assert self._costs == {w: (self.window_load_s(w), self.free_blocks(w)) for w in self._workers}
        for worker, load in self._workers.items():
            entries = [e for e in self._window if e.worker == worker]
            assert load.num_entries == len(entries)
            assert abs(load.work_s - sum(e.work_s for e in entries)) <= 1e-6 * max(1.0, load.work_s)
            assert load.pending_prefill_tokens == sum(p[1] for p in load.pending)
            assert load.pending_blocks == sum(p[2] for p in load.pending)
            assert load.group_window.keys() == load.groups.keys()
            for group, (work_s, count) in load.groups.items():
                group_entries = [e for e in entries if e.group == group]
                assert list(load.group_window[group]) == group_entries
                assert count == len(group_entries) > 0
                assert abs(work_s - sum(e.work_s for e in group_entries)) <= 1e-6 * max(1.0, work_s)
