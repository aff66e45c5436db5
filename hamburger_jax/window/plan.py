"""How a window's minutes are spent: sized from measured rates, not from a config's step count.

A window compiles its train step and times a few steps (and its boundary pass) before it
decides anything; the rest of the budget, less what the export and the evaluation keep, is
split between the base's own answers to corpus prompts (a share of the response tokens trained
on; hamburger_jax.data.tokens.answers), the boundary pass over the corpus samples to train on
and the training steps, so that all end where the budget does. The schedule then ends at the
last step (cosine to lr_final).
"""

from __future__ import annotations

import dataclasses

from hamburger_jax.costs import analytic
from hamburger_jax.config import HamburgerConfig
from hamburger_jax.run_config import RunConfig

# Kept for the parts after training, in units of the train step's measured compile where they
# compile: the export (a graft in files of 16 MiB), a teacher-forced evaluation (a forward-only
# program, about half the step's compile), decode speed against the base (the engine's programs
# for two modes at two batch sizes, 12 with prompts of one prefill plan; with prompts of every
# length and prefix caching, ~50 took 2.06 times the step's compile on an H200) and its runs.
EXPORT_RESERVE_S = 10.0
TF_EVAL_COMPILES = 1.0
DECODE_COMPILES = 1.0
DECODE_RUN_S = 20.0
# The answers' program (a base forward and a decode loop) compiles in about this share of the
# train step's compile (the step also holds the graft, its backward pass and the teacher).
ANSWER_COMPILES = 0.3
# What --plan assumes before anything is measured: 30% MFU for the train step (a 1B HAMburger
# step reached 29.8% on an H200), the boundary pass's target rate, a compile like a 1B step's.
ASSUMED_MFU = 0.30
ASSUMED_BOUNDARY_TOKENS_PER_S = 500e3
ASSUMED_COMPILE_S = 60.0
ASSUMED_ANSWER_TOKENS_PER_S = 50e3  # the answers' target rate at 135M


@dataclasses.dataclass(frozen=True)
class Rates:
  """What a window measured (or assumed) before planning."""
  step_s: float  # one train step, steady state
  tokens_per_step: float  # unmerged tokens in a step's batch (the teacher's rows)
  response_per_step: float  # response tokens a step trains on
  boundary_tokens_per_s: float
  compile_s: float  # the train step's compile and first step
  measured: bool = True
  answer_tokens_per_s: float = ASSUMED_ANSWER_TOKENS_PER_S
  answers_measured: bool = False  # by an earlier window (a window plans before it answers)


@dataclasses.dataclass(frozen=True)
class Plan:
  steps: int  # training steps after the measured ones
  boundary_tokens: int  # tokens the boundary pass reads (the corpus samples the steps train on)
  response_tokens: int  # response tokens the steps train on
  boundary_s: float
  train_s: float
  reserve_s: float
  limited_by: str  # "budget" or "data"
  answer_tokens: int = 0  # the base's own answers to make (a share of response_tokens)
  answer_s: float = 0.0  # for them, their program's compile included

  def lines(self, rates: Rates, measured_steps: int = 0) -> list[str]:
    how = "measured" if rates.measured else "assumed"
    answers = []
    if self.answer_tokens:
      answers = [f"answers:    {self.answer_tokens:,} tokens of the base's own answers in "
                 f"~{self.answer_s:.0f} s ({'measured' if rates.answers_measured else 'assumed'} "
                 f"{rates.answer_tokens_per_s:,.0f} tokens/s)"]
    return [
        f"rates ({how}): train step {rates.step_s * 1e3:.0f} ms for "
        f"{rates.response_per_step:,.0f} response tokens ({rates.response_per_step / rates.step_s:,.0f}"
        f" tokens/s); boundaries {rates.boundary_tokens_per_s:,.0f} tokens/s",
        *answers,
        f"boundaries: {self.boundary_tokens:,} tokens in ~{self.boundary_s:.0f} s",
        f"training:   {measured_steps} + {self.steps} steps, {self.response_tokens:,} response "
        f"tokens in ~{self.train_s:.0f} s (limited by the {self.limited_by})",
        f"kept for export and evaluation: {self.reserve_s:.0f} s"]


def reserve_s(decode_eval: bool, compile_s: float, judge_s: float = 0.0) -> float:
  """Seconds the parts after training keep, given the train step's compile time and what the
  judge of the init graft took (the trained graft's judge reuses its programs: it takes less)."""
  decode = DECODE_COMPILES * compile_s + DECODE_RUN_S if decode_eval else 0.0
  return EXPORT_RESERVE_S + TF_EVAL_COMPILES * compile_s + decode + judge_s


def make_plan(seconds_left: float, rates: Rates, available_tokens: int, reserve: float,
              answers_share: float = 0.0, to_answer: bool = True) -> Plan:
  """Steps and boundary tokens that fit `seconds_left` (after the reserve), at most what
  `available_tokens` (unmerged, of the training samples not yet used) can fill.

  `answers_share`: the share of the trained response tokens that are the base's own answers,
  which need no boundary pass; `to_answer`: they are still to be made (their program's compile
  and their tokens at rates.answer_tokens_per_s come out of the same seconds)."""
  if not 0.0 <= answers_share <= 1.0:
    raise ValueError(f"answers_share={answers_share} must be in [0, 1]")
  corpus = 1.0 - answers_share
  per_step = rates.step_s + corpus * rates.tokens_per_step / rates.boundary_tokens_per_s
  compile_s = 0.0
  if answers_share and to_answer:
    per_step += answers_share * rates.response_per_step / rates.answer_tokens_per_s
    compile_s = ANSWER_COMPILES * rates.compile_s
  by_time = int(max(seconds_left - reserve - compile_s, 0.0) / per_step + 1e-9)
  by_data = int(available_tokens // max(corpus * rates.tokens_per_step, 1.0))
  steps = min(by_time, by_data)
  tokens = int(steps * corpus * rates.tokens_per_step)
  answer_tokens = int(steps * answers_share * rates.response_per_step) if to_answer else 0
  return Plan(steps=steps, boundary_tokens=tokens,
              response_tokens=int(steps * rates.response_per_step),
              boundary_s=tokens / rates.boundary_tokens_per_s, train_s=steps * rates.step_s,
              reserve_s=reserve, limited_by="budget" if by_time <= by_data else "data",
              answer_tokens=answer_tokens,
              answer_s=(compile_s + answer_tokens / rates.answer_tokens_per_s)
              if answer_tokens else 0.0)


def step_flops(cfg: RunConfig, hcfg: HamburgerConfig) -> float:
  """Model FLOPs of one window train step on its static batch: the graft's step
  (analytic.train_step_flops) and the teacher's forward over the unmerged rows."""
  d = cfg.data
  student = analytic.train_step_flops(hcfg, d.rows, d.entries, d.groups, cfg.train.trainable,
                                      cfg.train.ce_chunk).model
  return student + analytic.base_forward_flops(hcfg.base, d.rows, d.row_tokens)


def measured_rates(summary: dict) -> Rates:
  """The rates an earlier window measured, from its summary.json (the answers' rate where it made
  answers, else the assumed one)."""
  try:
    plan = summary["plan"]
    steps = max(int(plan["steps"]), 1)
    corpus = 1.0 - float(plan.get("answer_tokens", 0)) / max(float(plan["response_tokens"]), 1.0)
    answers = summary.get("answer_tokens_per_s")
    return Rates(step_s=float(summary["step_s"]),
                 tokens_per_step=float(plan["boundary_tokens"]) / steps / max(corpus, 1e-9),
                 response_per_step=float(plan["response_tokens"]) / steps,
                 boundary_tokens_per_s=float(summary["boundaries_tokens_per_s"]),
                 compile_s=float(summary["compile_s"]),
                 answer_tokens_per_s=float(answers) if answers and answers == answers
                 else ASSUMED_ANSWER_TOKENS_PER_S,
                 answers_measured=bool(answers and answers == answers))
  except (KeyError, TypeError, ValueError) as e:
    raise ValueError(f"not a window's summary.json (it lacks {e}): give the summary.json of a "
                     "window that trained") from None


def assumed_rates(cfg: RunConfig, hcfg: HamburgerConfig, peak_flops: float,
                  response_share: float = 0.7) -> Rates:
  """Rates for a plan made before measuring: ASSUMED_MFU of `peak_flops`, rows full, and
  `response_share` of their tokens responses (multi-turn chat)."""
  tokens = cfg.data.rows * cfg.data.row_tokens
  return Rates(step_s=step_flops(cfg, hcfg) / (ASSUMED_MFU * peak_flops),
               tokens_per_step=tokens, response_per_step=tokens * response_share,
               boundary_tokens_per_s=ASSUMED_BOUNDARY_TOKENS_PER_S,
               compile_s=ASSUMED_COMPILE_S, measured=False)
