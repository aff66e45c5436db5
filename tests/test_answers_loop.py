"""The self-distilled answers' decode loop (hamburger_jax/data/tokens/answers.py) in its
compiled form: what it moves each step besides its work."""

from __future__ import annotations

import numpy as np

from hamburger_jax.benchmarks.answers import time_answers
from hamburger_jax.testing import DECODE_CFG, tiny_decode_model


def test_the_decode_loop_updates_the_cache_in_place():
  """The answers' decode loop copies no cache-sized array a step (the serving engine's step,
  the baseline, copies the whole cache: its last layer's read is not ordered before the write),
  and both answer alike."""
  base = tiny_decode_model().base
  cache = f"[{DECODE_CFG.num_layers},4,24,{DECODE_CFG.num_kv_heads},{DECODE_CFG.head_dim}]"
  copies = {t.step: t for t in time_answers(base, rows=4, prompt_len=8, max_new=16, repeats=1)}
  whole = lambda t: sum(n for shape, n in t.loop_copies.items() if cache in shape)
  assert whole(copies["in_place"]) == 0 and whole(copies["engine"]) > 0
  np.testing.assert_array_equal(copies["in_place"].answer, copies["engine"].answer)
