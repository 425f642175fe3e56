"""The `conversation` workload: shared system prompts, turns resending the whole history, heavy-tailed think times."""

from __future__ import annotations

import statistics

import numpy as np
import pytest

from kvbaton.bench.pooled import pooled_lru_hit_ratio
from kvbaton.bench.workloads import create_workload
from kvbaton.core.errors import InvalidRequestError


def _by_session(requests):
    sessions: dict[str, list] = {}
    for r in requests:
        sessions.setdefault(r.group, []).append(r)
    return sessions


def test_each_turn_resends_the_history_plus_the_last_answer_and_a_new_message():
    requests = create_workload("conversation", seed=0, num_sessions=50, system_prompt_tokens=300,
                               num_system_prompts=2)
    sessions = _by_session(requests)
    assert len(sessions) == 50
    systems = {r.prompt_token_ids[:300] for r in requests}
    assert len(systems) == 2  # every prompt opens with one of the shared system prompts
    for turns in sessions.values():
        for prev, turn in zip(turns, turns[1:]):
            assert turn.arrival_s >= prev.arrival_s
            prompt, before = turn.prompt_token_ids, prev.prompt_token_ids
            assert prompt[:len(before)] == before
            # the previous answer (as many tokens as it asked for) and one new user message follow
            assert len(prompt) >= len(before) + prev.output_tokens + 4
            assert len(turn.prompt_parts) == len(prev.prompt_parts) + 2


def test_parameters_shape_the_sessions():
    requests = create_workload("conversation", seed=1, num_sessions=300, mean_turns=4.0, max_turns=6,
                               user_mean_tokens=50, user_std_tokens=10, answer_mean_tokens=80, answer_std_tokens=20)
    sessions = _by_session(requests)
    counts = [len(t) for t in sessions.values()]
    assert max(counts) <= 6 and statistics.mean(counts) == pytest.approx(3.29, abs=0.4)  # E[min(geometric(1/4), 6)]
    assert statistics.mean(r.output_tokens for r in requests) == pytest.approx(80, rel=0.1)
    # sessions interleave: the first 100 requests come from many sessions
    assert len({r.group for r in requests[:100]}) > 30


def test_think_times_are_heavy_tailed_with_the_given_mean():
    requests = create_workload("conversation", seed=2, num_sessions=2000, mean_turns=3.0, think_mean_s=20.0,
                               answer_mean_tokens=20, answer_std_tokens=5, user_mean_tokens=10, user_std_tokens=2,
                               system_prompt_tokens=16)
    gaps = np.array([b.arrival_s - a.arrival_s for turns in _by_session(requests).values()
                     for a, b in zip(turns, turns[1:])])
    assert gaps.mean() == pytest.approx(20.0, rel=0.3)
    assert np.median(gaps) < 0.6 * gaps.mean()  # most users answer quickly...
    assert np.percentile(gaps, 99) > 5 * gaps.mean()  # ...and a few come back much later


def test_rate_sets_the_request_rate_and_the_context_limit_ends_sessions():
    requests = create_workload("conversation", seed=3, num_sessions=400, rate=16.0, mean_turns=8.0,
                               think_mean_s=1.0)
    assert len(requests) / requests[-1].arrival_s == pytest.approx(16.0, rel=0.3)
    capped = create_workload("conversation", seed=3, num_sessions=100, max_context_tokens=3000)
    assert max(r.num_prompt_tokens + r.output_tokens for r in capped) <= 3000


def test_the_pooled_bound_grows_with_memory():
    requests = create_workload("conversation", seed=4, num_sessions=80, system_prompt_tokens=200)
    small, large = (pooled_lru_hit_ratio(requests, capacity, 16).hit_ratio for capacity in (100, None))
    assert 0.0 < small < large and large > 0.6


def test_bad_parameters_are_refused():
    with pytest.raises(InvalidRequestError):
        create_workload("conversation", think_shape=1.0)
    with pytest.raises(InvalidRequestError):
        create_workload("conversation", num_sessions=0)
