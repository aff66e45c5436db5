"""Low-rank adapters on the base's projections: a small, trainable change to a frozen base.

The paper trains the whole base so it learns to read merged entries. With a frozen base (the
CPU-sized run) the base cannot: the compositional embedder alone leaves it predicting token 0 of
a step right ~25% of the time after merged inputs (docs/results/training.md). LoRA lets the base
adapt at almost no extra training cost (the backward through the base is needed for the embedder
anyway) and keeps the export small. Adapters are GraftParams, so "train graft only" trains them too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hamburger_jax.model.llama import (FUSED, GraftParam, Linear, matmul, rows_where,
                                       torch_linear_init)


class LoRA(nnx.Module):
  """delta(x) = scale * (x @ a) @ b, with b = 0 at init so the base starts unchanged."""

  def __init__(self, in_features: int, out_features: int, rank: int, alpha: float,
               axes: tuple, *, rngs: nnx.Rngs, param_dtype=jnp.float32, dtype=jnp.float32):
    self.a = GraftParam(torch_linear_init(in_features)(rngs.params(), (in_features, rank),
                                                       param_dtype), logical_axes=(axes[0], None))
    self.b = GraftParam(jnp.zeros((rank, out_features), param_dtype), logical_axes=(None, axes[1]))
    self.scale = alpha / rank
    self.dtype = dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x.astype(self.dtype)
    return self.scale * jnp.dot(jnp.dot(x, self.a[...].astype(self.dtype)),
                                self.b[...].astype(self.dtype))

  def delta(self, dtype=None) -> jax.Array:
    """The dense [in, out] change to the kernel: in the params' dtype, or in `dtype` at full
    precision (what a fold into a decoding kernel takes: an accelerator's default float32
    matmul would round a and b to bfloat16 or TF32 first)."""
    if dtype is None:
      return self.scale * jnp.dot(self.a[...], self.b[...])
    return self.scale * jnp.dot(self.a[...].astype(dtype), self.b[...].astype(dtype),
                                precision=jax.lax.Precision.HIGHEST)

  def folded(self, kernel: jax.Array) -> jax.Array:
    """The kernel with this adapter in it: what a merged entry is multiplied by."""
    return kernel + self.delta().reshape(kernel.shape).astype(kernel.dtype)

  def per_row(self, x: jax.Array, y: jax.Array, merged: jax.Array) -> jax.Array:
    """y (the plain layer's output) plus the low-rank delta where `merged` (training: the
    delta's gradient reaches a and b; the base's kernel is read once)."""
    return rows_where(merged, y + self(x).reshape(y.shape), y)


# How a step of merged and plain entries runs the adapters (FoldedAdapter).
MIXED_FORMS = ("factors", "kernels")


class Folded(nnx.Variable):
  """A kernel with its merged-entry adapter folded in (W + scale * a @ b): derived from a
  trained LoRA for decoding (hamburger_jax/model/decode_layout.py), never trained or saved."""


class FoldedAdapter(nnx.Module):
  """A merged-entry adapter as decoding runs it. Where every live entry is merged, one folded
  kernel: a merged entry costs one matmul like any other (x @ folded), not three. Where merged
  and plain entries share a step (`per_row`), in the form `mixed` (MIXED_FORMS) names:
  "factors", the plain kernel's output plus the low-rank factors' change on the merged rows
  ((x @ a) @ b, scale in b): the base's weights read once (with a second full kernel, a mixed
  base step of 16 rows on 2 CPU cores cost 16% more than a plain one, against 3%); "kernels", the
  folded kernel's output on the merged rows: one matmul fewer a projection, the weights read
  twice (for a GPU, where a small model's step is bound by the kernels it launches).

  a [in, R], b [R, *out]: R = rank x the projections a fused kernel holds (q|k|v: 3, gate|up:
  2), b block-diagonal in them (model/decode_layout.py lays it out like the kernel)."""

  def __init__(self, kernel: jax.Array, axes: tuple, rank: int, mixed: str = "factors"):
    if mixed not in MIXED_FORMS:
      raise ValueError(f"mixed={mixed!r}: use one of {', '.join(MIXED_FORMS)}")
    self.kernel = Folded(kernel, logical_axes=axes)
    self.a = Folded(jnp.zeros((kernel.shape[0], rank), kernel.dtype),
                    logical_axes=(axes[0], None))
    self.b = Folded(jnp.zeros((rank, *kernel.shape[1:]), kernel.dtype),
                    logical_axes=(None, *axes[1:]))
    self.mixed = mixed

  def folded(self, kernel: jax.Array) -> jax.Array:
    del kernel  # stored folded already
    return self.kernel[...]

  def per_row(self, x: jax.Array, y: jax.Array, merged: jax.Array) -> jax.Array:
    """Where `merged`, the adapted layer's output (in the form `mixed`); elsewhere y (the plain
    kernel's). Used where some rows are merged and some not."""
    if self.mixed == "kernels":
      return rows_where(merged, matmul(x, self.kernel[...], y.dtype), y)
    delta = matmul(matmul(x, self.a[...], y.dtype), self.b[...], y.dtype)
    return rows_where(merged, y + delta, y)


def base_linears(base: nnx.Module) -> list[Linear]:
  return [lin for _, lin in _named_linears(base)]


def _named_linears(base: nnx.Module) -> list[tuple[str, Linear]]:
  """(name in its layer, module) of each projection of the base's decoder layers."""
  return [(str(path[-1]), m) for path, m in nnx.iter_graph(base.decoder)
          if isinstance(m, Linear)]


def attach(base: nnx.Module, rank: int, alpha: float, rngs: nnx.Rngs,
           folded: str | None = None) -> None:
  """Adds an adapter to every projection of the base's decoder layers, in place: a LoRA to
  train, or (`folded`: its mixed form, MIXED_FORMS) a FoldedAdapter to be filled from one
  (model/decode_layout.py)."""
  for name, lin in _named_linears(base):
    axes = lin.kernel.get_metadata()["logical_axes"]
    if folded:
      lin.lora = FoldedAdapter(jnp.zeros(lin.kernel.shape, lin.kernel.dtype), axes,
                               rank * len(FUSED.get(name, (name,))), folded)
      continue
    n_in, n_out = lin.kernel.shape
    lin.lora = LoRA(n_in, n_out, rank, alpha, axes, rngs=rngs, param_dtype=lin.kernel.dtype,
                    dtype=lin.dtype)
