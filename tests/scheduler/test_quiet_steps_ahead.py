"""`num_quiet_steps_ahead` counts quiet steps that `advance_quiet_decodes` would find, and `apply_quiet_decodes`
applies such a step exactly as `advance_quiet_decodes` does.

Two schedulers admit the same handed-off requests (stop rules, lengths and limits drawn at random) and decode
them together, with tokens that are never a stop or end-of-sequence token. The tested one counts the batch's
quiet steps ahead once, applies that many untested with `apply_quiet_decodes`, the reference with
`advance_quiet_decodes`: every one of those must be quiet for the reference, both schedulers must agree after
each, and the step after them must not be quiet when the count was not zero for a rule the tokens could break.
"""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvbaton.core.request import Request
from kvbaton.core.step import SampledToken
from kvbaton.scheduler.steady_decodes import (advance_quiet_decodes, apply_quiet_decodes, num_quiet_steps_ahead,
                                              schedule_decodes_after_quiet)
from tests.scheduler.helpers import make_request, make_scheduler, scheduler_state

EOS = 2
request_spec = st.tuples(st.integers(2, 12), st.integers(2, 14), st.sampled_from(["plain", "eos", "ignore", "stop",
                                                                                  "short"]))


def _handed_off(request_id: str, spec: tuple[int, int, str]) -> Request:
    """A request whose prompt is computed and first token sampled (as a decode worker adopts it)."""
    prompt_len, max_tokens, kind = spec
    request = make_request(request_id, prompt_len, max_tokens=max_tokens,
                           eos_token_id=EOS if kind in ("eos", "ignore") else None, ignore_eos=kind == "ignore",
                           stop_token_ids=(7,) if kind == "stop" else (),
                           max_model_len=prompt_len + 5 if kind == "short" else 8192)
    request.output_token_ids.append(5)
    request.first_token_at = 0.0
    return request


@settings(max_examples=120, deadline=None, derandomize=True)
@given(specs=st.lists(request_spec, min_size=1, max_size=4), prefix_cache=st.booleans())
def test_counted_quiet_steps_are_quiet_and_applied_alike(specs: list[tuple[int, int, str]],
                                                         prefix_cache: bool) -> None:
    tested, reference = (make_scheduler(256, prefix_cache=prefix_cache, max_num_batched_tokens=64)
                         for _ in range(2))
    ids = [f"r{i}" for i in range(len(specs))]
    batches = []
    for sched in (tested, reference):
        for request_id, spec in zip(ids, specs):
            assert sched.admit_prefilled(_handed_off(request_id, spec), spec[0], 0.0)
        batches.append(sched.schedule_decodes())
    tested_batch, reference_batch = batches
    assert tested_batch is not None and reference_batch is not None
    num_ahead = num_quiet_steps_ahead(tested_batch)
    now = 1.0
    for _ in range(num_ahead):
        tokens = [SampledToken(5)] * len(tested_batch)
        num_growing = apply_quiet_decodes(tested, tested_batch, tokens)
        assert advance_quiet_decodes(reference, reference_batch, tokens, now) == num_growing
        assert scheduler_state(tested, ids) == scheduler_state(reference, ids)
        tested_batch = schedule_decodes_after_quiet(tested, tested_batch, num_growing)
        reference_batch = schedule_decodes_after_quiet(reference, reference_batch, num_growing)
        assert tested_batch is not None and reference_batch is not None
        assert [r.request_id for r in tested_batch] == [r.request_id for r in reference_batch] == ids
        now += 1.0
    # The count is exact for requests whose only limits are lengths: the next step is not quiet.
    exact = num_ahead > 0 or all(kind in ("plain", "ignore", "short") for _, _, kind in specs)
    if exact:
        assert advance_quiet_decodes(reference, reference_batch, [SampledToken(5)] * len(ids), now) == -1
    event(f"steps ahead>0={num_ahead > 0}")


def test_no_steps_ahead_for_stop_rules_the_tokens_decide() -> None:
    sched = make_scheduler(64)
    for request_id, kind in (("e", "eos"), ("s", "stop")):
        assert sched.admit_prefilled(_handed_off(request_id, (4, 9, kind)), 4, 0.0)
    decodes = sched.schedule_decodes()
    assert decodes is not None
    assert num_quiet_steps_ahead(decodes) == 0
    assert num_quiet_steps_ahead(decodes[:1]) == 0 and num_quiet_steps_ahead(decodes[1:]) == 0
    # With an ignored end of sequence: 9 tokens at most, one output, so 7 quiet steps (the 9th token ends it).
    plain = make_scheduler(64)
    assert plain.admit_prefilled(_handed_off("i", (4, 9, "ignore")), 4, 0.0)
    decodes = plain.schedule_decodes()
    assert decodes is not None and num_quiet_steps_ahead(decodes) == 7
    assert num_quiet_steps_ahead([]) == 0
