"""How a window's minutes are spent: sized from measured rates, not from a config's step count.

A window compiles its train step and times a few steps (and its boundary pass) before it
decides anything; the rest of the budget, less what the export and the evaluation keep, is
split between the boundary pass over the samples to train on and the training steps, so that
both end where the budget does. The schedule then ends at the last step (cosine to lr_final).
"""

from __future__ import annotations

import dataclasses

from hamburger_jax import roofline
from hamburger_jax.config import HamburgerConfig
from hamburger_jax.run_config import RunConfig

# Kept for the parts after training, in units of the train step's measured compile where they
# compile: the export (a graft in files of 16 MiB), a teacher-forced evaluation (a forward-only
# program, about half the step's compile), decode speed against the base (the engine's programs
# at two batch sizes: twice the step's compile on a CPU) and its runs.
EXPORT_RESERVE_S = 10.0
TF_EVAL_COMPILES = 1.0
DECODE_COMPILES = 2.0
DECODE_RUN_S = 20.0
# What --plan assumes before anything is measured: 30% MFU for the train step (a 1B HAMburger
# step reached 29.8% on an H200), the boundary pass's target rate, a compile like a 1B step's.
ASSUMED_MFU = 0.30
ASSUMED_BOUNDARY_TOKENS_PER_S = 500e3
ASSUMED_COMPILE_S = 60.0


@dataclasses.dataclass(frozen=True)
class Rates:
  """What a window measured (or assumed) before planning."""
  step_s: float  # one train step, steady state
  tokens_per_step: float  # unmerged tokens in a step's batch (the teacher's rows)
  response_per_step: float  # response tokens a step trains on
  boundary_tokens_per_s: float
  compile_s: float  # the train step's compile and first step
  measured: bool = True


@dataclasses.dataclass(frozen=True)
class Plan:
  steps: int  # training steps after the measured ones
  boundary_tokens: int  # tokens the boundary pass reads (the samples the steps train on)
  response_tokens: int  # response tokens the steps train on
  boundary_s: float
  train_s: float
  reserve_s: float
  limited_by: str  # "budget" or "data"

  def lines(self, rates: Rates, measured_steps: int = 0) -> list[str]:
    how = "measured" if rates.measured else "assumed"
    return [
        f"rates ({how}): train step {rates.step_s * 1e3:.0f} ms for "
        f"{rates.response_per_step:,.0f} response tokens ({rates.response_per_step / rates.step_s:,.0f}"
        f" tokens/s); boundaries {rates.boundary_tokens_per_s:,.0f} tokens/s",
        f"boundaries: {self.boundary_tokens:,} tokens in ~{self.boundary_s:.0f} s",
        f"training:   {measured_steps} + {self.steps} steps, {self.response_tokens:,} response "
        f"tokens in ~{self.train_s:.0f} s (limited by the {self.limited_by})",
        f"kept for export and evaluation: {self.reserve_s:.0f} s"]


def reserve_s(decode_eval: bool, compile_s: float) -> float:
  """Seconds the parts after training keep, given the train step's compile time."""
  decode = DECODE_COMPILES * compile_s + DECODE_RUN_S if decode_eval else 0.0
  return EXPORT_RESERVE_S + TF_EVAL_COMPILES * compile_s + decode


def make_plan(seconds_left: float, rates: Rates, available_tokens: int,
              reserve: float) -> Plan:
  """Steps and boundary tokens that fit `seconds_left` (after the reserve), at most what
  `available_tokens` (unmerged, of the training samples not yet used) can fill."""
  per_step = rates.step_s + rates.tokens_per_step / rates.boundary_tokens_per_s
  by_time = int(max(seconds_left - reserve, 0.0) / per_step + 1e-9)
  by_data = int(available_tokens // max(rates.tokens_per_step, 1.0))
  steps = min(by_time, by_data)
  tokens = int(steps * rates.tokens_per_step)
  return Plan(steps=steps, boundary_tokens=tokens,
              response_tokens=int(steps * rates.response_per_step),
              boundary_s=tokens / rates.boundary_tokens_per_s, train_s=steps * rates.step_s,
              reserve_s=reserve, limited_by="budget" if by_time <= by_data else "data")


def step_flops(cfg: RunConfig, hcfg: HamburgerConfig) -> float:
  """Model FLOPs of one window train step on its static batch: the graft's step
  (roofline.train_step_flops) and the teacher's forward over the unmerged rows."""
  d = cfg.data
  student = roofline.train_step_flops(hcfg, d.rows, d.entries, d.groups, cfg.train.trainable,
                                      cfg.train.ce_chunk).model
  return student + roofline.base_forward_flops(hcfg.base, d.rows, d.row_tokens)


def assumed_rates(cfg: RunConfig, hcfg: HamburgerConfig, peak_flops: float,
                  response_share: float = 0.7) -> Rates:
  """Rates for a plan made before measuring: ASSUMED_MFU of `peak_flops`, rows full, and
  `response_share` of their tokens responses (multi-turn chat)."""
  tokens = cfg.data.rows * cfg.data.row_tokens
  return Rates(step_s=step_flops(cfg, hcfg) / (ASSUMED_MFU * peak_flops),
               tokens_per_step=tokens, response_per_step=tokens * response_share,
               boundary_tokens_per_s=ASSUMED_BOUNDARY_TOKENS_PER_S,
               compile_s=ASSUMED_COMPILE_S, measured=False)
