"""Fidelity to the base in free generation: HAMburger's greedy tokens against the base's, used
by `infer.eval` and by the trainer's generation check (so a run can be judged in free
generation, where teacher-forced validation can mislead)."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def token_agreement(base: Sequence[Sequence[int]],
                    ham: Sequence[Sequence[int]]) -> dict[str, float]:
  """HAMburger's greedy tokens against the base's, example by example: `identical`, the fraction
  of examples with exactly the base's tokens, and `prefix_agreement`, the mean of (common prefix
  length / the base's length), i.e. how much of the base's answer HAMburger reproduces before it
  first departs (1 for identical outputs, so that two empty answers agree)."""
  if len(base) != len(ham):
    raise ValueError(f"{len(base)} base and {len(ham)} HAMburger generations: compare the same "
                     "examples")
  identical, prefix = [], []
  for b, h in zip(base, ham):
    b, h = list(b), list(h)
    common = next((i for i, (x, y) in enumerate(zip(b, h)) if x != y), min(len(b), len(h)))
    identical.append(float(b == h))
    prefix.append(1.0 if b == h else common / max(len(b), 1))
  mean = lambda xs: float(np.mean(xs)) if xs else float("nan")
  return {"identical": mean(identical), "prefix_agreement": mean(prefix)}
