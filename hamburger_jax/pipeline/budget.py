"""The pipeline's budget: each part's minutes out of the run's, and how much work fits them."""

from __future__ import annotations

import math
from typing import Iterable, Sequence

# Shares of the budget (sum 1). Self-distillation generates every token the stages train on,
# the teacher pass reads them ~3x faster; training takes half; export and evaluation load a
# model and compile; the pick reads a log.
SHARES = {"self_distill": 0.25, "prepare_data": 0.12, "train": 0.50, "pick": 0.01,
          "export": 0.04, "eval": 0.08}
# How much faster the teacher pass reads a response token than self-distillation generates
# one, on 2 CPU cores: 2.7-2.8x (docs/results/data.md: 143k tokens in 29 min, then 617 s;
# 314k in 35 min, then 779 s); rounded down, so that the answers fit the teacher pass's share.
TEACHER_SPEEDUP = 2.5
# Below this many minutes of training per stage a staged config trains its last stage alone,
# from a fresh graft: each stage compiles its own train and evaluation steps (on a GPU, half a
# minute to a minute and a half each), which a few minutes cannot pay for three times.
MIN_STAGE_MINUTES = 4.0


def share_of_left(shares: dict[str, float], done: Iterable[str], left: float,
                  part: str) -> float:
  """`part`'s share of what is `left` (minutes, seconds), among the parts not `done`: a quick
  part hands what it did not use on to the later ones, in proportion to their shares, and an
  overrun comes out of theirs; nothing left gives 0. The pipeline's parts and the accelerator
  check's (infer/accelerator_check.py) share their budgets by this rule."""
  done = set(done)
  pending = sum(s for p, s in shares.items() if p not in done)
  return max(left, 0.0) * shares[part] / pending if pending > 0 else 0.0


def part_budget(shares: dict[str, float], used: dict[str, float], total: float,
                part: str) -> float:
  """Minutes for `part`: its share of the minutes left, among the parts not finished yet.

  `shares` maps every part (in order) to its share, `used` each finished part to the minutes
  it took (share_of_left; nothing left gives 0: the part's least work, one training step, one
  answer)."""
  return share_of_left(shares, used, total - sum(used.values()), part)


def part_shares(stages: Sequence[tuple[str, int]]) -> dict[str, float]:
  """SHARES with "train" split over the stages ((part name, train.steps) in order) by steps."""
  steps = sum(n for _, n in stages)
  out = {}
  for name, share in SHARES.items():
    if name == "train":
      out.update({part: share * n / steps for part, n in stages})
    else:
      out[name] = share
  return out


def one_stage(stages: int, budget_minutes: float) -> bool:
  """Whether a config of `stages` stages trains its last stage alone in `budget_minutes`."""
  return stages > 1 and budget_minutes * SHARES["train"] < MIN_STAGE_MINUTES * stages


def teacher_limit(answers: list[int], budget: float, rate: float | None) -> int:
  """How many answers (response tokens of each, in file order) the teacher pass reads in
  `budget` minutes, self-distillation having generated `rate` tokens a minute (None: not
  measured, all of them): at least two, a training sample and a validation one."""
  if rate is None:
    return len(answers)
  capacity, n = budget * rate * TEACHER_SPEEDUP, 0
  for tokens in answers:
    capacity -= tokens
    if capacity < 0:
      break
    n += 1
  return min(max(n, 2), len(answers))


def eval_limit(tasks: Sequence[str], most: int, budget: float, rate: float | None) -> int:
  """Examples per task that fit `budget` minutes, decoding at self-distillation's `rate` in
  base mode and at one confidence (at most `most`)."""
  from hamburger_jax.evaluation.run import MAX_NEW_TOKENS  # pylint: disable=C0415
  per_example = 2 * sum(MAX_NEW_TOKENS.get(t, 0) for t in tasks)
  if rate is None or per_example == 0:
    return most
  return max(1, min(most, math.floor(budget * rate / per_example)))
