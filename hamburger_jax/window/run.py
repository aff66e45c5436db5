"""One accelerator window turned into a graft (`python -m train.window`).

Within a budget of minutes, in order, each part printing one line as it ends:
  load        the run's model (base + a fresh graft, or --init-from an earlier window's export)
  corpus      a token-id corpus (hamburger_jax.data.tokens), and earlier windows' answers
  judge init  the init graft's free generation on the suite (window/judging.py), the base's too
  warm-up     group boundaries of a first slice of the training samples and of the validation ones
  measure     the train step compiled and timed on that slice (tokens/s, MFU)
  profile     two more steps under the profiler: the device's time by operation
  plan        the answers, steps and boundary tokens the rest of the budget holds (window/plan.py)
  answers     the base's own greedy answers to training prompts, hundreds of rows at once, their
              groups from the probabilities it chose them with: most of the tokens trained on,
              kept in OUT/answers/ for the next window
  boundaries  the pass over the corpus samples the steps will train on
  train       the steps, the teacher in each, the learning rate fed by the host so the cosine ends
              at the last step; with arms, one part per arm, each from the init with its
              compile before its equal share of the minutes
  judge       each trained graft's free generation on the suite against the init's: the verdict
  export      the best trained graft in files of at most 16 MiB, with its verdict
  evaluate    teacher-forced on held-out samples (diagnostics)
  decode      tok/s of the base and HAMburger (c = 0.5, 0.8) at batch 1 and 32, when asked
report.md is rewritten after every part, so a window stopped from outside keeps what it did.
Each part is a function of the records it needs (window/state.py), returning what it made.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable

import numpy as np

from hamburger_jax.files import write_json_atomic
from hamburger_jax.run_config import RunConfig
from hamburger_jax.training.trainer import Trainer
from hamburger_jax.window import diagnostics, judging, setup, training
from hamburger_jax.window import plan as plan_lib
from hamburger_jax.window.state import Data, Progress, Run, Settings

WindowSettings = Settings  # the name train.window and the tests know


def _plan_part(run: Run, data: Data, progress: Progress) -> plan_lib.Plan:
  p = setup.plan(run, data, progress.rates, to_answer=True)
  run.summary["plan"] = dataclasses.asdict(p)
  run.report.part("plan", p.lines(plan_lib.with_judge(progress.rates, run.summary),
                                  progress.steps))
  return p


def _train_arms(run: Run, data: Data, epoch_ids: np.ndarray, progress: Progress,
                p: plan_lib.Plan, lr: setup.HostLr,
                config_for: Callable[[tuple[str, ...]], RunConfig],
                init: dict | None) -> dict[str, tuple]:
  """Each arm's trained (model, progress, trainer). Without arms, the measured trainer goes on.
  Arms start alike, so that their merits compare: each from the init at step 0 (`init`: the
  measured trainer's params before it stepped), its first step (its compile) before its share of
  the minutes, the shares equal. The first arm without overrides takes the measured trainer, its
  programs compiled, back at the init; the others build their own trainer."""
  stop_all = run.s.deadline - p.reserve_s - p.judge_s  # when the trained grafts' judge starts
  if not run.s.arms:
    done = training.train(run, run.trainer, data, epoch_ids, progress, p.steps, stop_all, lr)
    return {"train": (run.trainer.current_model(), done, run.trainer)}
  arms = run.s.arms
  share = max(stop_all - time.monotonic() - p.start_s, 0.0) / len(arms)
  reuse = next((a for a in arms if not a.overrides), None)
  out = {}
  for arm in arms:
    if arm is reuse:
      trainer = run.trainer
      training.reset(trainer, init)
    else:
      trainer = Trainer(config_for(arm.overrides), host_lr=True)
    done = training.train(run, trainer, data, epoch_ids, Progress(rates=progress.rates),
                          p.steps // len(arms), stop_all, setup.HostLr(trainer.cfg), arm.name,
                          share=share)
    out[arm.name] = (trainer.current_model(), done, trainer)
  return out


def run_window(cfg: RunConfig, corpus_dir: str, out_dir: str, work_dir: str, settings: Settings,
               log: Callable[[str], None] = print,
               config_for: Callable[[tuple[str, ...]], RunConfig] | None = None
               ) -> dict[str, Any]:
  """Runs every part of a window (module docstring); returns its summary (summary.json).
  `config_for(overrides)`: the run config with an arm's overrides (needed with arms)."""
  if settings.arms and config_for is None:
    raise ValueError("arms need config_for: the run config with an arm's overrides")
  run = setup.load(cfg, settings, out_dir, work_dir, log)
  data = setup.read_corpus(run, corpus_dir)
  judge = judging.judge_init(run, run.trainer.current_model())
  lr = setup.HostLr(cfg)
  data, warm, boundary_rate = setup.warm_up(run, data)
  init = training.snapshot(run.trainer) if settings.arms else None  # before any step
  progress, left = setup.measure(run, data, warm, boundary_rate, lr)
  progress = setup.profile(run, progress, left, lr)
  p = _plan_part(run, data, progress)
  data, p = training.answers(run, data, p, progress.rates)
  epoch_ids = training.boundaries(run, data, p, progress.rates)
  trained = _train_arms(run, data, epoch_ids, progress, p, lr, config_for, init)
  for name, (model, _, _) in trained.items():
    if judge is not None:
      judging.judge_graft(run, judge, model, name)
  best, ship = judging.verdict(run, judge, list(trained))
  model, done, trainer = trained[best]
  run.summary.update(steps=done.steps, response_tokens=done.tokens, arm=best)
  judging.export(run, model, done, best, ship, include_base=trainer.trains_base)
  # Diagnostics only: a window that its judge has already taken past its budget skips them.
  if time.monotonic() + plan_lib.TF_EVAL_COMPILES * progress.rates.compile_s < settings.deadline:
    diagnostics.evaluate(run, trainer, data)
  else:
    run.report.part("evaluate", ["skipped: too little of the budget left"])
  if settings.decode_eval:
    if time.monotonic() + plan_lib.DECODE_COMPILES * progress.rates.compile_s < \
        settings.deadline + 30:
      diagnostics.decode(run, model, data)
    else:
      run.report.part("decode", ["skipped: too little of the budget left"])
  _finish(run)
  return run.summary


def _finish(run: Run) -> None:
  spent = run.elapsed()
  arms = run.summary.get("arms", {})
  train_s = sum(a.get("train_s", 0.0) for a in arms.values())
  run.summary.update(seconds=spent, train_share=train_s / spent if spent else 0.0)
  if run.summary.get("arm") in arms:
    run.summary.update({k: v for k, v in arms[run.summary["arm"]].items()
                        if k in ("train_tokens_per_s", "train_mfu")})
  write_json_atomic(os.path.join(run.out, "summary.json"), run.summary, indent=1, sort_keys=True)
  run.report.part("done", [f"{spent:.0f} s of {60 * run.s.budget_minutes:.0f}; training "
                           f"{train_s:.0f} s ({train_s / max(spent, 1e-9):.0%})"])
