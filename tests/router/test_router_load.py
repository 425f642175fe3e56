"""LoadTracker: heartbeat + pending load, sliding window, group re-attribution, worker removal."""

from __future__ import annotations

from kvbaton.router.load import LoadTracker, WorkerStats


def stats(worker: str, queued: int = 0, used: int = 0, free: int = 100) -> WorkerStats:
    return WorkerStats(worker, num_queued_prefill_tokens=queued, num_used_blocks=used, num_free_blocks=free)


def test_load_tokens_is_queued_prefill_plus_kv_in_use_plus_pending() -> None:
    load = LoadTracker(window_s=10.0)
    assert load.load_tokens("w0") == 0 and load.free_blocks("w0") is None
    load.on_stats(stats("w0", queued=100, used=3), now=1.0)
    assert load.load_tokens("w0") == 100 + 3 * 16
    load.on_assigned("w0", "r1", now=2.0, num_prefill_tokens=50, num_blocks=4, work_s=0.5)
    assert load.load_tokens("w0") == 198
    assert load.free_blocks("w0") == 96
    load.on_stats(stats("w0", queued=150, used=7, free=96), now=3.0)  # the heartbeat now reflects r1
    assert load.load_tokens("w0") == 150 + 7 * 16
    assert load.free_blocks("w0") == 96
    load.check_invariants()


def test_pending_grace_keeps_recent_assignments_across_a_heartbeat() -> None:
    load = LoadTracker(window_s=10.0, pending_grace_s=0.5)
    load.on_assigned("w0", "r1", now=1.0, num_prefill_tokens=10, num_blocks=1, work_s=0.1)
    load.on_assigned("w0", "r2", now=1.8, num_prefill_tokens=20, num_blocks=2, work_s=0.1)
    load.on_stats(stats("w0"), now=2.0)
    assert load.load_tokens("w0") == 20 and load.free_blocks("w0") == 98
    load.check_invariants()


def test_window_expires_old_work_exactly() -> None:
    load = LoadTracker(window_s=10.0)
    load.on_assigned("w0", "r1", now=0.0, num_prefill_tokens=1, num_blocks=1, work_s=0.1, group=7)
    load.on_assigned("w0", "r2", now=5.0, num_prefill_tokens=1, num_blocks=1, work_s=0.2, group=7)
    load.on_assigned("w1", "r3", now=6.0, num_prefill_tokens=1, num_blocks=1, work_s=0.4)
    load.prune(now=9.0)
    assert abs(load.window_load_s("w0") - 0.3) < 1e-12
    load.prune(now=10.5)
    assert abs(load.window_load_s("w0") - 0.2) < 1e-12 and load.group_is_active(7)
    load.prune(now=15.5)
    assert load.window_load_s("w0") == 0.0 and not load.group_is_active(7)
    assert load.group_loads_s("w0") == {}
    assert load.window_load_s("w1") == 0.4
    load.check_invariants()


def test_move_group_reattributes_oldest_work_first() -> None:
    load = LoadTracker(window_s=100.0)
    for i, work in enumerate([1.0, 2.0, 3.0]):
        load.on_assigned("w0", f"r{i}", now=float(i), num_prefill_tokens=1, num_blocks=1, work_s=work, group=5)
    load.on_assigned("w0", "x", now=3.0, num_prefill_tokens=1, num_blocks=1, work_s=10.0, group=6)
    assert load.move_group(5, "w0", "w1", fraction=0.5) == 3.0  # 1.0 + 2.0 reach half of 6.0
    assert load.group_loads_s("w0") == {5: 3.0, 6: 10.0}
    assert load.group_loads_s("w1") == {5: 3.0}
    assert load.window_load_s("w1") == 3.0
    assert load.move_group(5, "w0", "w1") == 3.0
    assert load.move_group(9, "w0", "w1") == 0.0
    load.check_invariants()


def test_finished_and_removed_workers_are_forgotten() -> None:
    load = LoadTracker(window_s=100.0)
    load.on_assigned("w0", "r1", now=0.0, num_prefill_tokens=1, num_blocks=1, work_s=1.0, group=3)
    assert load.assignment("r1") == ("w0", 3)
    assert load.on_finished("r1") == ("w0", 3)
    assert load.on_finished("r1") is None
    load.remove_worker("w0")
    assert load.window_load_s("w0") == 0.0 and not load.group_is_active(3)
    load.check_invariants()
