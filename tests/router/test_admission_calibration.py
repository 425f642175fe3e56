"""CalibratedTimeModel: measured TTFT/TPOT against the uncorrected prediction tune the step-time scales."""

from __future__ import annotations

import pytest

from kvbaton.core.errors import InvalidRequestError
from kvbaton.router.admission import CalibratedTimeModel


class Base:
    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        return 1e-3 * new_tokens

    def decode_s(self, num_seqs: int, context_tokens: int) -> float:
        return 0.01 * num_seqs


def test_scales_follow_the_measured_ratio_and_price_every_prediction() -> None:
    model = CalibratedTimeModel(Base(), smoothing=0.5)
    assert model.prefill_s(100) == pytest.approx(0.1) and model.decode_s(2, 0) == pytest.approx(0.02)
    for _ in range(20):  # the host runs prefills 2x and decodes 1.5x slower than profiled
        model.observe_ttft(0.1, 0.2)
        model.observe_tpot(0.02, 0.03)
    assert model.prefill_scale == pytest.approx(2.0, rel=1e-4) and model.decode_scale == pytest.approx(1.5, rel=1e-4)
    assert model.prefill_s(100) == pytest.approx(0.2, rel=1e-4) and model.decode_s(2, 0) == pytest.approx(0.03, rel=1e-4)
    assert (model.num_ttft_observations, model.num_tpot_observations) == (20, 20)


def test_an_outlier_moves_the_scale_a_bounded_step_and_nonsense_is_ignored() -> None:
    model = CalibratedTimeModel(Base(), smoothing=0.2, max_scale=8.0)
    model.observe_ttft(0.001, 100.0)  # a 100,000x outlier counts as 8x
    assert model.prefill_scale == pytest.approx(0.8 + 0.2 * 8.0)
    model.observe_ttft(0.0, 1.0)
    model.observe_tpot(0.01, -1.0)
    assert model.num_ttft_observations == 1 and model.num_tpot_observations == 0
    with pytest.raises(InvalidRequestError):
        CalibratedTimeModel(Base(), smoothing=0.0)
