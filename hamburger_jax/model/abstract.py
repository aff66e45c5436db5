"""A module as shapes and dtypes only (nnx.eval_shape: nothing initialised or allocated), for
the builds that weights fill afterwards, the layouts decoding copies into, and programs
compiled ahead of time.

Built with rng streams that count on the host: flax's traced counter compares each update's
sharding with the old one's, and a tracer's missing `sharding` raises an error whose message
walks the whole trace so far, once per drawn key. For SmolLM2's HAMburger that was 1.9 s of a
2.2 s build (0.3 s without), paid by every load, decode layout and check.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import numpy as np
from flax import nnx

M = TypeVar("M")


def abstract(build: Callable[[nnx.Rngs], M], seed: int = 0) -> M:
  """`build(rngs)` under nnx.eval_shape, `rngs` being nnx.Rngs(seed) with host counters."""
  def make() -> M:
    rngs = nnx.Rngs(seed)
    for stream in vars(rngs).values():
      if isinstance(stream, nnx.RngStream):
        count = stream.count.get_raw_value()
        stream.count.set_raw_value(np.zeros(np.shape(count), np.uint32))
    return build(rngs)
  return nnx.eval_shape(make)
