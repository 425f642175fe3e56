"""Regressions found by bug hunting: the simulator's speculative decoding and its copying outputs.

Each test failed on the code it was written against; the fix it guards is named in its comment.
"""

from __future__ import annotations

import pytest

from kvbaton.sim.outputs import FIRST_FRESH_TOKEN, CopyingOutputs

PROMPT = list(range(1000, 3000))


@pytest.mark.parametrize("mean_span", [1.0, 2.0, 4.0])
def test_copying_outputs_copy_their_fraction_whatever_the_span(mean_span: float) -> None:
    # Was a bug (sim/outputs.py `CopyingOutputs.__init__`): a fresh run ended with probability p = f / (L (1 - f))
    # before each of its tokens, so it ran (1 - p) / p tokens on average, not the documented L (1 - f) / f, and the
    # copied share was L / (L / f - 1): 1.0 instead of 0.5 for `--output-copy-span 1`, 0.67 for a span of 2.
    # Fixed: p = f / (f + L (1 - f)), which gives fresh runs of L (1 - f) / f tokens.
    outputs = CopyingOutputs(0.5, mean_span, seed=3)
    outputs.prompt_of = lambda request_id: PROMPT
    tokens = [outputs("r", i) for i in range(40_000)]
    copied = sum(t < FIRST_FRESH_TOKEN for t in tokens) / len(tokens)
    assert 0.48 < copied < 0.52, copied
