"""The pipeline's recorded state, <out>/pipeline.json: each finished part (status, minutes,
figures), written atomically after the part, so that a rerun skips what finished."""

from __future__ import annotations

import json
import os
from typing import Any

from hamburger_jax import files
from hamburger_jax.pipeline.plan import PipelineError, Plan

STATE_FILE = "pipeline.json"


def read_state(plan: Plan) -> dict[str, Any]:
  """The run's state; PipelineError when its folder belongs to another config or to no
  pipeline."""
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
