"""Generating an evaluation task's answers in batches, in base mode and in HAMburger mode at
several confidences, with decode timings that leave compilation out."""

from __future__ import annotations

import collections
import dataclasses
import sys
from typing import Any, Sequence

import numpy as np
from tqdm import tqdm

from hamburger_jax.decode.requests import kv_compression
from hamburger_jax.evaluation.statistics import bootstrap_ci


@dataclasses.dataclass
class ModeRun:
  """All generations of one task in one mode (and confidence)."""
  gens: list  # hamburger_jax.decode.engine.Generation, one per example
  decode_s: float  # summed over batches; compilation excluded
  compile_s: float
  merge_layer: int = 0  # where the graft's groups become one entry (its KV compression's layer)
  num_layers: int = 1  # the base's

  @property
  def tokens(self) -> int:
    return sum(g.new_tokens for g in self.gens)

  @property
  def macro_steps(self) -> int:
    return sum(g.macro_steps for g in self.gens)

  def summary(self, scores: Sequence[float]) -> dict[str, Any]:
    """results.json's numbers of this run, given one score per generation."""
    return {"score": float(np.mean(scores)) if scores else float("nan"),
            "ci95": list(bootstrap_ci(scores)),
            "tokens": self.tokens, "macro_steps": self.macro_steps,
            "kv_compression": kv_compression(self.gens, self.merge_layer, self.num_layers),
            "decode_s": self.decode_s, "compile_s": self.compile_s,
            "tokens_per_s": self.tokens / self.decode_s if self.decode_s > 0 else float("nan"),
            "group_sizes": dict(sorted(collections.Counter(
                s for g in self.gens for s in g.groups).items()))}


def generate_batched(engine, prompts: list, *, mode: str, continue_at: float, max_new: int,
                     batch: int, bar=None, max_group: int | None = None) -> ModeRun:
  """Greedy generations of `prompts`, `batch` at a time; `bar` (a tqdm bar) counts batches.
  `continue_at`: the stop head's threshold, the confidence in HAMburger mode and the draft
  confidence in verify mode (DecodeState.continue_at)."""
  gens, decode_s, compile_s = [], 0.0, 0.0
  batch = min(batch, len(prompts))
  setting = {"draft_confidence" if mode == "verify" else "confidence": continue_at}
  run = lambda rows: engine.generate(rows, max_new_tokens=max_new, mode=mode,
                                     max_group=max_group, **setting)
  for i in range(0, len(prompts), batch):
    chunk = prompts[i:i + batch]
    # A short last batch is filled with copies of its last prompt, so that it reuses the compiled
    # program of the full batches (a new batch size would compile anew); copies are dropped.
    rows = chunk + [chunk[-1]] * (batch - len(chunk))
    out = run(rows)
    if out[0].compile_s > 0:
      # Programs just compiled: their first run also pays one-time costs (buffer allocation, thread
      # pools); time a second, identical run (greedy, so the same tokens).
      compile_s += out[0].compile_s
      out = run(rows)
    gens += out[:len(chunk)]
    decode_s += out[0].decode_s
    if bar is not None:
      bar.update(1)
  return ModeRun(gens, decode_s, compile_s, engine.merge_layer, engine.base_cfg.num_layers)


def run_modes(engine, examples, confidences: Sequence[float], max_new: int, batch: int,
              name: str, max_group: int | None = None,
              verify_draft_confidence: float | None = None
              ) -> tuple[ModeRun, dict[float, ModeRun], ModeRun | None]:
  """The base run, one HAMburger run per confidence (groups capped at `max_group` tokens) and,
  with `verify_draft_confidence`, a verify run at that draft confidence, over the examples'
  prompts, with a progress bar on stderr."""
  prompts = [ex.messages for ex in examples]
  n_batches = -(-len(prompts) // min(batch, len(prompts)))
  runs = 1 + len(confidences) + (verify_draft_confidence is not None)
  with tqdm(total=n_batches * runs, desc=name, unit="batch", file=sys.stderr) as bar:
    kw = dict(max_new=max_new, batch=batch, bar=bar)
    base = generate_batched(engine, prompts, mode="base", continue_at=1.0, **kw)
    ham = {c: generate_batched(engine, prompts, mode="hamburger", continue_at=c,
                               max_group=max_group, **kw)
           for c in confidences}
    checked = (None if verify_draft_confidence is None else
               generate_batched(engine, prompts, mode="verify",
                                continue_at=verify_draft_confidence, **kw))
  return base, ham, checked
