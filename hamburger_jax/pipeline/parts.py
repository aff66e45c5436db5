"""The pipeline's parts. Each takes (plan, its minutes, the run's state) and returns its record
(status "done" or "budget", its figures, and a one-line "figure"); a failure is a RuntimeError
whose first line is the summary's, an interruption is Interrupted."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Callable

from hamburger_jax.assets import AssetError
from hamburger_jax.pipeline import budget as budget_rule
from hamburger_jax.pipeline.plan import EVAL_DIR, Plan
from hamburger_jax.pipeline.state import write_state

if TYPE_CHECKING:  # the teacher pass's module imports jax and tfds: loaded when a part runs
  from hamburger_jax.data.teacher_pass import PrepareStats


class Interrupted(Exception):
  """The run was stopped (SIGTERM, Ctrl-C); the current part is left to its own resume."""


def answers_in(path: str) -> list[int]:
  """Response tokens of each answer in the file, in file order."""
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8") as f:
    return [len(json.loads(line)["response_ids"]) for line in f if line.strip()]


def tokens_per_minute(state: dict[str, Any]) -> float | None:
  """Response tokens self-distillation generated per minute (its model load included)."""
  rec = state["parts"].get("self_distill")
  if not rec or not rec.get("new_tokens") or not rec["minutes"] > 0:
    return None
  return rec["new_tokens"] / rec["minutes"]


def last_row(run_dir: str, key: str) -> dict[str, Any] | None:
  path = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return next((r for r in reversed(rows) if key in r), None)


def run_self_distill(plan: Plan, budget: float, state: dict[str, Any]) -> dict[str, Any]:
  del state
  from hamburger_jax.data import self_distill  # pylint: disable=import-outside-toplevel
  settings = self_distill.Settings(plan.mix, plan.responses, config=plan.config,
                                   max_minutes=budget, **({} if plan.max_new_tokens is None else
                                                          {"max_new_tokens": plan.max_new_tokens}))
  print(f"self-distillation: {settings}", flush=True)
  before = sum(answers_in(plan.responses))  # an interrupted attempt's answers: not this one's
  try:
    outcome = self_distill.run(settings)
  except ValueError as e:
    raise RuntimeError(str(e)) from None
  tokens = answers_in(plan.responses)
  return {"status": "budget" if outcome.stopped else "done", "answers": len(tokens),
          "prompts": outcome.prompts, "response_tokens": sum(tokens),
          "new_tokens": sum(tokens) - before,
          "figure": f"answers {len(tokens)} of {outcome.prompts} prompts, "
                    f"{sum(tokens)} response tokens"}


def teacher_pass(plan: Plan, limit: int | None, overwrite: bool) -> PrepareStats:
  """What `python -m train.prepare_data --source jsonl:ANSWERS` does with the plan's settings,
  in this process: the first `limit` answers (None: all) segmented, with the base's teacher
  signals, into plan.data (resuming from the finished shards of an interrupted attempt). Its
  minutes are capped by `limit` (budget.teacher_limit), not by a clock: nothing here needs a
  process of its own. Bad data or settings are a RuntimeError naming them."""
  from hamburger_jax.data import prepare, source_specs  # pylint: disable=import-outside-toplevel
  from hamburger_jax.data.teacher_pass import teacher_spec  # pylint: disable=C0415
  from hamburger_jax.data.tfds_builder import check_output_dir  # pylint: disable=C0415
  from hamburger_jax.run_config import load_run_config  # pylint: disable=C0415
  source = f"jsonl:{plan.responses}"
  try:
    check_output_dir(plan.data, overwrite)
    cfg = load_run_config(plan.config, shared_only=True)
    model, tokenizer = prepare.load_base(cfg.model, plan.token_ids)
    return prepare.prepare_dataset(
        source_specs.mixed_sources([source], limit), model, tokenizer, plan.data,
        strategy=plan.strategy, max_group=cfg.graft.max_group, max_len=plan.max_len,
        overwrite=overwrite, metadata={"source": source, "config": plan.config,
                                       "base": cfg.model.base},
        teacher=teacher_spec(model, cfg.graft, plan.teacher_top_k))
  except (ValueError, FileExistsError, FileNotFoundError, AssetError) as e:
    raise RuntimeError(str(e)) from None


def run_prepare_data(plan: Plan, budget: float, state: dict[str, Any]) -> dict[str, Any]:
  answers = answers_in(plan.responses)
  if len(answers) < 2:
    raise RuntimeError(f"{len(answers)} self-distilled answers in {plan.responses}: a training "
                       "and a validation split need 2; give the pipeline more minutes")
  # An interrupted teacher pass resumes from its finished shards only when it is given the same
  # answers again: the first attempt's count is kept.
  attempt = state.setdefault("attempts", {})
  n = attempt.setdefault("prepare_data", budget_rule.teacher_limit(answers, budget,
                                                                   tokens_per_minute(state)))
  write_state(plan, state)
  print(f"teacher pass: {n} of {len(answers)} answers ({plan.responses}), strategy "
        f"{plan.strategy}, teacher top-k {plan.teacher_top_k} -> {plan.data}", flush=True)
  # A dataset written by an attempt stopped before its record is redone.
  stats = teacher_pass(plan, n if n < len(answers) else None, os.path.exists(plan.data))
  print(stats.summary(), flush=True)
  return {"status": "done" if n == len(answers) else "budget", "answers_read": n,
          "samples": stats.samples, "tokens": stats.tokens,
          "response_tokens": stats.response_tokens,
          "figure": f"answers {n} of {len(answers)}, samples {stats.samples}, tokens "
                    f"{stats.tokens} ({stats.response_tokens} response)"}


def saved_step(run_dir: str) -> int:
  from hamburger_jax.training.pick import saved_steps  # pylint: disable=C0415
  return max(saved_steps(run_dir) or {0})


def run_stage(plan: Plan, stage: str | None, budget: float, state: dict[str, Any]
              ) -> dict[str, Any]:
  del state
  from hamburger_jax import training  # pylint: disable=import-outside-toplevel
  from hamburger_jax.run_config import check_training_inputs  # pylint: disable=C0415
  cfg = plan.stage_cfgs[plan.stages.index(stage)]
  print(f"training {plan.stage_part(stage)}: python -m train.main "
        f"{' '.join(plan.stage_argv(stage))} --max-minutes {budget:.4f}", flush=True)
  check_training_inputs(cfg)
  result = training.run(cfg, max_minutes=budget, progress=False)
  if result.interrupted:
    raise Interrupted  # the trainer saved; its checkpoint is where the rerun resumes
  step = saved_step(cfg.checkpoint.dir)
  status = "done" if step >= cfg.train.steps else "budget"
  if status == "budget" and stage != plan.stages[-1]:
    # The next stage starts from this one's export: where it stood at its budget.
    training.export_step(cfg, step)
  row = last_row(cfg.checkpoint.dir, "loss") or {}
  val = last_row(cfg.checkpoint.dir, "val_loss") or {}
  figure = f"step {step}/{cfg.train.steps}"
  if "loss" in row:
    figure += f", final loss {row['loss']:.4f}"
  if "val_loss" in val:
    figure += f", val loss {val['val_loss']:.4f}"
  return {"status": status, "step": step, "loss": row.get("loss"),
          "val_loss": val.get("val_loss"), "figure": figure}


def run_pick(plan: Plan, budget: float, state: dict[str, Any]) -> dict[str, Any]:
  del budget, state
  from hamburger_jax.training import pick  # pylint: disable=import-outside-toplevel
  from hamburger_jax.training.loop import read_metrics  # pylint: disable=C0415
  run_dir = plan.stage_cfgs[-1].checkpoint.dir
  rows, saved = read_metrics(run_dir), pick.saved_steps(run_dir)
  try:
    chosen = pick.pick_step(rows, saved)
  except ValueError as e:
    raise RuntimeError(str(e)) from None
  print(pick.table(rows, chosen, saved))
  row = next(r for r in pick.checks(rows) if r["step"] == chosen.step)
  figure = (f"picked step {chosen.step}: {row['gen_tokens_per_step']:.3f} tokens/step, prefix "
            f"agreement {row['gen_prefix_agreement']:.3f} (start {chosen.start_agreement:.3f})"
            + (", fallback: no step kept the start's agreement" if chosen.fallback else ""))
  return {"status": "done", "step": chosen.step, "fallback": chosen.fallback, "figure": figure}


def run_export(plan: Plan, budget: float, state: dict[str, Any]) -> dict[str, Any]:
  del budget
  from hamburger_jax import graft_checkpoint, training  # pylint: disable=C0415
  from hamburger_jax.run_config import load_run_config  # pylint: disable=C0415
  step, stage = state["parts"]["pick"]["step"], plan.stages[-1]
  cfg = load_run_config(plan.config, [*plan.stage_sets[stage], f"checkpoint.export={plan.export}"],
                        stage=stage)
  training.export_step(cfg, step)
  meta = graft_checkpoint.read_meta(plan.export)
  return {"status": "done", "step": meta["trained_steps"], "dir": plan.export,
          "figure": f"step {meta['trained_steps']} -> {plan.export}"}


def run_eval(plan: Plan, budget: float, state: dict[str, Any]) -> dict[str, Any]:
  from hamburger_jax import pretrained  # pylint: disable=import-outside-toplevel
  from hamburger_jax.evaluation import run as evaluation  # pylint: disable=C0415
  confidence = plan.stage_cfgs[-1].train.generate_confidence  # the pick's
  limit = budget_rule.eval_limit(plan.eval_tasks.split(","), plan.eval_limit, budget,
                                 tokens_per_minute(state))
  tasks = evaluation.parse_tasks(plan.eval_tasks)
  settings = evaluation.EvalSettings(
      confidences=(confidence,), tasks=tuple(tasks), limit=limit,
      data=plan.data if "nll" in tasks else None, out=os.path.join(plan.out, EVAL_DIR),
      plots=False, command=f"python -m train.pipeline (eval of {plan.export})")
  print(f"evaluation: {settings}", flush=True)
  model, tok = pretrained.load_run(plan.config, plan.export)
  try:
    results = evaluation.evaluate(model, tok, evaluation.run_model_info(plan.config, plan.export),
                                  settings)
  except evaluation.EvalError as e:
    raise RuntimeError(str(e)) from None
  scores, said = {}, []
  for name, task in results["tasks"].items():
    # nll is teacher-forced: one result, no confidence and no compression
    ham = task["hamburger"] if name == "nll" else next(iter(task["hamburger"].values()))
    scores[name] = ham["score"]
    kv = "" if name == "nll" else f", {ham['kv_compression']:.2f}x KV"
    said.append(f"{name} {ham['score']:.3f} (base {task['base']['score']:.3f}{kv})")
  return {"status": "done", "limit": limit, "confidence": confidence, "scores": scores,
          "figure": f"c={confidence}, {limit}/task: " + "; ".join(said)}


def runner(plan: Plan, part: str) -> Callable[[Plan, float, dict[str, Any]], dict[str, Any]]:
  if part.startswith("train"):
    stage = plan.stages[[plan.stage_part(s) for s in plan.stages].index(part)]
    return lambda p, b, s: run_stage(p, stage, b, s)
  return {"self_distill": run_self_distill, "prepare_data": run_prepare_data, "pick": run_pick,
          "export": run_export, "eval": run_eval}[part]
