"""What the pipeline's parts run, derived from the config and the settings and checked before
anything runs: a bad setting is one PipelineError that names it."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from hamburger_jax.pipeline import budget as budget_rule

DATA_DIR, TRAIN_DIR, EVAL_DIR = "data", "train", "eval"  # under the pipeline's folder
# The recipe's data steps: the mix of configs/smollm2_135m.yaml's recipe (the shipped graft's
# data, docs/results/data.md), its segmentation and teacher signals.
TEXT_MIX = ("sharegpt:2400,gsm_symbolic:500,basic_arithmetic:300,chain_sum:300,"
            "letter_counting:400,gcd:400,lcm:400")
IDS_MIX = "synthetic:4096"  # a cap: as many as the minutes allow, up to this many
STRATEGY = "confident:0.6"
TEACHER_TOP_K = 16
TEXT_EVAL_TASKS = "basic_arithmetic,chain_sum,sharegpt_heldout,nll"
IDS_EVAL_TASKS = "synthetic,nll"
EVAL_LIMIT = 32


class PipelineError(Exception):
  """Bad input, found before anything is written; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class Settings:
  """A pipeline run as its command line states it (`python -m train.pipeline`'s flags)."""
  config: str  # the YAML run config
  budget_minutes: float
  out: str | None = None  # default: the config's checkpoint.dir + "-pipeline"
  mix: str | None = None  # default: TEXT_MIX, or IDS_MIX for a base without tokenizer
  strategy: str = STRATEGY
  teacher_top_k: int = TEACHER_TOP_K
  eval_tasks: str | None = None  # default: TEXT_EVAL_TASKS, or IDS_EVAL_TASKS
  eval_limit: int = EVAL_LIMIT


@dataclasses.dataclass(frozen=True)
class Plan:
  """What the parts run, derived from the config and the settings before anything runs."""
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
    return budget_rule.part_shares([(self.stage_part(s), c.train.steps)
                                    for s, c in zip(self.stages, self.stage_cfgs)])

  def stage_argv(self, stage: str | None, *sets: str) -> list[str]:
    """train.main's arguments for `stage`, with `sets` after the stage's own overrides."""
    return ["--config", self.config, *([] if stage is None else ["--stage", stage]),
            *[a for s in (*self.stage_sets[stage], *sets) for a in ("--set", s)]]

  def lines(self) -> list[str]:
    """What the run will do and compile, printed before it starts."""
    stages = ", ".join(self.stage_part(s) for s in self.stages)
    out = [f"plan: {self.budget:g} minutes; parts {', '.join(self.parts())}"]
    if self.one_stage:
      out.append(f"  {self.budget:g} minutes leave under {budget_rule.MIN_STAGE_MINUTES:g} "
                 f"minutes of training per stage: {stages} alone, from a fresh graft")
    steps = sum(1 for _, what in self.programs() if "step" in what) * 2
    out.append(f"  compiles (train and evaluation steps: {steps}; the engine's, per decoding "
               "part: one per prompt chunk size and view used):")
    out += [f"    {part:<14} {what}" for part, what in self.programs()]
    return out


def default_out(config: str) -> str:
  from hamburger_jax.run_config import load_run_config  # pylint: disable=import-outside-toplevel
  return load_run_config(config, shared_only=True).checkpoint.dir + "-pipeline"


def make_plan(settings: Settings) -> Plan:
  """Checks the settings and the config; raises PipelineError naming the problem."""
  from hamburger_jax.config import ConfigError, load_yaml  # pylint: disable=C0415
  from hamburger_jax.run_config import load_run_config, stage_names  # pylint: disable=C0415
  from hamburger_jax.data.self_distill import SYNTHETIC_PROMPT_LEN  # pylint: disable=C0415
  s = settings
  if not s.budget_minutes > 0:
    raise PipelineError(f"--budget-minutes={s.budget_minutes} must be > 0")
  if s.eval_limit < 1:
    raise PipelineError(f"--eval-limit={s.eval_limit} must be >= 1")
  try:
    stages = stage_names(load_yaml(s.config)) or [None]
    one_stage = budget_rule.one_stage(len(stages), s.budget_minutes)
    if one_stage:
      stages = stages[-1:]
    out = os.path.abspath(s.out or default_out(s.config))
    # Every stage reads the pipeline's data and runs under its folder. The last stage exports
    # to its own run folder (the pick's export is the one that ships, never the config's
    # checkpoint.export), and checks free generation at every checkpoint when the config has
    # no such checks: the pick rule reads them.
    sets = {st: [f"data.dir={os.path.join(out, DATA_DIR)}",
                 f"checkpoint.dir={os.path.join(out, TRAIN_DIR)}"] for st in stages}
    sets[stages[-1]].append("checkpoint.export=''")
    if one_stage:  # the last stage alone starts from a fresh graft, not an earlier export
      sets[stages[-1]].append("train.init_from=''")
    last = load_run_config(s.config, sets[stages[-1]], stage=stages[-1])
    if not last.train.generate_every:
      sets[stages[-1]].append(f"train.generate_every={last.checkpoint.every}")
    cfgs = [load_run_config(s.config, sets[st], stage=st) for st in stages]
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
  mix = s.mix or (IDS_MIX if token_ids else TEXT_MIX)
  tasks = s.eval_tasks or (IDS_EVAL_TASKS if token_ids else TEXT_EVAL_TASKS)
  check_parts(mix, tasks, s, token_ids)
  return Plan(s.config, out, s.budget_minutes, stages, cfgs, sets, token_ids, mix, max_len,
              max_new, s.strategy, s.teacher_top_k, tasks, s.eval_limit, one_stage)


def check_parts(mix: str, tasks: str, settings: Settings, token_ids: bool) -> None:
  """The parts' own checks of their settings, run before the first part."""
  from hamburger_jax.segmentation import get_strategy  # pylint: disable=C0415
  from hamburger_jax.data.source_specs import parse_mix  # pylint: disable=C0415
  from hamburger_jax.evaluation.run import TEXT_TASKS, parse_tasks  # pylint: disable=C0415
  try:
    names = [name for name, _ in parse_mix(mix)]
  except ValueError as e:
    raise PipelineError(str(e)) from None
  if token_ids and set(names) != {"synthetic"}:
    raise PipelineError(f"--mix {mix}: this config's base has no tokenizer; its prompts are "
                        "token ids (synthetic:N)")
  try:
    get_strategy(settings.strategy)
    task_names = parse_tasks(tasks)
  except ValueError as e:
    raise PipelineError(str(e)) from None
  if token_ids and set(task_names) & set(TEXT_TASKS):
    raise PipelineError(f"--eval-tasks {tasks}: this config's base has no tokenizer; use "
                        f"{IDS_EVAL_TASKS}")
  if settings.teacher_top_k < 1:
    raise PipelineError(f"--teacher-top-k={settings.teacher_top_k} must be >= 1 (the distill "
                        "recipe reads the teacher's top-k)")
