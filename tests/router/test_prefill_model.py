"""PrefillTimeModel: prediction formula, non-negative least-squares fit, validation."""

from __future__ import annotations

import random

import pytest

from kvbaton.router.prefill_model import PrefillSample, PrefillTimeModel


def test_predict_follows_the_formula_with_ctx_including_new_tokens() -> None:
    model = PrefillTimeModel(0.5, 0.01, 0.001, 1e-5)
    assert model.predict(100, 300) == pytest.approx(0.5 + 1.0 + 0.4 + 1e-5 * 100 * 400)
    assert model.predict(0, 300) == 0.0
    assert model.marginal_s(100, 300) == pytest.approx(model.predict(100, 300) - 0.5)


def test_fit_recovers_known_coefficients_from_noisy_samples() -> None:
    truth = PrefillTimeModel(0.02, 3e-4, 5e-5, 2e-8)
    rng = random.Random(0)
    samples = []
    for _ in range(200):
        new, cached = rng.randrange(1, 4096), rng.randrange(0, 8192)
        samples.append(PrefillSample(new, cached, truth.predict(new, cached) * (1 + rng.uniform(-0.01, 0.01))))
    fitted = PrefillTimeModel.fit(samples)
    for new, cached in [(16, 0), (512, 1024), (4000, 8000)]:
        assert fitted.predict(new, cached) == pytest.approx(truth.predict(new, cached), rel=0.05)


def test_fit_keeps_coefficients_non_negative() -> None:
    # Time falls slightly with context in these samples; an unconstrained fit would give c < 0.
    samples = [PrefillSample(n, c, 0.01 + 1e-4 * n - 1e-7 * c) for n in (10, 100, 1000) for c in (0, 500, 1000)]
    fitted = PrefillTimeModel.fit(samples)
    assert min(fitted.overhead_s, fitted.s_per_new_token, fitted.s_per_ctx_token, fitted.s_per_new_ctx_token) >= 0
    assert fitted.predict(1000, 0) == pytest.approx(0.11, rel=0.05)


def test_invalid_models_and_tiny_sample_sets_are_rejected() -> None:
    with pytest.raises(ValueError):
        PrefillTimeModel(-1.0)
    with pytest.raises(ValueError):
        PrefillTimeModel.fit([PrefillSample(1, 0, 0.1)] * 3)
