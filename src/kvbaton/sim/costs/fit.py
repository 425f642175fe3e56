"""Fit `LinearCoefficients` to measured steps: non-negative least squares over DistServe's terms.

Prefill-only steps fit a + b·Σl + c·Σl² + d·Σ l·ctx; decode-only steps fit a + b·Σctx + c·B (one
regime: a CPU or small GPU shows no batch-size knee worth a second set); mixed steps are kept to
report how well the combination rule of `LinearCostModel` predicts them. A log with too few steps of
one kind (a decode worker that prefills short prompts itself logs mixed steps, its prefill worker a
handful of cold prompts) is fitted jointly instead: every step, one shared intercept (`fit_joint`).
Samples round-trip through JSON lines (`write_step_samples` / `read_step_samples`): serving workers
log theirs that way.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvbaton.core.errors import InvalidRequestError
from kvbaton.sim.costs.base import BatchShape
from kvbaton.sim.costs.linear import LinearCoefficients, LinearCostModel


@dataclass(frozen=True, slots=True)
class StepSample:
    shape: BatchShape
    duration_s: float


@dataclass(frozen=True, slots=True)
class FitQuality:
    num_samples: int
    mean_abs_rel_error: float  # mean |predicted - measured| / measured
    max_abs_rel_error: float


def fit_nonnegative(features: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Exact NNLS for a handful of columns: the best unconstrained fit over every column subset that is >= 0."""
    scale = np.maximum(np.abs(features).max(axis=0), 1e-12)
    scaled = features / scale
    best, best_residual = np.zeros(features.shape[1]), float(np.sum(y * y))
    for size in range(1, features.shape[1] + 1):
        for cols in itertools.combinations(range(features.shape[1]), size):
            solution, *_ = np.linalg.lstsq(scaled[:, list(cols)], y, rcond=None)
            if np.any(solution < 0):
                continue
            coeffs = np.zeros(features.shape[1])
            coeffs[list(cols)] = solution
            residual = float(np.sum((scaled @ coeffs - y) ** 2))
            if residual < best_residual - 1e-18:
                best, best_residual = coeffs, residual
    return best / scale


def fit_linear(samples: Sequence[StepSample]) -> LinearCoefficients:
    """Prefill-only and decode-only steps fitted apart; with fewer than 4 and 3 of them, `fit_joint`."""
    prefill = [s for s in samples if s.shape.prefill_new_tokens and not s.shape.num_decodes]
    decode = [s for s in samples if s.shape.num_decodes and not s.shape.prefill_new_tokens]
    if len(prefill) < 4 or len(decode) < 3:
        return fit_joint(samples)
    xp = np.array([[1.0, sum(s.shape.prefill_new_tokens), sum(n * n for n in s.shape.prefill_new_tokens),
                    sum(n * c for n, c in zip(s.shape.prefill_new_tokens, s.shape.prefill_context_tokens))]
                   for s in prefill])
    xd = np.array([[1.0, s.shape.decode_context_tokens, s.shape.num_decodes] for s in decode])
    p = fit_nonnegative(xp, np.array([s.duration_s for s in prefill]))
    d = fit_nonnegative(xd, np.array([s.duration_s for s in decode]))
    decode_coeffs = (float(d[0]), float(d[1]), float(d[2]))
    return LinearCoefficients((float(p[0]), float(p[1]), float(p[2]), float(p[3])), decode_coeffs, decode_coeffs)


def fit_joint(samples: Sequence[StepSample]) -> LinearCoefficients:
    """One forward per step, whatever it holds: a + b·Σl + c·Σl² + d·Σ l·ctx + e·Σctx_decode + f·B over every
    step (prefill-only, decode-only and mixed alike), non-negative, one intercept shared by both phases.

    `LinearCostModel` prices a mixed step as prefill + decode - min(a_prefill, a_decode), which with one shared
    `a` is exactly this sum."""
    rows = [s for s in samples if s.shape.prefill_new_tokens or s.shape.num_decodes]
    prefill = sum(1 for s in rows if s.shape.prefill_new_tokens)
    if len(rows) < 8 or not prefill or prefill == len(rows):
        raise InvalidRequestError(f"need >= 8 timed steps, prefill and decode among them, got {len(rows)} "
                                  f"({prefill} with prefill chunks)")
    x = np.array([[1.0, sum(s.shape.prefill_new_tokens), sum(n * n for n in s.shape.prefill_new_tokens),
                   sum(n * c for n, c in zip(s.shape.prefill_new_tokens, s.shape.prefill_context_tokens)),
                   s.shape.decode_context_tokens, s.shape.num_decodes] for s in rows])
    a, b, c, d, e, f = (float(v) for v in fit_nonnegative(x, np.array([s.duration_s for s in rows])))
    return LinearCoefficients((a, b, c, d), (a, e, f), (a, e, f))


def fit_quality(model: LinearCostModel, samples: Sequence[StepSample]) -> FitQuality:
    if not samples:
        return FitQuality(0, 0.0, 0.0)
    errors = [abs(model.step_s(s.shape) - s.duration_s) / s.duration_s for s in samples if s.duration_s > 0]
    return FitQuality(len(samples), float(np.mean(errors)), float(np.max(errors)))


def write_step_samples(path: str | Path, samples: Sequence[StepSample]) -> None:
    """One JSON line per sample: the batch shape's fields and `duration_s`."""
    with Path(path).open("w") as out:
        for sample in samples:
            shape = sample.shape
            out.write(json.dumps({"prefill_new_tokens": shape.prefill_new_tokens,
                                  "prefill_context_tokens": shape.prefill_context_tokens,
                                  "num_decodes": shape.num_decodes,
                                  "decode_context_tokens": shape.decode_context_tokens,
                                  "duration_s": sample.duration_s}) + "\n")


def read_step_samples(paths: Sequence[str | Path]) -> list[StepSample]:
    """The samples `write_step_samples` wrote, from every file in order; every step timed (a positive, finite
    duration). A file that cannot be read, or a line that is not a sample, is an InvalidRequestError naming it."""
    samples: list[StepSample] = []
    for path in paths:
        if not Path(path).is_file():
            raise InvalidRequestError(f"step log not found: {path}")
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidRequestError(f"cannot read step log {path}: {exc}") from None
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                shape = BatchShape(tuple(int(n) for n in row["prefill_new_tokens"]),
                                   tuple(int(n) for n in row["prefill_context_tokens"]),
                                   int(row["num_decodes"]), int(row["decode_context_tokens"]))
                duration_s = float(row["duration_s"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise InvalidRequestError(f"{path}:{number}: not a step sample ({exc})") from None
            if not (math.isfinite(duration_s) and duration_s > 0):
                raise InvalidRequestError(f"{path}:{number}: duration_s {duration_s}; a step log's durations are "
                                          "positive seconds")
            samples.append(StepSample(shape, duration_s))
    return samples
