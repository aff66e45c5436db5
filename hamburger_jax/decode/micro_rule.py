"""The batch-aware micro loop: when a batch's next micro step runs (`pays`), and the one owner of
the cost vector it decides by (DecodeState.micro_cost: its layout, its parts' names, how a
setting builds it and how "auto" measures it).

A macro step of many rows runs micro step i + 1 while enough rows go on to pay for it, judged
by r = micro step / base step at that batch: its cost ratio at each micro batch size a macro
step may run its micro steps at (`micro_sizes`), r1 the same of micro step 1 (which reads the
F features and e(t0)), and m, what a base step whose rows' entries are merged and unmerged
costs over a plain one (micro step 1 makes it). The vector holds them as `CostParts` in that
order: later [S], first [S], merge (S = len(micro_sizes(slots)); `cost_vector`, `cost_parts`).

Settings (`parse`, `rule_costs`):
  "off"   r = r1 = m = 0: every micro step a row goes on for runs (the rule of docs/method.md
          section 3 alone; tokens do not depend on the batch mates);
  "auto"  measured (`measure`): each micro batch's micro steps (1, and a later one) and the
          batch's base steps (plain, and half of its rows merged) timed once, in jitted loops
          of the decoding layout (decode/step_costs.py: Probe), per engine and slot count;
          m = 0 without merged-entry adapters, which make a mixed step cost more;
  a number r >= 0: r = r1 = r at every micro batch, m = 0 (a lone row is never cut: `pays`
          takes r at most 1).

The ratios are a runtime operand of the decode program, so every setting runs the same compiled
program. This module sits below decode/step.py, which reads the vector: the timing it measures
with comes in as a Probe, not an import.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hamburger_jax.decode.requests import GenerationError

MICRO_RULES = ("off", "auto")
DEFAULT_MICRO_RULE = "off"
# A macro step whose continuing rows fit in slots / MICRO_BATCH_DIVISOR runs its micro steps on
# those rows only (micro_batch_sizes).
MICRO_BATCH_DIVISOR = 4


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


# ----------------------------------------------------------------------------- the micro batches


def micro_batch_sizes(slots: int) -> tuple[int, ...]:
  """The micro batches (below `slots`) a macro step may gather its continuing rows into: one
  row, and a quarter of the slots. Each is one more traced copy of the micro steps; the LM head
  they run costs less for fewer rows (SmolLM2 on 2 CPU cores: 1 row ~3 ms, 4 rows ~8 ms, 16 rows
  ~17 ms), which is what a macro step pays when only a few rows continue."""
  return tuple(sorted({n for n in (1, slots // MICRO_BATCH_DIVISOR) if 1 <= n < slots}))


def micro_sizes(slots: int) -> tuple[int, ...]:
  """The row counts a macro step's micro steps may run at: the micro batches and every slot
  (the cost vector holds one ratio of each kind for each)."""
  return (*micro_batch_sizes(slots), slots)


# ----------------------------------------------------------------------------- the cost vector


class CostParts(NamedTuple):
  """The cost vector's parts, numpy or traced: ratios to a base step of the batch."""
  later: Any  # [S] micro steps 2 and later at each of micro_sizes
  first: Any  # [S] micro step 1 at each
  merge: Any  # [] m: a base step of merged and unmerged entries over a plain one, less 1


def cost_size(slots: int) -> int:
  """The cost vector's length at `slots` slots: two ratios at each micro size, and m."""
  return 2 * len(micro_sizes(slots)) + 1


def cost_vector(later: Sequence[float], first: Sequence[float], merge: float) -> np.ndarray:
  """The cost vector (host side) from its parts (CostParts)."""
  return np.asarray([*later, *first, merge], np.float32)


def cost_parts(costs, slots: int) -> CostParts:
  """The parts of a cost vector at `slots` slots, numpy or traced as given."""
  n = len(micro_sizes(slots))
  return CostParts(costs[:n], costs[n:2 * n], costs[2 * n])


def pays(n_go: jax.Array, n_live: jax.Array, r: jax.Array) -> jax.Array:
  """Whether the next micro step pays for itself: `n_go` rows would emit a token in it, out of
  `n_live` rows still decoding, at a cost of r base steps (r = micro step / base step at the
  batch, timed in the same loops).

  The next micro step costs r T (T: one base step of the batch) and yields n_go tokens: r T /
  n_go a token. Not running it, each of those rows ends its group there and emits that token
  in a later macro step, whose base step yields one token for each live row: T / n_live a
  token. So it runs while n_go >= r n_live. (A macro step yields k >= 1 tokens a row, so T /
  n_live overstates what a token costs there: the rule errs toward running micro steps.)
  Micro step 1 costs more than a later one (its ratio r1: it reads F + 1 inputs a row) and
  decides the next base step's form: its rows' entries merge, the others' do not, and a base
  step of both adds the adapters' change on the merged rows (step.advance), m T more than a
  plain one; so micro step 1 runs while n_go >= (r1 + m) n_live when some live rows stop at
  token 0 (step.propose passes r1 + m as `r`). r is taken at most 1, so that one row going on,
  alone in the batch, always goes on: batch 1 is the paper's rule unchanged. r = 0 (off): every
  micro step a row goes on for runs, as without the rule."""
  return n_go.astype(jnp.float32) >= jnp.minimum(r, 1.0) * n_live.astype(jnp.float32)


# ----------------------------------------------------------------------------- building it


class Probe(Protocol):
  """What `measure` times with (decode/step_costs.py: Probe, on a HAMburger in the decoding
  layout): seconds of one unit step of decode/launches.py by name at `batch` rows, and whether
  the model has merged-entry adapters (without them a mixed base step is a plain one)."""
  adapters: bool

  def __call__(self, batch: int, names: Sequence[str]) -> Mapping[str, float]: ...


def measure(probe: Probe, slots: int) -> np.ndarray:
  """The cost vector measured: r at each of micro_sizes(slots) (a later micro step of that many
  rows / one base step of `slots` rows), r1 at each (micro step 1), then m (a base step of
  `slots` rows, every other one merged, / a plain one - 1, at least 0)."""
  mixed = slots > 1 and probe.adapters
  base = probe(slots, ("base", "mixed") if mixed else ("base",))
  micro = [probe(n, ("micro", "first micro")) for n in micro_sizes(slots)]
  m = max(0.0, base["mixed"] / base["base"] - 1) if mixed else 0.0
  return cost_vector([c["micro"] / base["base"] for c in micro],
                     [c["first micro"] / base["base"] for c in micro], m)


def rule_costs(rule: str | float, slots: int,
               measured: Callable[[], np.ndarray] = lambda: None) -> np.ndarray:
  """The cost vector of `rule` (parsed) at `slots` slots; "auto" calls `measured()`."""
  if rule == "auto":
    return np.asarray(measured(), np.float32)
  r = [0.0 if rule == "off" else float(rule)] * len(micro_sizes(slots))
  return cost_vector(r, r, 0.0)
