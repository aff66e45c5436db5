"""Timing the self-distilled answers' program (hamburger_jax.data.tokens.answers) by its decode
step (answers.STEPS), with what its compiled loop copies each step."""

from __future__ import annotations

import collections
import dataclasses
import re
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hamburger_jax.data.tokens.answers import STEPS, answers_program


@dataclasses.dataclass(frozen=True)
class AnswersTiming:
  step: str
  compile_s: float
  seconds: float  # the fastest of the timed calls
  tokens: int  # answer tokens a call makes (no stop ids: every row runs to max_new)
  loop_copies: dict[str, int]  # whole-array copies in the decode loop's body, by shape
  answer: np.ndarray  # [R, max_new] the tokens, to compare the reads by

  @property
  def tokens_per_s(self) -> float:
    return self.tokens / self.seconds


def loop_copies(hlo: str) -> dict[str, int]:
  """Copies (`copy` instructions) in the bodies of a compiled module's while loops, counted by
  their result shape: what the loop moves every trip besides its work."""
  bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
  counts: collections.Counter = collections.Counter()
  for m in re.finditer(r"^%?([\w.\-]+) [^\n]*\{\n(.*?)\n\}", hlo, re.S | re.M):
    if m.group(1) in bodies:
      counts.update(re.findall(r"= (\S+) copy\(", m.group(2)))
  return dict(counts)


def time_answers(base: nnx.Module, rows: int, prompt_len: int, max_new: int, repeats: int,
                 steps: Sequence[str] = STEPS, seed: int = 0) -> list[AnswersTiming]:
  """answers_program of `base` on `rows` random prompts of `prompt_len` tokens, once per decode
  step of `steps`: each compiled first, then their calls interleaved `repeats` times (a shared
  machine's drift hits them alike), the fastest of each kept."""
  graphdef, state = nnx.split(base)
  rng = np.random.default_rng(seed)
  ids = jnp.asarray(rng.integers(0, base.cfg.vocab_size, (rows, prompt_len)), jnp.int32)
  lengths = jnp.asarray(rng.integers(prompt_len // 2, prompt_len + 1, rows), jnp.int32)
  stops = jnp.zeros((0,), jnp.int32)
  compiled, compile_s = {}, {}
  for step in steps:
    t = time.perf_counter()
    compiled[step] = answers_program.lower(graphdef, state, ids, lengths, stops,
                                           max_new=max_new, step=step).compile()
    compile_s[step] = time.perf_counter() - t
  best = {step: float("inf") for step in steps}
  answer = {}
  for _ in range(repeats):
    for step in steps:
      t = time.perf_counter()
      answer[step] = jax.device_get(compiled[step](graphdef, state, ids, lengths, stops)[0])
      best[step] = min(best[step], time.perf_counter() - t)
  return [AnswersTiming(step, compile_s[step], best[step], rows * max_new,
                        loop_copies(compiled[step].as_text()), np.asarray(answer[step]))
          for step in steps]
