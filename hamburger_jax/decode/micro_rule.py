"""The batch-aware micro loop's setting: when a batch's next micro step runs (decode/step.py:
`pays`). A macro step of many rows runs micro step i + 1 while enough rows go on to pay for
it, judged by r = micro step / base step at that batch: its cost ratio at each micro batch
size a macro step may run its micro steps at (step.micro_sizes), r1 the same of micro step 1
(which reads the F features and e(t0)), and m, what a base step whose rows' entries are
merged and unmerged costs over a plain one (micro step 1 makes it).

  "off"   r = r1 = m = 0: every micro step a row goes on for runs (the rule of docs/method.md
          section 3 alone; tokens do not depend on the batch mates);
  "auto"  measured: each micro batch's micro steps (1, and a later one) and the batch's base
          steps (plain, and half of its rows merged) timed once, in jitted loops of the
          decoding layout (decode/step_costs.py), per engine and slot count; m = 0 without
          merged-entry adapters, which make a mixed step cost more;
  a number r >= 0: r = r1 = r at every micro batch, m = 0 (a lone row is never cut: `pays`
          takes r at most 1).

The ratios are a runtime operand of the decode program (DecodeState.micro_cost), so every
setting runs the same compiled program.
"""

from __future__ import annotations

import numpy as np

from hamburger_jax.decode.requests import GenerationError
from hamburger_jax.decode.step import has_adapters, micro_cost, micro_sizes

MICRO_RULES = ("off", "auto")
DEFAULT_MICRO_RULE = "off"
# Rounds of each probe loop (the fastest kept): the probe runs once per engine and slot count.
PROBE_REPEATS = 3


def parse(rule: str | float) -> str | float:
  """"off", "auto" or a ratio r >= 0 (a number, or its text); GenerationError says what to give
  otherwise."""
  if isinstance(rule, str) and rule in MICRO_RULES:
    return rule
  try:
    r = float(rule)
  except (TypeError, ValueError):
    r = float("nan")
  if not np.isfinite(r) or r < 0 or isinstance(rule, bool):
    raise GenerationError(f"micro_rule={rule!r}: give off, auto, or a cost ratio r >= 0 (a "
                          "micro step's time / a base step's at the batch, e.g. 0.2)")
  return r


def measure(runner, slots: int, repeats: int = PROBE_REPEATS) -> np.ndarray:
  """DecodeState.micro_cost measured: r at each of micro_sizes(slots) (a later micro step of
  that many rows / one base step of `slots` rows), r1 at each (micro step 1), then m (a base
  step of `slots` rows, every other one merged, / a plain one - 1, at least 0). `runner`: a
  HAMburger in the decoding layout."""
  from hamburger_jax.decode.step_costs import step_costs  # pylint: disable=C0415
  mixed = slots > 1 and has_adapters(runner)
  base = step_costs(runner, repeats, slots, names=("base", "mixed") if mixed else ("base",))
  micro = [step_costs(runner, repeats, n, names=("micro", "first micro"))
           for n in micro_sizes(slots)]
  m = max(0.0, base["mixed"] / base["base"] - 1) if mixed else 0.0
  return micro_cost([c["micro"] / base["base"] for c in micro],
                    [c["first micro"] / base["base"] for c in micro], m)


def costs(rule: str | float, slots: int, measured=lambda: None) -> np.ndarray:
  """DecodeState.micro_cost for `rule` (parsed) at `slots` slots; "auto" calls `measured()`."""
  if rule == "auto":
    return np.asarray(measured(), np.float32)
  r = [0.0 if rule == "off" else float(rule)] * len(micro_sizes(slots))
  return micro_cost(r, r, 0.0)
