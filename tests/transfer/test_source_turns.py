"""Late reservation's turn rule (`transfer.source.num_due_to_reserve`), shared by the live prefill worker and the
simulator."""

from __future__ import annotations

from kvbaton.transfer.source import num_due_to_reserve


def test_the_head_goes_while_little_is_left_ahead_and_each_one_adds_its_prompt() -> None:
    assert num_due_to_reserve(0, [100, 50, 30], 64) == 1  # 0 ahead: the first goes; then 100 > 64
    assert num_due_to_reserve(0, [10, 20, 30, 40], 64) == 4  # 0, 10, 30, 60 ahead: all four go
    assert num_due_to_reserve(64, [10], 64) == 1  # exactly at the limit still goes
    assert num_due_to_reserve(65, [10], 64) == 0
    assert num_due_to_reserve(0, [], 64) == 0
    assert num_due_to_reserve(0, [5, 5], 0) == 1  # ahead 0: one at a time
