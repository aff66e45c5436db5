"""The configuration of a training run (configs/*.yaml): model, graft, data, optimiser, mesh."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from hamburger_jax.config import (ConfigError, GraftConfig, LlamaConfig, apply_overrides,
                                  from_dict, load_yaml, to_dict)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  base: str = "smollm2"  # smollm2 | path/to/file.gguf | HF directory | random
  random: LlamaConfig | None = None  # the base's config when base == "random" (tests)
  dtype: str = "float32"  # compute dtype (bf16 matmuls are slower than fp32 on CPU)
  param_dtype: str = "float32"

  def __post_init__(self):
    if self.base == "random" and self.random is None:
      raise ConfigError("model.base is 'random' but model.random (a LlamaConfig) is not given")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  dir: str = ""  # tfds dataset directory written by train.prepare_data
  entries: int = 256  # M: base-input entries per packed row
  groups: int = 128  # G: predicted groups per packed row
  rows: int = 4  # packed rows per micro-batch, global over all processes
  accum: int = 1  # micro-batches per optimiser step (gradient accumulation)
  seed: int = 0
  validation_rows: int = 64  # rows of the validation split used per evaluation


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  trainable: str = "graft"  # graft | all
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
  generate_every: int = 0  # 0: off; else tokens per macro step on held-out prompts
  generate_prompts: int = 8
  generate_tokens: int = 64
  generate_confidence: float = 0.8
  seed: int = 0

  def __post_init__(self):
    if self.trainable not in ("graft", "all"):
      raise ConfigError(f"train.trainable={self.trainable!r}: use 'graft' or 'all'")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  dir: str = "runs/default"  # orbax checkpoints, metrics.jsonl, TensorBoard events
  every: int = 50
  keep: int = 3
  export: str = ""  # params-only export directory written at the end ("" = <dir>/export)
  export_dtype: str = "bfloat16"


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  data: int = -1  # -1: whatever is left of the devices
  fsdp: int = 1
  tensor: int = 1


@dataclasses.dataclass(frozen=True)
class RunConfig:
  model: ModelConfig = ModelConfig()
  graft: GraftConfig = GraftConfig()
  data: DataConfig = DataConfig()
  train: TrainConfig = TrainConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  mesh: MeshConfig = MeshConfig()

  def to_dict(self) -> dict[str, Any]:
    return to_dict(self)


def load_run_config(path: str | None, overrides: list[str] = (),
                    data: Mapping[str, Any] | None = None) -> RunConfig:
  """YAML file (or a dict) + `--set key=value` overrides -> RunConfig; unknown keys are errors."""
  raw = dict(data) if data is not None else load_yaml(path) if path else {}
  return from_dict(RunConfig, apply_overrides(raw, list(overrides)))
