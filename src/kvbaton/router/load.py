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
from dataclasses import dataclass

from kvbaton.core.errors import InvalidRequestError
from kvbaton.router.base import WorkerId


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """One heartbeat from a worker."""

    worker_id: WorkerId
    num_queued_prefill_tokens: int  # prompt tokens admitted or waiting but not yet computed
    num_kv_blocks_used: int  # blocks referenced by running requests
    num_kv_blocks_free: int  # blocks allocatable without evicting cached prefixes
    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks_cached: int = 0  # unreferenced blocks kept by the prefix cache (evictable)
    block_size: int = 16


class _Entry:
    __slots__ = ("at", "worker", "group", "work_s")

    def __init__(self, at: float, worker: WorkerId, group: int | None, work_s: float) -> None:
        self.at = at
        self.worker = worker  # rewritten when rebalancing moves the group
        self.group = group
        self.work_s = work_s


class _WorkerLoad:
    __slots__ = ("stats", "pending", "pending_prefill_tokens", "pending_blocks", "work_s", "num_entries", "groups")

    def __init__(self) -> None:
        self.stats: WorkerStats | None = None
        self.pending: deque[tuple[float, int, int]] = deque()  # (assigned_at, prefill tokens, blocks) since heartbeat
        self.pending_prefill_tokens = 0
        self.pending_blocks = 0
        self.work_s = 0.0  # window sum
        self.num_entries = 0  # window entries; the sum is reset to exactly 0 when this reaches 0
        self.groups: dict[int, list[float]] = {}  # group -> [window work_s, num entries]


class LoadTracker:
    def __init__(self, window_s: float = 180.0, pending_grace_s: float = 0.0) -> None:
        if window_s <= 0:
            raise InvalidRequestError(f"window_s must be positive, got {window_s}")
        self.window_s = window_s
        # A heartbeat received within this many seconds of a routing decision may not reflect it yet.
        self.pending_grace_s = pending_grace_s
        self._workers: dict[WorkerId, _WorkerLoad] = {}
        self._window: deque[_Entry] = deque()  # in assignment order, so oldest first
        self._group_entries: dict[int, int] = {}  # window entries per group, over all workers
        self._requests: dict[str, tuple[WorkerId, int | None]] = {}  # outstanding request -> (worker, group)
        # Flat mirrors of each worker's `work_s` and free blocks (stats free - pending), kept in step with
        # `_workers`, so a cost-based hot loop reads them with one dict lookup each (`cost_lookups`).
        self._window_s_by_worker: dict[WorkerId, float] = {}
        self._free_by_worker: dict[WorkerId, int] = {}  # workers with a heartbeat only

    def _worker(self, worker: WorkerId) -> _WorkerLoad:
        load = self._workers.get(worker)
        if load is None:
            load = self._workers[worker] = _WorkerLoad()
            self._window_s_by_worker[worker] = 0.0
        return load

    # ---- inputs --------------------------------------------------------------------------------
    def on_stats(self, stats: WorkerStats, now: float) -> None:
        load = self._worker(stats.worker_id)
        load.stats = stats
        horizon = now - self.pending_grace_s
        while load.pending and load.pending[0][0] <= horizon:
            _, tokens, blocks = load.pending.popleft()
            load.pending_prefill_tokens -= tokens
            load.pending_blocks -= blocks
        self._free_by_worker[stats.worker_id] = stats.num_kv_blocks_free - load.pending_blocks

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
        if load.stats is not None:
            self._free_by_worker[worker] = load.stats.num_kv_blocks_free - load.pending_blocks
        self._window.append(_Entry(now, worker, group, work_s))
        self._add(load, group, work_s, 1)
        self._window_s_by_worker[worker] = load.work_s
        if group is not None:
            self._group_entries[group] = self._group_entries.get(group, 0) + 1
        self._requests[request_id] = (worker, group)

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
        base = 0 if stats is None else stats.num_queued_prefill_tokens + stats.num_kv_blocks_used * stats.block_size
        return base + load.pending_prefill_tokens

    def free_blocks(self, worker: WorkerId) -> int | None:
        """Free KV blocks after the decisions since the last heartbeat; None before the first heartbeat."""
        load = self._workers.get(worker)
        if load is None or load.stats is None:
            return None
        return load.stats.num_kv_blocks_free - load.pending_blocks

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
                out.append((load.work_s, None if stats is None else stats.num_kv_blocks_free - load.pending_blocks))
        return out

    def cost_lookups(self) -> tuple[Callable[[WorkerId, float], float], Callable[[WorkerId], int | None]]:
        """(window_load_s(worker, default), free_blocks(worker)) as bound dict reads, for per-worker hot loops.

        Same values as `window_load_s` (default for an unknown worker) and `free_blocks` (None before
        the first heartbeat); valid until the tracker's next update.
        """
        return self._window_s_by_worker.get, self._free_by_worker.get

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
                self._window_s_by_worker[entry.worker] = load.work_s
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
        for entry in self._window:
            if moved >= target - 1e-12:
                break
            if entry.group == group and entry.worker == src:
                entry.worker = dst
                self._add(src_load, group, -entry.work_s, -1)
                self._add(dst_load, group, entry.work_s, 1)
                moved += entry.work_s
        self._window_s_by_worker[src] = src_load.work_s
        self._window_s_by_worker[dst] = dst_load.work_s
        return moved

    def remove_worker(self, worker: WorkerId) -> None:
        """Forget a worker: its stats and its window entries (outstanding request ids stay until finished)."""
        if self._workers.pop(worker, None) is None:
            return
        del self._window_s_by_worker[worker]
        self._free_by_worker.pop(worker, None)
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
        assert self._window_s_by_worker == {w: load.work_s for w, load in self._workers.items()}
        assert self._free_by_worker == {w: load.stats.num_kv_blocks_free - load.pending_blocks
                                        for w, load in self._workers.items() if load.stats is not None}
        for worker, load in self._workers.items():
            entries = [e for e in self._window if e.worker == worker]
            assert load.num_entries == len(entries)
            assert abs(load.work_s - sum(e.work_s for e in entries)) <= 1e-6 * max(1.0, load.work_s)
            assert load.pending_prefill_tokens == sum(p[1] for p in load.pending)
            assert load.pending_blocks == sum(p[2] for p in load.pending)
            for group, (work_s, count) in load.groups.items():
                group_entries = [e for e in entries if e.group == group]
                assert count == len(group_entries) > 0
                assert abs(work_s - sum(e.work_s for e in group_entries)) <= 1e-6 * max(1.0, work_s)
