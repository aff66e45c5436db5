"""How a window's minutes are spent: sized from measured rates, not from a config's step count.

A window compiles its train step and times a few steps (and its boundary pass) before it
decides anything; the rest of the budget, less what the judge, the export and the evaluation
keep (and, with arms, what starting each arm takes), is split between the base's own answers to
corpus prompts (a share of the response tokens trained on; hamburger_jax.data.tokens.answers),
the boundary pass over the corpus samples to train on and the training steps, so that all end
where the budget does. The schedule then ends at the last step (cosine to lr_final).

The judge is most of a short window on a suite of the default size: on an H200 it took 282 s of
a 7-minute window to judge the init, before anything trained. A window judges its init before it
measures, so its plan keeps only the trained grafts' judges (measured on the init's); `--plan`
counts the whole judge, from an earlier window's timings or from the assumed ones below.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from hamburger_jax.costs import analytic
from hamburger_jax.config import HamburgerConfig
from hamburger_jax.evaluation.suite_judge import CONFIDENCES
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
# The judge before a window has timed it: on an H200 (2026-11-28, the 928-item suite, 64 slots)
# the init's judge took 282 s: 185 s of compiles, then four passes over the suite (the base's and
# the init's at each of the three confidences), ~24 s each with their scoring and the base's
# forward over the micro tokens (the decode alone 12-13 s).
ASSUMED_JUDGE_COMPILE_S = 185.0
ASSUMED_JUDGE_ITEM_S = (282.0 - 185.0) / 4 / 928  # an item's share of one pass
JUDGE_PASSES = len(CONFIDENCES)  # a graft's passes over the suite; the base's is one more
DEFAULT_SUITE_ITEMS = 928  # infer.eval --write-suite's: 4 tasks of 200 items, 128 chat prompts


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
  judge_compile_s: float = ASSUMED_JUDGE_COMPILE_S  # the judge's programs
  judge_item_s: float = ASSUMED_JUDGE_ITEM_S  # an item's share of one pass over a suite
  judge_measured: bool = False  # by an earlier window


@dataclasses.dataclass(frozen=True)
class Plan:
  steps: int  # training steps after the measured ones
  boundary_tokens: int  # tokens the boundary pass reads (the corpus samples the steps train on)
  response_tokens: int  # response tokens the steps train on
  boundary_s: float
  train_s: float
  reserve_s: float  # kept for the export and the evaluation
  limited_by: str  # "budget" or "data"
  answer_tokens: int = 0  # the base's own answers to make (a share of response_tokens)
  answer_s: float = 0.0  # for them, their program's compile included
  judge_s: float = 0.0  # kept for the judge
  start_s: float = 0.0  # the arms' first steps (their compiles), outside their shares

  def lines(self, rates: Rates, measured_steps: int = 0) -> list[str]:
    how = "measured" if rates.measured else "assumed"
    answers = []
    if self.answer_tokens:
      answers = [f"answers:    {self.answer_tokens:,} tokens of the base's own answers in "
                 f"~{self.answer_s:.0f} s ({'measured' if rates.answers_measured else 'assumed'} "
                 f"{rates.answer_tokens_per_s:,.0f} tokens/s)"]
    arms = [f"arms:       each from the init, its first step (and compile) in ~{self.start_s:.0f} "
            "s in all, before the shares"] if self.start_s else []
    judge = (f"the judge ~{self.judge_s:.0f} s ("
             f"{'measured' if rates.judge_measured else 'assumed'} {rates.judge_item_s * 1e3:.0f}"
             " ms an item a pass), " if self.judge_s else "")
    return [
        f"rates ({how}): train step {rates.step_s * 1e3:.0f} ms for "
        f"{rates.response_per_step:,.0f} response tokens ({rates.response_per_step / rates.step_s:,.0f}"
        f" tokens/s); boundaries {rates.boundary_tokens_per_s:,.0f} tokens/s",
        *answers,
        f"boundaries: {self.boundary_tokens:,} tokens in ~{self.boundary_s:.0f} s",
        *arms,
        f"training:   {measured_steps} + {self.steps} steps, {self.response_tokens:,} response "
        f"tokens in ~{self.train_s:.0f} s (limited by the {self.limited_by})",
        f"kept for {judge}export and evaluation: {self.reserve_s:.0f} s"]


def reserve_s(decode_eval: bool, compile_s: float) -> float:
  """Seconds the export and the diagnostics after training keep, given the train step's compile
  time (the judge's are judge_s's)."""
  decode = DECODE_COMPILES * compile_s + DECODE_RUN_S if decode_eval else 0.0
  return EXPORT_RESERVE_S + TF_EVAL_COMPILES * compile_s + decode


def judge_s(rates: Rates, items: int, grafts: int, init: bool = True) -> float:
  """Seconds the judge takes on a suite of `items`: with `init` (not judged yet), its programs'
  compile, the base's pass and the init graft's passes; then the passes of `grafts` trained
  grafts, which reuse the programs."""
  passes = JUDGE_PASSES * grafts + ((1 + JUDGE_PASSES) if init else 0)
  return (rates.judge_compile_s if init else 0.0) + passes * items * rates.judge_item_s


def arms_start_s(arms: Sequence, rates: Rates) -> float:
  """Seconds arms (window.state.Arm) take to start, outside their shares of the training
  minutes: each arm's first step, which compiles its train step, except for the first arm
  without overrides (it takes the measured trainer's programs, back at the init). Without arms
  training goes on from the measured steps: nothing."""
  if not arms:
    return 0.0
  compiles = len(arms) - any(not a.overrides for a in arms)
  return compiles * rates.compile_s + (len(arms) - compiles) * rates.step_s


def make_plan(seconds_left: float, rates: Rates, available_tokens: int, reserve: float,
              answers_share: float = 0.0, to_answer: bool = True, judge: float = 0.0,
              start: float = 0.0) -> Plan:
  """Steps and boundary tokens that fit `seconds_left` (after the reserve, the `judge`'s seconds
  and the arms' `start`), at most what `available_tokens` (unmerged, of the training samples not
  yet used) can fill.

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
  by_time = int(max(seconds_left - reserve - judge - start - compile_s, 0.0) / per_step + 1e-9)
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
              if answer_tokens else 0.0, judge_s=judge, start_s=start)


def step_flops(cfg: RunConfig, hcfg: HamburgerConfig) -> float:
  """Model FLOPs of one window train step on its static batch: the graft's step
  (analytic.train_step_flops) and the teacher's forward over the unmerged rows."""
  d = cfg.data
  student = analytic.train_step_flops(hcfg, d.rows, d.entries, d.groups, cfg.train.trainable,
                                      cfg.train.ce_chunk).model
  return student + analytic.base_forward_flops(hcfg.base, d.rows, d.row_tokens)


def with_judge(rates: Rates, summary: dict) -> Rates:
  """`rates` with the judge's timings of a window's summary (window/judging.judge_init's) where
  it judged, else as they are."""
  items = int(summary.get("judge", {}).get("suite", {}).get("items", 0))
  if not (items and "judge_init_decode_s" in summary and "judge_compile_s" in summary):
    return rates
  return dataclasses.replace(
      rates, judge_compile_s=float(summary["judge_compile_s"]),
      judge_item_s=float(summary["judge_init_decode_s"]) / JUDGE_PASSES / items,
      judge_measured=True)


def measured_rates(summary: dict) -> Rates:
  """The rates an earlier window measured, from its summary.json (the answers' rate where it made
  answers, the judge's where it judged, else the assumed ones)."""
  try:
    plan = summary["plan"]
    steps = max(int(plan["steps"]), 1)
    corpus = 1.0 - float(plan.get("answer_tokens", 0)) / max(float(plan["response_tokens"]), 1.0)
    answers = summary.get("answer_tokens_per_s")
    return with_judge(Rates(step_s=float(summary["step_s"]),
                 tokens_per_step=float(plan["boundary_tokens"]) / steps / max(corpus, 1e-9),
                 response_per_step=float(plan["response_tokens"]) / steps,
                 boundary_tokens_per_s=float(summary["boundaries_tokens_per_s"]),
                 compile_s=float(summary["compile_s"]),
                 answer_tokens_per_s=float(answers) if answers and answers == answers
                 else ASSUMED_ANSWER_TOKENS_PER_S,
                 answers_measured=bool(answers and answers == answers)), summary)
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
