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


DIVERGENCE_KINDS = ("micro_token", "after_merged", "after_single")


def first_divergence(base: Sequence[Sequence[int]], ham: Sequence[Sequence[int]],
                     groups: Sequence[Sequence[int]]) -> dict[str, float]:
  """Where HAMburger's answer first leaves the base's, as fractions of the examples: at a micro
  token (a group's token i >= 1, which the micro decoder chose and the stop head accepted), or at
  a group's first token (the base's own prediction) read right after a merged entry
  (`after_merged`) or after a single-token entry (`after_single`: the merged entries that
  changed it lie further back). Identical answers, and answers where one is the other cut short
  by max_new_tokens, count in none, so the three fractions sum to at most 1 - identical. The
  split says which part of the graft costs quality: the micro decoder and stop head, or how the
  base reads merged entries."""
  if not len(base) == len(ham) == len(groups):
    raise ValueError(f"{len(base)} base and {len(ham)} HAMburger generations with {len(groups)} "
                     "group lists: compare the same examples")
  counts = dict.fromkeys(DIVERGENCE_KINDS, 0)
  for b, h, gs in zip(base, ham, groups):
    d = next((i for i, (x, y) in enumerate(zip(b, h)) if x != y), None)
    if d is None:
      continue
    start = prev = 0
    for g in gs:
      if d < start + g:
        break
      start, prev = start + g, g
    kind = "micro_token" if d > start else "after_merged" if prev >= 2 else "after_single"
    counts[kind] += 1
  n = max(len(base), 1)
  return {f"diverge_{k}": v / n for k, v in counts.items()}
