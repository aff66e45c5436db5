"""The configuration of a training run (configs/*.yaml): model, graft, data, optimiser, mesh."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from hamburger_jax import files
from hamburger_jax.config import (ATTENTION, DEFAULT_CONFIDENCE, PRECISIONS, REMAT, ConfigError,
                                  GraftConfig, LlamaConfig, apply_overrides, from_dict, load_yaml,
                                  to_dict)


def _at_least(section: str, obj: Any, minimum: float, *names: str, hint: str = "") -> None:
  """Refuses a value of `names` below `minimum` (a config typo that would otherwise surface as a
  ZeroDivisionError or a silent no-op mid-run) with an error naming the key."""
  for name in names:
    value = getattr(obj, name)
    if value < minimum:
      raise ConfigError(f"{section}.{name}={value} must be >= {minimum:g}" +
                        (f" ({hint})" if hint else ""))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  base: str = "smollm2"  # smollm2 | path/to/file.gguf | HF directory | random
  random: LlamaConfig | None = None  # the base's config when base == "random" (tests)
  dtype: str = "float32"  # compute dtype (bf16 matmuls are slower than fp32 on CPU)
  param_dtype: str = "float32"
  attention: str = "auto"  # packed rows' attention kernel in the train step (config.ATTENTION)

  def __post_init__(self):
    if self.base == "random" and self.random is None:
      raise ConfigError("model.base is 'random' but model.random (a LlamaConfig) is not given")
    if self.attention not in ATTENTION:
      raise ConfigError(f"model.attention={self.attention!r}: use one of {', '.join(ATTENTION)}")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  dir: str = ""  # tfds dataset directory written by train.prepare_data
  entries: int = 256  # M: base-input entries per packed row
  # L: unmerged tokens per packed row, the teacher's row (distill.teacher=online); 0 = entries
  tokens: int = 0
  groups: int = 128  # G: predicted groups per packed row
  rows: int = 4  # packed rows per micro-batch, global over all processes
  accum: int = 1  # micro-batches per optimiser step (gradient accumulation)
  seed: int = 0
  validation_rows: int = 64  # rows of the validation split used per evaluation

  def __post_init__(self):
    _at_least("data", self, 1, "entries", "groups", "rows", "accum", "validation_rows")
    _at_least("data", self, 0, "tokens", hint="0 sizes the teacher's rows like data.entries")

  @property
  def row_tokens(self) -> int:
    """Unmerged tokens of a packed row (the teacher's row in the step)."""
    return self.tokens or self.entries


# What a run trains. Stages of the distill recipe: "micro" (stage 1: micro-step decoder + stop
# head), "merger" (stage 2: compositional embedder + merged-entry adapters), "graft" (every grafted
# module, stage 3 or the paper recipe on a frozen base), "all" (the paper: base too), "stop" (the
# stop head alone, e.g. on a target that needs the merged forward: distill.stop_target=harm),
# "drafter" (verify mode's drafter, graft.drafter_layers, on stored features like stage 1).
TRAINABLE = ("graft", "all", "micro", "merger", "stop", "drafter")
RECIPES = ("paper", "distill")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  trainable: str = "graft"  # one of TRAINABLE
  recipe: str = "paper"  # paper (docs/SPEC.md 2.2) | distill (hamburger_jax.objectives.distillation)
  init_from: str = ""  # a graft export to start from (a stage starts from the previous one's)
  steps: int = 1000  # optimiser steps (the cosine schedule spans them)
  lr_base: float = 5e-5
  lr_graft: float = 1e-4
  lr_final: float = 1e-5
  warmup_steps: int = 0
  weight_decay: float = 0.01
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  clip_norm: float = 1.0
  ce_chunk: int = 1024
  log_every: int = 10
  eval_every: int = 100
  # 0: off; else every N steps, free generation on held-out prompts: tokens per macro step and,
  # with the base frozen, agreement with the base's greedy answers (gen_prefix_agreement)
  generate_every: int = 0
  generate_prompts: int = 8
  generate_tokens: int = 64
  generate_confidence: float = DEFAULT_CONFIDENCE
  # 0: off; else every N steps (and at the start and the end), the fidelity figures of the
  # current graft on a fidelity set (hamburger_jax/evaluation/fidelity.py; "" the committed set):
  # the learning curve of agreement after merged entries, logged as fid_* metrics
  fidelity_every: int = 0
  fidelity_set: str = ""
  # > 0 (train.trainable drafter): the drafter learns to draft among the first N ids of
  # train.init_from's micro vocabulary (hamburger_jax/micro_vocab.py), as it drafts at decode:
  # its loss reads that reduced head, not the whole one
  micro_vocab: int = 0
  seed: int = 0
  # How the base's and the micro decoder's layers run in the train and evaluation steps:
  # scan_layers runs them as one loop over stacked weights (a compiler sees one layer: minutes
  # less compiling a 30-layer model for a TPU; the same math); remat "layers" recomputes each
  # layer's activations in the backward pass from its input (memory for about a third more
  # compute; needs scan_layers).
  scan_layers: bool = False
  remat: str = "none"
  # float32 matmuls: "default" (the backend's: bf16 passes on a TPU, TF32 on a GPU) or
  # "highest" (full float32 everywhere; hamburger_jax/precision.py)
  precision: str = "default"

  def __post_init__(self):
    if self.trainable not in TRAINABLE:
      raise ConfigError(f"train.trainable={self.trainable!r}: use one of {', '.join(TRAINABLE)}")
    if self.recipe not in RECIPES:
      raise ConfigError(f"train.recipe={self.recipe!r}: use one of {', '.join(RECIPES)}")
    if self.trainable in ("micro", "drafter") and self.recipe != "distill":
      raise ConfigError(f"train.trainable={self.trainable} learns from the teacher's stored "
                        "features: it needs train.recipe=distill")
    _at_least("train", self, 1, "steps", hint="an untrained run has nothing to export")
    _at_least("train", self, 1, "log_every", "ce_chunk", "generate_prompts", "generate_tokens")
    _at_least("train", self, 0, "eval_every", "generate_every", "fidelity_every", "micro_vocab",
              hint="0 turns it off")
    if self.micro_vocab and (self.trainable != "drafter" or not self.init_from):
      raise ConfigError(f"train.micro_vocab={self.micro_vocab} restricts a drafter to the micro "
                        "vocabulary of the graft it grows from: it needs train.trainable=drafter "
                        "and train.init_from")
    _at_least("train", self, 0, "warmup_steps", "lr_base", "lr_graft", "lr_final",
              "weight_decay", "clip_norm")
    if self.warmup_steps > self.steps:
      raise ConfigError(f"train.warmup_steps={self.warmup_steps} exceeds train.steps="
                        f"{self.steps}: the warm-up must fit in the run")
    for name in ("b1", "b2"):
      if not 0 <= getattr(self, name) < 1:
        raise ConfigError(f"train.{name}={getattr(self, name)} must be in [0, 1)")
    if not self.eps > 0:
      raise ConfigError(f"train.eps={self.eps} must be > 0")
    if self.precision not in PRECISIONS:
      raise ConfigError(f"train.precision={self.precision!r}: use one of {', '.join(PRECISIONS)}")
    if self.remat not in REMAT:
      raise ConfigError(f"train.remat={self.remat!r}: use one of {', '.join(REMAT)}")
    if self.remat != "none" and not self.scan_layers:
      raise ConfigError(f"train.remat={self.remat} recomputes the layers of a scanned stack: "
                        "set train.scan_layers=true too")
    if not 0 <= self.generate_confidence <= 1:
      raise ConfigError(f"train.generate_confidence={self.generate_confidence} must be in [0, 1]")


STOP_TARGETS = ("teacher", "segments", "harm")
# Where the distill recipe's teacher signals come from: "stored" by the data's teacher pass
# (hamburger_jax.data.teacher_pass), or "online", the frozen base inside the train step
# (hamburger_jax.objectives.online_teacher; the data is token ids only).
TEACHERS = ("stored", "online")
# The teacher's top-k next-token distribution the KL reads (train.prepare_data --teacher-top-k).
DEFAULT_TEACHER_TOP_K = 16


@dataclasses.dataclass(frozen=True)
class DistillConfig:
  """Loss weights of the distill recipe (hamburger_jax.objectives.distillation says what each is)."""
  kl_weight: float = 1.0
  feature_weight: float = 1.0
  stop_weight: float = 0.5
  ce_weight: float = 0.0
  greedy_weight: float = 0.0  # CE on the teacher's greedy token (a drafter's ranking term)
  # Training-time test (EAGLE-3, HASS) for verify mode's drafter: each micro step reads the
  # drafter's own earlier drafts, as decoding does, not the data's tokens
  # (distillation.drafted_window; trainable=drafter with train.micro_vocab only).
  draft_unroll: bool = False
  stop_target: str = "teacher"  # teacher | segments | harm (hamburger_jax.objectives.distillation)
  # Dense alignment at merged entries: every base layer's residual, keys and values against the
  # exact base's at the group's last token (distillation.dense_alignment; the teacher runs in
  # the step over the rows unmerged, data.tokens slots a row)
  dense_weight: float = 0.0
  teacher: str = "stored"  # one of TEACHERS
  top_k: int = DEFAULT_TEACHER_TOP_K  # the online teacher's (a stored one's is in its data)

  def __post_init__(self):
    if self.teacher not in TEACHERS:
      raise ConfigError(f"distill.teacher={self.teacher!r}: use one of {', '.join(TEACHERS)}")
    _at_least("distill", self, 1, "top_k")
    if self.stop_target not in STOP_TARGETS:
      raise ConfigError(f"distill.stop_target={self.stop_target!r}: use one of "
                        f"{', '.join(STOP_TARGETS)}")
    for name in ("kl_weight", "feature_weight", "stop_weight", "ce_weight", "dense_weight",
                 "greedy_weight"):
      if getattr(self, name) < 0:
        raise ConfigError(f"distill.{name}={getattr(self, name)} must be >= 0")


EXPORT_DTYPES = ("bfloat16", "float32", "float16")
# What reads a dataset (tfds's array_record files): a bucket is read through a mount instead.
DATASET_READER = "the dataset reader (array_record)"


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  dir: str = "runs/default"  # orbax checkpoints, metrics.jsonl, TensorBoard events; or gs://
  every: int = 50
  keep: int = 3
  export: str = ""  # params-only export directory written at the end ("" = <dir>/export)
  export_dtype: str = "bfloat16"

  def __post_init__(self):
    _at_least("checkpoint", self, 1, "every", hint="steps between saves")
    _at_least("checkpoint", self, 1, "keep", hint="checkpoints kept; resuming needs at least one")
    if not self.dir:
      raise ConfigError("checkpoint.dir is empty: name the run's directory, e.g. runs/my-run")
    if self.export_dtype not in EXPORT_DTYPES:
      raise ConfigError(f"checkpoint.export_dtype={self.export_dtype!r}: use one of "
                        f"{', '.join(EXPORT_DTYPES)}")


def checkpoints_dir(run_dir: str) -> str:
  """Where a run (checkpoint.dir) keeps its orbax checkpoints, one directory per saved step."""
  return files.join(run_dir, "checkpoints")


def saved_steps(run_dir: str) -> set[int] | None:
  """Steps with a complete checkpoint in the run in `run_dir` (None when the run has no
  checkpoints folder): orbax's own reading of its step folders, so the latest is the step a
  resumed run starts from."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  path = checkpoints_dir(run_dir)
  if not files.isdir(path):
    return None
  return set(ocp.utils.checkpoint_steps(path))


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """How the processes of a multi-process run (train.main --num-processes N) watch each other.

  heartbeat_timeout_s: a process that sends the coordination service (on process 0) no heartbeat
  for this long is lost: every other process then ends with one line naming it and the last
  complete checkpoint, and exit code 75 (hamburger_jax/multiprocess.py). The heartbeat is sent
  by the coordination client's own thread, not by the training loop, so a slow step, a long
  compile, a checkpoint save or a data stall never counts; a process or host that stops
  altogether does (killed, crashed, preempted, frozen or swapped out, so starved of CPU that the
  thread cannot run, or cut off from process 0's host). Shorter ends a broken run sooner (the
  others end this long plus about a second after the loss, at once when process 0 is lost);
  too short ends a healthy run whose host pauses, or whose network to process 0 drops, for that
  long. jax's own default is 100 s.
  """
  heartbeat_timeout_s: int = 20

  def __post_init__(self):
    _at_least("distributed", self, 2, "heartbeat_timeout_s",
              hint="seconds without a heartbeat before a process counts as lost")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  data: int = -1  # -1: whatever is left of the devices
  fsdp: int = 1
  tensor: int = 1

  def __post_init__(self):
    if self.data != -1 and self.data < 1:
      raise ConfigError(f"mesh.data={self.data} must be -1 (the devices left) or >= 1")
    _at_least("mesh", self, 1, "fsdp", "tensor")


@dataclasses.dataclass(frozen=True)
class RunConfig:
  model: ModelConfig = ModelConfig()
  graft: GraftConfig = GraftConfig()
  data: DataConfig = DataConfig()
  train: TrainConfig = TrainConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  mesh: MeshConfig = MeshConfig()
  distill: DistillConfig = DistillConfig()
  distributed: DistributedConfig = DistributedConfig()
  stage: str = ""  # the stage of the config's `stages:` this run is ("" = no stages)

  def __post_init__(self):
    if self.train.trainable == "drafter" and not self.graft.drafter_layers:
      raise ConfigError("train.trainable=drafter trains verify mode's drafter: set "
                        "graft.drafter_layers (e.g. 1; a run from a graft without one starts it "
                        "as a copy of its micro decoder's first layers)")
    if self.distill.draft_unroll and not (self.train.trainable == "drafter"
                                          and self.train.micro_vocab):
      raise ConfigError("distill.draft_unroll feeds verify mode's drafter its own drafts: it "
                        "needs train.trainable=drafter and train.micro_vocab (e.g. 2048)")
    if self.distill.dense_weight and not (self.train.recipe == "distill" and
                                          self.train.trainable in ("merger", "graft", "all")):
      raise ConfigError("distill.dense_weight aligns the merged entries' layers: it needs "
                        "train.recipe=distill and train.trainable merger, graft or all")
    if self.distill.dense_weight and not self.data.tokens:
      raise ConfigError("distill.dense_weight runs the base over each row unmerged: set "
                        "data.tokens to the unmerged tokens a row holds (e.g. 2 x data.entries)")
    if self.graft.merge_layer and not self.data.tokens and self.train.trainable != "micro":
      raise ConfigError(f"graft.merge_layer={self.graft.merge_layer} runs the base's lower layers "
                        "over each row unmerged: set data.tokens to the unmerged tokens a row "
                        "holds (e.g. 2.5 x data.entries)")
    if (self.train.recipe == "distill" and self.train.trainable == "micro"
        and self.distill.stop_target == "harm"):
      raise ConfigError("distill.stop_target=harm labels each merge by how the base reads it, "
                        "which needs the merged forward; stage 1 (train.trainable=micro) runs "
                        "none: use harm with train.trainable stop, merger or graft")

  def to_dict(self) -> dict[str, Any]:
    return to_dict(self)


def load_run_config(path: str | None, overrides: list[str] = (),
                    data: Mapping[str, Any] | None = None, stage: str | None = None,
                    shared_only: bool = False) -> RunConfig:
  """YAML file (or a dict) + `--set key=value` overrides -> RunConfig; unknown keys are errors.

  A config with `stages:` (a list of {name, <sections to override>}) is run one stage at a time:
  `stage` picks one. Stage S checkpoints to <checkpoint.dir>/S, exports to
  <checkpoint.dir>/S/export (the last stage, or any stage given checkpoint.export in
  `overrides`: to checkpoint.export) and starts from the previous
  stage's export (train.init_from), unless the stage says otherwise. `shared_only` reads such a
  config without picking a stage (for tools that need only what every stage shares: model,
  graft, data).
  """
  raw = dict(data) if data is not None else load_yaml(path) if path else {}
  stages = raw.pop("stages", None)
  raw = apply_overrides(raw, list(overrides))
  if (stages is not None and not shared_only) or stage is not None:
    # The overrides set the root (e.g. checkpoint.dir) the stages derive from, and win over the
    # stage's own values.
    raw = _select_stage(raw, stages, stage, {o.split("=", 1)[0] for o in overrides})
  return from_dict(RunConfig, raw)


def check_training_inputs(cfg: RunConfig) -> None:
  """What a training run needs beyond a valid config, checked before anything heavy loads: a
  dataset at data.dir (written by train.prepare_data)."""
  d = cfg.data.dir
  if not d:
    raise ConfigError("data.dir is empty: build a dataset with python -m train.prepare_data ... "
                      "--out DIR and set data.dir=DIR")
  try:
    files.check_local(d, "data.dir", DATASET_READER)
  except files.StorageError as e:
    raise ConfigError(str(e)) from None
  if not os.path.isdir(d):
    raise ConfigError(f"data.dir {d} does not exist: build it with python -m train.prepare_data "
                      f"... --out {d} (or set data.dir to an existing dataset)")
  if not os.path.isfile(os.path.join(d, "dataset_info.json")):
    raise ConfigError(f"data.dir {d} is not a dataset written by train.prepare_data (no "
                      f"dataset_info.json): rebuild it with python -m train.prepare_data ... "
                      f"--out {d}")


def stage_names(raw: Mapping[str, Any]) -> list[str]:
  return [str(s.get("name", "")) for s in raw.get("stages") or []]


def _select_stage(raw: dict[str, Any], stages: Any, stage: str | None,
                  fixed: set[str] = frozenset()) -> dict[str, Any]:
  """`raw` with the stage's sections and derived paths; keys in `fixed` (dotted, set on the
  command line) keep their values."""
  if not isinstance(stages, list) or not stages or not all(
      isinstance(s, Mapping) and s.get("name") for s in stages):
    raise ConfigError("`stages:` must be a non-empty list of mappings, each with a name"
                      if stages is not None else f"--stage {stage}: this config has no stages")
  names = [str(s["name"]) for s in stages]
  if stage is None:
    raise ConfigError(f"this config is trained in stages ({', '.join(names)}): run them in "
                      "order with --stage NAME")
  if stage not in names:
    raise ConfigError(f"unknown stage {stage!r}; this config's stages are: {', '.join(names)}")
  i = names.index(stage)
  out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in raw.items()}
  ckpt = dict(out.get("checkpoint") or {})
  root = ckpt.get("dir", CheckpointConfig.dir)
  stage_export = lambda j: os.path.join(root, names[j], "export")
  ckpt["dir"] = os.path.join(root, stage)
  # The last stage exports to checkpoint.export, the others where the next stage looks for them,
  # unless the command line names another export (e.g. to keep an earlier step apart).
  if not (ckpt.get("export") and (i == len(names) - 1 or "checkpoint.export" in fixed)):
    ckpt["export"] = stage_export(i)
  out["checkpoint"] = ckpt
  if i > 0 and "train.init_from" not in fixed:
    out["train"] = {**dict(out.get("train") or {}), "init_from": stage_export(i - 1)}
  for section, values in stages[i].items():
    if section == "name":
      continue
    if not isinstance(values, Mapping):
      raise ConfigError(f"stage {stage!r}: {section} must be a mapping of keys to override")
    out[section] = {**dict(out.get(section) or {}),
                    **{k: v for k, v in values.items() if f"{section}.{k}" not in fixed}}
  out["stage"] = stage
  return out
