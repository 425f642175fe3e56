"""Prefill-time model the router uses to price work: t = a + b·new + c·ctx + d·new·ctx, fitted from measurements.

`new` is the number of prompt tokens actually computed (the uncached suffix) and `ctx` the context
length at the end of the prefill (cached + new), so `d·new·ctx` covers both the attention over the
cached prefix and the quadratic self-attention of the new tokens. Coefficients are kept
non-negative so a prediction never goes below the fixed overhead `a`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbaton.core.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class PrefillSample:
    num_new_tokens: int  # tokens computed by the prefill
    num_cached_tokens: int  # prefix tokens already in KV (prefix-cache hit)
    duration_s: float  # measured prefill time


@dataclass(frozen=True, slots=True)
class PrefillTimeModel:
    # Defaults: SmolLM2-135M on a few CPU cores, order of magnitude only (~5k prompt tokens/s).
    overhead_s: float = 0.01  # a: fixed cost of one prefill
    s_per_new_token: float = 2e-4  # b
    s_per_ctx_token: float = 0.0  # c
    s_per_new_ctx_token: float = 1e-8  # d: attention, new tokens x context

    def __post_init__(self) -> None:
        coeffs = (self.overhead_s, self.s_per_new_token, self.s_per_ctx_token, self.s_per_new_ctx_token)
        if any(not np.isfinite(x) or x < 0.0 for x in coeffs):
            raise InvalidRequestError(f"prefill model coefficients must be finite and >= 0, got {coeffs}")

    def predict(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Seconds to prefill `new_tokens` on top of `cached_tokens` already in KV (0 new tokens -> 0 s)."""
        if new_tokens <= 0:
            return 0.0
        ctx_tokens = cached_tokens + new_tokens
        return (
            self.overhead_s
            + self.s_per_new_token * new_tokens
            + self.s_per_ctx_token * ctx_tokens
            + self.s_per_new_ctx_token * new_tokens * ctx_tokens
        )

    def marginal_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """`predict` without the fixed overhead: the cost `new_tokens` add to a prefill that runs anyway."""
        return max(0.0, self.predict(new_tokens, cached_tokens) - self.overhead_s) if new_tokens > 0 else 0.0

    @staticmethod
    def fit(samples: Sequence[PrefillSample]) -> PrefillTimeModel:
        """Non-negative least squares over (1, new, ctx, new·ctx).

        With four terms, exact NNLS is cheap: the optimum is the unconstrained least-squares fit on
        some subset of the columns, so every subset is tried and the best non-negative one kept.
        """
        if len(samples) < 4:
            raise InvalidRequestError(f"need at least 4 prefill samples to fit, got {len(samples)}")
        new = np.array([s.num_new_tokens for s in samples], dtype=np.float64)
        ctx = new + np.array([s.num_cached_tokens for s in samples], dtype=np.float64)
        y = np.array([s.duration_s for s in samples], dtype=np.float64)
        features = np.stack([np.ones_like(new), new, ctx, new * ctx], axis=1)
        # Columns differ by orders of magnitude; scale them so lstsq is well conditioned.
        scale = np.maximum(np.abs(features).max(axis=0), 1e-12)
        scaled = features / scale
        best_coeffs = np.zeros(4)
        best_residual = float(np.sum(y * y))
        for size in range(1, 5):
            for subset in itertools.combinations(range(4), size):
                cols = list(subset)
                solution, *_ = np.linalg.lstsq(scaled[:, cols], y, rcond=None)
                if np.any(solution < 0.0):
                    continue
                coeffs = np.zeros(4)
                coeffs[cols] = solution
                residual = float(np.sum((scaled @ coeffs - y) ** 2))
                if residual < best_residual - 1e-15:
                    best_coeffs, best_residual = coeffs, residual
        a, b, c, d = (float(x) for x in best_coeffs / scale)
        return PrefillTimeModel(a, b, c, d)
