"""Intervals of evaluation scores: the percentile bootstrap over examples, and its paired form
for the difference of two systems scored on the same examples."""

from __future__ import annotations

from typing import Sequence

import numpy as np

BOOTSTRAP_RESAMPLES = 1000


def bootstrap_ci(scores: Sequence[float], n_resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0,
                 level: float = 0.95) -> tuple[float, float]:
  """Percentile-bootstrap interval of the mean of `scores`: the examples are resampled with
  replacement n_resamples times; (nan, nan) without scores. Seeded, so reruns write the same
  results.json."""
  x = np.asarray(scores, np.float64)
  if x.ndim != 1:
    raise ValueError(f"scores must be one number per example, got shape {x.shape}")
  if n_resamples < 1 or not 0.0 < level < 1.0:
    raise ValueError(f"n_resamples={n_resamples} must be >= 1 and level={level} in (0, 1)")
  if len(x) == 0:
    return float("nan"), float("nan")
  rng = np.random.default_rng(seed)
  means = x[rng.integers(0, len(x), size=(n_resamples, len(x)))].mean(axis=1)
  lo, hi = np.percentile(means, [50.0 * (1.0 - level), 50.0 * (1.0 + level)])
  return float(lo), float(hi)


def paired_bootstrap_ci(a: Sequence[float], b: Sequence[float],
                        n_resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0,
                        level: float = 0.95) -> tuple[float, float]:
  """Interval of mean(a) - mean(b) when a[i] and b[i] score the same example: each resample draws
  examples, keeping their pair together, so what the examples share (an easy or a hard prompt)
  cancels and the interval is that of the difference alone: the bootstrap of a - b."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if a.shape != b.shape:
    raise ValueError(f"paired scores need one pair per example, got {a.shape} and {b.shape}")
  return bootstrap_ci(a - b, n_resamples, seed, level)
