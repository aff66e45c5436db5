"""The whole training recipe in one command, in a time budget, resumable.

  python -m train.pipeline --config configs/smollm2_135m.yaml --budget-minutes 480
  python -m train.pipeline --config configs/tiny.yaml --budget-minutes 3 --out runs/tiny-pipeline

Runs the parts that README "Train" runs by hand, with the library code behind their entry
points (the teacher pass as its own process, `python -m train.prepare_data`), under --out
(default: the config's checkpoint.dir + "-pipeline"):

  self_distill   train.self_distill: the base's own greedy answers        -> responses.jsonl
                 (a model without tokenizer answers token-id prompts, --mix synthetic:N)
  prepare_data   train.prepare_data: segmentation + teacher signals        -> data/
  train:STAGE    train.main --stage STAGE, each stage of the config in order (one part
                 "train" for a config without stages)                      -> train/STAGE/
  pick           train.pick's rule on the last stage's generation checks
  export         train.main --export-step PICKED                           -> export/
  eval           infer.eval's tasks at the pick's confidence               -> eval/

Budget: the parts have fixed shares of --budget-minutes (SHARES; the stages split theirs by
their train.steps). A part gets its share of the minutes still left, among the parts still to
run: what a finished part did not use is handed on to the later ones (and an overrun taken from
them). Each part gets its minutes: train.main and train.self_distill --max-minutes (they stop
cleanly and save); the teacher pass reads as many answers as fit its minutes at TEACHER_SPEEDUP
x the rate self-distillation generated them; the evaluation takes as many examples per task
(at most --eval-limit) as fit at that rate. A stage stopped by its minutes is exported where it
stood, so that the next stage starts from it. What a part costs whatever its size (a model load,
compilation, a stage's closing validation and generation check) counts in its minutes but does
not shrink with them: a small budget runs over (SmolLM2-135M on 2 busy cores: 15 minutes ran
21, most of it such costs); the summary shows by how much.

Resume: <out>/pipeline.json records each finished part (status, minutes, figures), written
atomically after the part; rerunning the same command skips those. A part that was interrupted
(Ctrl-C, SIGTERM, a killed process) is not recorded and reruns through its own resume: the
answers file goes on where it stopped, the teacher pass from its finished shards (given the
same answers: the first attempt's count is kept in the state), a stage from its latest
checkpoint; the pick, the export and the evaluation start over. Minutes of an interrupted
attempt are not counted. The output ends with one summary line per part: part, status (done;
budget: stopped by its minutes; skipped: finished by an earlier run; failed; interrupted; not
run), minutes used / budget, and its figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

from hamburger_jax import files

STATE_FILE = "pipeline.json"
DATA_DIR, TRAIN_DIR, EVAL_DIR = "data", "train", "eval"  # under --out
# Shares of the budget (sum 1). Self-distillation generates every token the stages train on,
# the teacher pass reads them ~3x faster; training takes half; export and evaluation load a
# model and compile; the pick reads a log.
SHARES = {"self_distill": 0.25, "prepare_data": 0.12, "train": 0.50, "pick": 0.01,
          "export": 0.04, "eval": 0.08}
# How much faster the teacher pass reads a response token than self-distillation generates
# one, on 2 CPU cores: 2.7-2.8x (docs/results/data.md: 143k tokens in 29 min, then 617 s;
# 314k in 35 min, then 779 s); rounded down, so that the answers fit the teacher pass's share.
TEACHER_SPEEDUP = 2.5
# The recipe's data steps: the mix of configs/smollm2_135m.yaml's recipe (the shipped graft's
# data, docs/results/data.md), its segmentation and teacher signals.
TEXT_MIX = ("sharegpt:2400,gsm_symbolic:500,basic_arithmetic:300,chain_sum:300,"
            "letter_counting:400,gcd:400,lcm:400")
IDS_MIX = "synthetic:4096"  # a cap: as many as the minutes allow, up to this many
STRATEGY = "confident:0.6"
TEACHER_TOP_K = 16
TEXT_EVAL_TASKS = "basic_arithmetic,chain_sum,sharegpt_heldout,nll"
IDS_EVAL_TASKS = "synthetic,nll"
# Below this many minutes of training per stage a staged config trains its last stage alone,
# from a fresh graft: each stage compiles its own train and evaluation steps (on a GPU, half a
# minute to a minute and a half each), which a few minutes cannot pay for three times.
MIN_STAGE_MINUTES = 4.0


class PipelineError(Exception):
  """Bad input, found before anything is written; the message says what to change."""


class Interrupted(Exception):
  """The run was stopped (SIGTERM, Ctrl-C); the current part is left to its own resume."""


# ----------------------------------------------------------------------------- the budget


def part_budget(shares: dict[str, float], used: dict[str, float], total: float,
                part: str) -> float:
  """Minutes for `part`: its share of the minutes left, among the parts not finished yet.

  `shares` maps every part (in order) to its share, `used` each finished part to the minutes
  it took. Unused minutes of a finished part go to the later parts in proportion to their
  shares; an overrun comes out of theirs; nothing left gives 0 (the part's least work: one
  training step, one answer)."""
  left = total - sum(used.values())
  pending = sum(s for p, s in shares.items() if p not in used)
  return max(left, 0.0) * shares[part] / pending if pending > 0 else 0.0


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


# ----------------------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class Plan:
  """What the parts run, derived from the config and the command line before anything runs."""
  config: str
  out: str
  budget: float
  stages: list[str | None]  # None: a config without stages
  stage_cfgs: list[Any]  # RunConfig of each stage as the pipeline trains it
  stage_sets: dict[str | None, list[str]]  # train.main's --set overrides of each stage
  token_ids: bool  # the base has no tokenizer: token-id prompts and tasks
  mix: str
  max_len: int  # longest sample the teacher pass keeps: one that every stage's rows hold
  max_new_tokens: int | None  # for token-id prompts (a text model's answers: self_distill's)
  strategy: str
  teacher_top_k: int
  eval_tasks: str
  eval_limit: int
  one_stage: bool = False  # the budget is too small for every stage: the last one alone

  def programs(self) -> list[tuple[str, str]]:
    """(part, what it compiles) in order: the programs the run will compile, before it starts
    (the engine's: one prefill per prompt chunk size used, one decode loop per view)."""
    engine = "the engine's prefill (per chunk size) and decode loop (per view)"
    out = [("self_distill", f"{engine}, base mode"),
           ("prepare_data", "the teacher pass (one program: one row length)")]
    for stage, cfg in zip(self.stages, self.stage_cfgs):
      what = "its train step and its evaluation step"
      if cfg.train.generate_every:
        what += f", and for its generation checks {engine} in both modes"
      out.append((self.stage_part(stage), what))
    out += [("export", "nothing"), ("eval", f"{engine} in both modes")]
    return out

  @property
  def responses(self) -> str:
    return os.path.join(self.out, "responses.jsonl")

  @property
  def data(self) -> str:
    return os.path.join(self.out, DATA_DIR)

  @property
  def export(self) -> str:
    return os.path.join(self.out, "export")

  def stage_part(self, stage: str | None) -> str:
    return "train" if stage is None else f"train:{stage}"

  def parts(self) -> list[str]:
    return ["self_distill", "prepare_data", *map(self.stage_part, self.stages), "pick",
            "export", "eval"]

  def shares(self) -> dict[str, float]:
    return part_shares([(self.stage_part(s), c.train.steps)
                        for s, c in zip(self.stages, self.stage_cfgs)])

  def stage_argv(self, stage: str | None, *sets: str) -> list[str]:
    """train.main's arguments for `stage`, with `sets` after the stage's own overrides."""
    return ["--config", self.config, *([] if stage is None else ["--stage", stage]),
            *[a for s in (*self.stage_sets[stage], *sets) for a in ("--set", s)]]


def default_out(config: str) -> str:
  from hamburger_jax.run_config import load_run_config  # pylint: disable=import-outside-toplevel
  return load_run_config(config, shared_only=True).checkpoint.dir + "-pipeline"


def make_plan(args: argparse.Namespace) -> Plan:
  """Checks the command line and the config; raises PipelineError naming the problem."""
  from hamburger_jax.config import ConfigError, load_yaml  # pylint: disable=C0415
  from hamburger_jax.run_config import load_run_config, stage_names  # pylint: disable=C0415
  from hamburger_jax.data.self_distill import SYNTHETIC_PROMPT_LEN  # pylint: disable=C0415
  if not args.budget_minutes > 0:
    raise PipelineError(f"--budget-minutes={args.budget_minutes} must be > 0")
  if args.eval_limit < 1:
    raise PipelineError(f"--eval-limit={args.eval_limit} must be >= 1")
  try:
    stages = stage_names(load_yaml(args.config)) or [None]
    one_stage = (len(stages) > 1
                 and args.budget_minutes * SHARES["train"] < MIN_STAGE_MINUTES * len(stages))
    if one_stage:
      stages = stages[-1:]
    out = os.path.abspath(args.out or default_out(args.config))
    # Every stage reads the pipeline's data and runs under its folder. The last stage exports
    # to its own run folder (the pick's export is the one that ships, never the config's
    # checkpoint.export), and checks free generation at every checkpoint when the config has
    # no such checks: the pick rule reads them.
    sets = {s: [f"data.dir={os.path.join(out, DATA_DIR)}",
                f"checkpoint.dir={os.path.join(out, TRAIN_DIR)}"] for s in stages}
    sets[stages[-1]].append("checkpoint.export=''")
    if one_stage:  # the last stage alone starts from a fresh graft, not an earlier export
      sets[stages[-1]].append("train.init_from=''")
    last = load_run_config(args.config, sets[stages[-1]], stage=stages[-1])
    if not last.train.generate_every:
      sets[stages[-1]].append(f"train.generate_every={last.checkpoint.every}")
    cfgs = [load_run_config(args.config, sets[s], stage=s) for s in stages]
  except ConfigError as e:
    raise PipelineError(str(e)) from None
  # pretrained.load_base_for_run pairs a random base with no tokenizer.
  token_ids = cfgs[0].model.base == "random"
  max_len = min(min(c.data.entries, c.data.groups) for c in cfgs)
  max_new = None
  if token_ids:
    max_new = max_len - (SYNTHETIC_PROMPT_LEN[1] - 1)
    if max_new < 1:
      raise PipelineError(f"data.entries/groups={max_len} leave no room for an answer after a "
                          f"prompt of up to {SYNTHETIC_PROMPT_LEN[1] - 1} tokens")
  mix = args.mix or (IDS_MIX if token_ids else TEXT_MIX)
  tasks = args.eval_tasks or (IDS_EVAL_TASKS if token_ids else TEXT_EVAL_TASKS)
  check_steps(mix, tasks, args, token_ids)
  return Plan(args.config, out, args.budget_minutes, stages, cfgs, sets, token_ids, mix,
              max_len, max_new, args.strategy, args.teacher_top_k, tasks, args.eval_limit,
              one_stage)


def check_steps(mix: str, tasks: str, args: argparse.Namespace, token_ids: bool) -> None:
  """The parts' own checks of their flags, run before the first part."""
  from hamburger_jax.segmentation import get_strategy  # pylint: disable=C0415
  from hamburger_jax.data.self_distill import parse_mix  # pylint: disable=C0415
  from hamburger_jax.evaluation.run import TEXT_TASKS, parse_tasks  # pylint: disable=C0415
  try:
    names = [name for name, _ in parse_mix(mix)]
  except ValueError as e:
    raise PipelineError(str(e)) from None
  if token_ids and set(names) != {"synthetic"}:
    raise PipelineError(f"--mix {mix}: this config's base has no tokenizer; its prompts are "
                        "token ids (synthetic:N)")
  try:
    get_strategy(args.strategy)
    task_names = parse_tasks(tasks)
  except ValueError as e:
    raise PipelineError(str(e)) from None
  if token_ids and set(task_names) & set(TEXT_TASKS):
    raise PipelineError(f"--eval-tasks {tasks}: this config's base has no tokenizer; use "
                        f"{IDS_EVAL_TASKS}")
  if args.teacher_top_k < 1:
    raise PipelineError(f"--teacher-top-k={args.teacher_top_k} must be >= 1 (the distill "
                        "recipe reads the teacher's top-k)")


# ----------------------------------------------------------------------------- state


def read_state(plan: Plan) -> dict[str, Any]:
  """The run's state; PipelineError when --out belongs to another config or to no pipeline."""
  path = os.path.join(plan.out, STATE_FILE)
  config = os.path.realpath(plan.config)
  if os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      state = json.load(f)
    if state.get("config") != config:
      raise PipelineError(f"--out {plan.out} belongs to the pipeline of {state.get('config')}, "
                          f"not {config}: choose another --out")
    return state
  if os.path.isdir(plan.out) and os.listdir(plan.out):
    raise PipelineError(f"--out {plan.out} holds files but no {STATE_FILE}: it is not a "
                        "pipeline's folder; choose another --out")
  if os.path.exists(plan.out) and not os.path.isdir(plan.out):
    raise PipelineError(f"--out {plan.out} is a file, not a folder")
  return {"config": config, "parts": {}}


def write_state(plan: Plan, state: dict[str, Any]) -> None:
  os.makedirs(plan.out, exist_ok=True)
  # A reader sees the old state or the new one, never half of one.
  files.write_json_atomic(os.path.join(plan.out, STATE_FILE), state, indent=2)


# ----------------------------------------------------------------------------- running parts


def call(module: str, argv: list[str]) -> str:
  """`python -m module argv` in its own process, its output shown and returned; its error exit
  becomes a RuntimeError with its last lines. Interrupting the pipeline stops it too."""
  print(f"$ python -m {module} {' '.join(argv)}", flush=True)
  proc = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True,
                        check=False)
  print(proc.stdout, end="", flush=True)
  print(proc.stderr, end="", file=sys.stderr, flush=True)
  if proc.returncode:
    last = [l for l in proc.stderr.strip().splitlines() if l.strip()][-1:] or [""]
    raise RuntimeError(last[0].removeprefix("error: ") or
                       f"{module} exited with {proc.returncode} (its error is printed above)")
  return proc.stdout


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


def teacher_limit(answers: list[int], budget: float, rate: float | None) -> int:
  """How many answers (in file order) the teacher pass reads in `budget` minutes: at least two,
  a training sample and a validation one."""
  if rate is None:
    return len(answers)
  capacity, n = budget * rate * TEACHER_SPEEDUP, 0
  for tokens in answers:
    capacity -= tokens
    if capacity < 0:
      break
    n += 1
  return min(max(n, 2), len(answers))


def run_prepare_data(plan: Plan, budget: float, state: dict[str, Any]) -> dict[str, Any]:
  answers = answers_in(plan.responses)
  if len(answers) < 2:
    raise RuntimeError(f"{len(answers)} self-distilled answers in {plan.responses}: a training "
                       "and a validation split need 2; give the pipeline more minutes")
  # An interrupted teacher pass resumes from its finished shards only when it is given the same
  # answers again: the first attempt's count is kept.
  attempt = state.setdefault("attempts", {})
  n = attempt.setdefault("prepare_data", teacher_limit(answers, budget, tokens_per_minute(state)))
  write_state(plan, state)
  argv = ["--config", plan.config, "--source", f"jsonl:{plan.responses}", "--strategy",
          plan.strategy, "--max-len", str(plan.max_len), "--teacher-top-k",
          str(plan.teacher_top_k), "--out", plan.data]
  if n < len(answers):
    argv += ["--limit", str(n)]
  if os.path.exists(plan.data):  # written by an attempt stopped before its record: redo it
    argv.append("--overwrite")
  if plan.token_ids:
    argv.append("--token-ids")
  out = call("train.prepare_data", argv)
  # prepare_data's summary: "samples written  N (...)", "tokens  T (R response)".
  samples = re.search(r"^samples written\s+(\d+)", out, re.M)
  tokens = re.search(r"^tokens\s+(\d+) \((\d+) response\)", out, re.M)
  figure = f"answers {n} of {len(answers)}"
  rec = {"status": "done" if n == len(answers) else "budget", "answers_read": n}
  if samples:
    rec["samples"] = int(samples.group(1))
    figure += f", samples {rec['samples']}"
  if tokens:
    rec["tokens"], rec["response_tokens"] = int(tokens.group(1)), int(tokens.group(2))
    figure += f", tokens {rec['tokens']} ({rec['response_tokens']} response)"
  return {**rec, "figure": figure}


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


def eval_limit(plan: Plan, budget: float, rate: float | None) -> int:
  """Examples per task that fit `budget` minutes, decoding at self-distillation's rate in base
  mode and at one confidence (at most --eval-limit)."""
  from hamburger_jax.evaluation.run import MAX_NEW_TOKENS  # pylint: disable=C0415
  per_example = 2 * sum(MAX_NEW_TOKENS.get(t, 0) for t in plan.eval_tasks.split(","))
  if rate is None or per_example == 0:
    return plan.eval_limit
  return max(1, min(plan.eval_limit, math.floor(budget * rate / per_example)))


def run_eval(plan: Plan, budget: float, state: dict[str, Any]) -> dict[str, Any]:
  from hamburger_jax import pretrained  # pylint: disable=import-outside-toplevel
  from hamburger_jax.evaluation import run as evaluation  # pylint: disable=C0415
  confidence = plan.stage_cfgs[-1].train.generate_confidence  # the pick's
  limit = eval_limit(plan, budget, tokens_per_minute(state))
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


# ----------------------------------------------------------------------------- main


def summary_line(part: str, status: str, minutes: float, budget: float, figure: str) -> str:
  return f"{part:<14} {status:<11} {minutes:7.2f} / {budget:7.2f} min  {figure}"


def run_pipeline(plan: Plan, state: dict[str, Any]) -> tuple[int, list[str]]:
  """Runs the parts not finished yet; returns (exit code, one summary line per part)."""
  shares, lines, code = plan.shares(), [], 0
  state["budget_minutes"] = plan.budget
  write_state(plan, state)  # claims --out for this config before any part writes there
  for part in plan.parts():
    rec = state["parts"].get(part)
    if rec is not None:
      lines.append(summary_line(part, "skipped", rec["minutes"], rec["budget"],
                                f"{rec['figure']} [{rec['status']} in an earlier run]"))
      continue
    if code:
      lines.append(summary_line(part, "not run", 0.0, 0.0, "rerun the same command"))
      continue
    used = {p: r["minutes"] for p, r in state["parts"].items() if p in shares}
    budget = part_budget(shares, used, plan.budget, part)
    print(f"\n== {part}: {budget:.2f} of {plan.budget:g} minutes ==", flush=True)
    start = time.monotonic()
    try:
      rec = runner(plan, part)(plan, budget, state)
    except (Interrupted, KeyboardInterrupt):
      code, status, figure = 130, "interrupted", "rerun the same command to resume"
    except (RuntimeError, FileNotFoundError, ValueError) as e:
      code, status, figure = 1, "failed", str(e).splitlines()[0] if str(e) else repr(e)
    finally:
      gc.collect()
    minutes = (time.monotonic() - start) / 60
    if code:
      lines.append(summary_line(part, status, minutes, budget, figure))
      continue
    rec.update(minutes=minutes, budget=budget)
    state["parts"][part] = rec
    write_state(plan, state)
    lines.append(summary_line(part, rec["status"], minutes, budget, rec["figure"]))
  return code, lines


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m train.pipeline", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", required=True, help="YAML run config (see configs/)")
  p.add_argument("--budget-minutes", type=float, required=True,
                 help="wall-clock minutes for the whole pipeline, split between its parts")
  p.add_argument("--plan", action="store_true",
                 help="print what the run would do and compile, and stop")
  p.add_argument("--out", default=None,
                 help="the pipeline's folder (default: the config's checkpoint.dir + -pipeline)")
  p.add_argument("--mix", default=None,
                 help=f"self-distillation prompts (default: {TEXT_MIX}; a model without "
                 f"tokenizer: {IDS_MIX})")
  p.add_argument("--strategy", default=STRATEGY, help="segmentation of train.prepare_data")
  p.add_argument("--teacher-top-k", type=int, default=TEACHER_TOP_K,
                 help="teacher log-probabilities stored per response token")
  p.add_argument("--eval-tasks", default=None,
                 help=f"infer.eval tasks (default: {TEXT_EVAL_TASKS}; a model without "
                 f"tokenizer: {IDS_EVAL_TASKS})")
  p.add_argument("--eval-limit", type=int, default=32,
                 help="most examples per evaluation task (fewer when its minutes are short)")
  return p.parse_args(argv)


def plan_lines(plan: Plan) -> list[str]:
  """What the run will do and compile, printed before it starts."""
  stages = ", ".join(plan.stage_part(s) for s in plan.stages)
  out = [f"plan: {plan.budget:g} minutes; parts {', '.join(plan.parts())}"]
  if plan.one_stage:
    out.append(f"  {plan.budget:g} minutes leave under {MIN_STAGE_MINUTES:g} minutes of "
               f"training per stage: {stages} alone, from a fresh graft")
  steps = sum(1 for _, what in plan.programs() if "step" in what) * 2
  out.append(f"  compiles (train and evaluation steps: {steps}; the engine's, per decoding "
             "part: one per prompt chunk size and view used):")
  out += [f"    {part:<14} {what}" for part, what in plan.programs()]
  return out


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  try:
    plan = make_plan(args)
    state = read_state(plan)
  except PipelineError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2

  print("\n".join(plan_lines(plan)), flush=True)
  if args.plan:
    return 0

  def stop(*_):
    raise KeyboardInterrupt  # unwinds the part's own cleanup; a stage saves by itself
  previous = signal.signal(signal.SIGTERM, stop)
  try:
    code, lines = run_pipeline(plan, state)
  finally:
    signal.signal(signal.SIGTERM, previous)
  print(f"\npipeline {plan.out} ({plan.config}, {plan.budget:g} minutes):")
  for line in lines:
    print(line)
  return code


if __name__ == "__main__":
  sys.exit(main())
