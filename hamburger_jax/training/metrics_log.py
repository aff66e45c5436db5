"""A run's metrics: metrics.jsonl (one JSON line per logged step) and TensorBoard event files,
written by process 0, locally or on a bucket."""

from __future__ import annotations

import json
import time
from typing import Any

from hamburger_jax import files


class MetricsLog:
  """metrics.jsonl + TensorBoard event files (written by process 0 only).

  On a bucket an object cannot be appended to: metrics.jsonl and the event file are uploaded
  whole, at most every UPLOAD_S seconds (an object takes about one write a second), at each
  checkpoint save (`flush`) and at the end; a killed run loses at most the lines since its last
  save, which the resumed run logs again."""
  UPLOAD_S = 5.0

  def __init__(self, directory: str, enabled: bool, tensorboard: bool = True):
    self.enabled = enabled
    self.path = files.join(directory, "metrics.jsonl")
    self.remote = files.is_remote(directory)
    self.text, self.pending, self.uploaded = "", False, time.monotonic()
    self.tb = None
    if enabled:
      files.makedirs(directory)
      if self.remote and files.exists(self.path):
        self.text = files.read_text(self.path)  # a resumed run's log goes on after it
      if tensorboard:  # off where every file counts (a window's files come back a few a call)
        from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
        self.tb = SummaryWriter(files.join(directory, "tb"))

  def write(self, step: int, metrics: dict[str, float]) -> None:
    if not self.enabled:
      return
    line = json.dumps({"step": step, "time": time.time(), **metrics}) + "\n"
    for k, v in metrics.items():
      if self.tb is not None:
        self.tb.add_scalar(k, v, step)
    if self.remote:
      self.text, self.pending = self.text + line, True
      if time.monotonic() - self.uploaded >= self.UPLOAD_S:
        self.flush()
      return
    with open(self.path, "a") as f:
      f.write(line)
    if self.tb is not None:
      self.tb.flush()

  def flush(self) -> None:
    """Uploads what a bucket's log has not yet received (locally every line is written at once)."""
    if self.enabled and self.pending:
      files.write_text_atomic(self.path, self.text)
      if self.tb is not None:
        self.tb.flush()
      self.pending, self.uploaded = False, time.monotonic()

  def close(self) -> None:
    if self.enabled:
      self.flush()
    if self.tb is not None:
      self.tb.close()


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
  path = files.join(run_dir, "metrics.jsonl")
  if not files.exists(path):
    raise FileNotFoundError(f"{path} does not exist: pass the checkpoint.dir of a train.main run")
  rows = [json.loads(line) for line in files.read_text(path).splitlines() if line.strip()]
  # A resumed run re-logs the steps after its last checkpoint: the later record wins.
  by_step = {r["step"]: r for r in rows}
  return [by_step[s] for s in sorted(by_step)]
