"""Which saved step of a stage to ship: the pick rule, applied to a run's generation checks.

A stage run with `train.generate_every` checks free generation against the frozen base every so
many steps (metrics.jsonl: gen_tokens_per_step, gen_prefix_agreement, gen_identical; step 0 is
the graft it started from). The rule, fixed before the runs it judges (docs/results/training.md):
among the saved steps whose prefix agreement is at least the starting graft's, the one
with the most tokens per macro step (ties: the higher agreement, then the earlier step); when no
step keeps the start's agreement, the step with the best agreement, flagged as a fallback (a
candidate to evaluate, not a graft that compresses more at the start's fidelity). `table`
shows the checks as markdown (python -m train.pick prints it with the pick).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from hamburger_jax.run_config import saved_steps  # noqa: F401  (pick's API)

GEN_KEYS = ("gen_tokens_per_step", "gen_prefix_agreement", "gen_identical")


@dataclasses.dataclass(frozen=True)
class Pick:
  step: int
  fallback: bool  # no step kept the start's agreement: the best agreement instead
  start_agreement: float


def checks(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  return [r for r in rows if all(k in r for k in GEN_KEYS)]


def pick_step(rows: Sequence[dict[str, Any]], saved: set[int] | None = None) -> Pick:
  """The pick rule on a run's metrics rows; `saved` limits it to steps with a checkpoint."""
  checked = checks(rows)
  start = next((r for r in checked if r["step"] == 0), None)
  if start is None:
    raise ValueError("the run has no generation check at step 0 (the graft it started from): "
                     "train the stage with train.generate_every > 0")
  later = [r for r in checked if r["step"] > 0 and (saved is None or r["step"] in saved)]
  if not later:
    raise ValueError("no saved step after 0 has a generation check: save checkpoints at the "
                     "checked steps (checkpoint.every = train.generate_every)")
  base = start["gen_prefix_agreement"]
  keep = [r for r in later if r["gen_prefix_agreement"] >= base]
  if keep:
    best = max(keep, key=lambda r: (r["gen_tokens_per_step"], r["gen_prefix_agreement"],
                                    -r["step"]))
    return Pick(best["step"], False, base)
  best = max(later, key=lambda r: (r["gen_prefix_agreement"], -r["step"]))
  return Pick(best["step"], True, base)


def table(rows: Sequence[dict[str, Any]], pick: Pick, saved: set[int] | None) -> str:
  lines = ["| step | saved | tokens / step | prefix agreement | identical | |",
           "|---|---|---|---|---|---|"]
  for r in checks(rows):
    mark = "**pick**" if r["step"] == pick.step else (
        "start" if r["step"] == 0 else "")
    is_saved = "-" if saved is None else ("yes" if r["step"] in saved else "no")
    lines.append(f"| {r['step']} | {is_saved} | {r['gen_tokens_per_step']:.3f} | "
                 f"{r['gen_prefix_agreement']:.3f} | {r['gen_identical']:.3f} | {mark} |")
  return "\n".join(lines)
