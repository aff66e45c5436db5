"""The precision policy, per backend, in one place: the dtype and the weight layout decoding
runs in, and the precision of float32 matmuls.

Decoding (Engine; model/decode_layout.py):
  cpu      float32 weights and compute, fused projections, a base step's forward in a branch
           of its own (DECODE_PLAIN_BRANCH);
  gpu/tpu  bfloat16 weights and compute (norms, softmax, logits and the argmax over them stay
           float32 in the model code), fused projections, the forward inline.
A step of merged and plain entries runs the adapters as low-rank factors beside the plain
kernels ("factors": the weights read once), but on a GPU as a second, folded kernel ("kernels":
one matmul fewer a projection, where a small model's step is bound by kernel launches: SmolLM2's
mixed step lowers 301 dots against 421; model/lora.py, FoldedAdapter).
float32 matmuls (`precision`: Engine(matmul_precision=...), train.precision, the benches'
--precision): "highest" computes them in full float32 on every backend (a TPU otherwise runs
them as bfloat16 passes, a GPU as TF32); "default" leaves the backend's own choice (faster on
an accelerator). A bfloat16 model is the same under both. Tests of exact greedy equality pin
float32 decoding and "highest" (`pin`), so that they hold on any backend; `unpin` and
`backend_policy` give each backend its own policy back.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import jax

from hamburger_jax.config import PRECISIONS
from hamburger_jax.model.decode_layout import DTYPES

DEFAULT_PRECISION = "default"
DECODE_DTYPES = {"cpu": "float32", "gpu": "bfloat16", "tpu": "bfloat16"}
DECODE_MIXED = {"gpu": "kernels"}  # else "factors"
# Where the plain base forward of a decode step runs as a branch of its own (skipped when
# every row is done): XLA's CPU backend then reads the gathered KV view as laid out, not
# transposed into each layer (SmolLM2, 16 rows on 2 CPU cores: a base step ~4% faster). A GPU
# pays a host round trip for a branch's predicate, so the forward stays inline there.
DECODE_PLAIN_BRANCH = {"cpu": True}  # else False
# The widths a verify step's forward is compiled in (decode/step.py: VERIFY_WIDTHS): two (1 and
# K) unless the forward's cost grows with its width enough to pay for K compiled copies. XLA's
# CPU backend runs a K-token forward at 1.1-1.65x a one-token one (docs/results/decode_speed.md):
# there each width pays (SmolLM2, 2 cores, held-out prompts, draft confidence 0.5: batch 1
# 1.13x the base against 0.95x, 16 rows 0.64x against 0.58x). A GPU or TPU reads the weights
# once for any width, and fewer, wider kernels win there.
DECODE_VERIFY_WIDTHS = {"cpu": "each"}  # else "two"
_pinned: dict[str, str | None] = {"decode_dtype": None}


def decode_defaults(platform: str) -> dict:
  """{"dtype", "fused", "mixed", "plain_branch", "verify_widths"}: how an engine on `platform`
  (a jax device's `platform`: "cpu", "gpu", "tpu") decodes unless told otherwise (or `pin`
  fixed the dtype for every backend); float32 on a platform the table does not name."""
  dtype = _pinned["decode_dtype"] or DECODE_DTYPES.get(platform, "float32")
  return {"dtype": dtype, "fused": True, "mixed": DECODE_MIXED.get(platform, "factors"),
          "plain_branch": DECODE_PLAIN_BRANCH.get(platform, False),
          "verify_widths": DECODE_VERIFY_WIDTHS.get(platform, "two")}


def pin(decode_dtype: str = "float32", matmuls: str = "highest") -> None:
  """One policy on every backend, for this process: engines decode in `decode_dtype` and
  float32 matmuls run at `matmuls` (jax's default matmul precision). What exact comparisons of
  greedy tokens need to hold on a GPU or TPU as on the CPU (tests/conftest.py pins it)."""
  if decode_dtype not in DTYPES:
    raise ValueError(f"decode_dtype={decode_dtype!r}: use one of {', '.join(DTYPES)}")
  _pinned["decode_dtype"] = decode_dtype
  jax.config.update("jax_default_matmul_precision", None if check(matmuls) == "default"
                    else matmuls)


def unpin() -> None:
  """Each backend's own policy again: DECODE_DTYPES, and float32 matmuls as the backend runs
  them (what a process that never pinned has)."""
  _pinned["decode_dtype"] = None
  jax.config.update("jax_default_matmul_precision", None)


@contextlib.contextmanager
def backend_policy() -> Iterator[None]:
  """Each backend's own policy in the block (`unpin`), whatever was pinned before; the earlier
  pin comes back after it. For tests of the policy itself in a pinned test run."""
  saved = (_pinned["decode_dtype"], jax.config.jax_default_matmul_precision)
  unpin()
  try:
    yield
  finally:
    _pinned["decode_dtype"] = saved[0]
    jax.config.update("jax_default_matmul_precision", saved[1])


def check(setting: str) -> str:
  if setting not in PRECISIONS:
    raise ValueError(f"precision={setting!r}: use one of {', '.join(PRECISIONS)}")
  return setting


@contextlib.contextmanager
def matmuls(setting: str) -> Iterator[None]:
  """Programs traced in the block compute float32 matmuls at `setting` (PRECISIONS)."""
  if check(setting) == "default":
    yield
    return
  with jax.default_matmul_precision(setting):
    yield
