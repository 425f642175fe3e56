"""Regressions found by bug hunting: speculative decoding's verification in the sampler.

Each test failed on the code it was written against; the fix it guards is named in its comment.
"""

from __future__ import annotations

import torch

from kvbaton.core.sampling import SamplingParams
from kvbaton.engine.sampler import Sampler


def test_sampled_verification_under_top_p_keeps_the_nucleus_distribution() -> None:
    # Was a bug (engine/sampler.py `Sampler._probs`): top-p zeroed the tokens outside the nucleus without
    # renormalising the rest. Sampling (multinomial) does not care, but `verify` accepts a draft with probability
    # p(draft): it accepted the draft below its nucleus probability (0.3 instead of 0.375 here) and replaced it by
    # the other token too often; and when the draft was the nucleus's only token, a rejection left nothing to draw
    # and torch.multinomial raised, failing the step. Fixed: `_probs` renormalises after top-p.
    rows = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]]))
    sampler = Sampler(0)
    nucleus = SamplingParams(temperature=1.0, top_p=0.7, seed=3)  # keeps tokens 0 and 1: 0.625 and 0.375
    counts = torch.zeros(3)
    trials = 20000
    for _ in range(trials):
        counts[sampler.verify(rows, (1,), nucleus, "r")[0].token_id] += 1
    assert counts[2] == 0
    assert torch.allclose(counts / trials, torch.tensor([0.625, 0.375, 0.0]), atol=0.015)

    only_top = SamplingParams(temperature=1.0, top_p=0.5, seed=4)  # the nucleus is token 0 alone
    for _ in range(200):
        tokens = sampler.verify(rows, (0,), only_top, "s")
        assert [t.token_id for t in tokens] == [0, 0]
