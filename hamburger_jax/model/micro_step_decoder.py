"""Micro-step decoder (docs/SPEC.md 1.4): fresh base-config layers that emit tokens 1..K-1 of a
step."""

from __future__ import annotations

import jax
from flax import nnx

from hamburger_jax.config import GraftConfig, LlamaConfig
from hamburger_jax.model.kv_cache import KVCache
from hamburger_jax.model.llama import (DecoderStack, GraftParam, Linear, dtype_of,
                                       torch_linear_init)


class StopHead(nnx.Module):
  """Linear -> SiLU -> Linear -> SiLU -> Linear(D, 1): logit of "this token ends the group"."""

  def __init__(self, d: int, *, rngs: nnx.Rngs, param_dtype, dtype):
    kw = dict(rngs=rngs, use_bias=True, param_type=GraftParam, param_dtype=param_dtype,
              dtype=dtype, init=torch_linear_init(d))
    self.fc1 = Linear(d, d, ("embed", "mlp"), **kw)
    self.fc2 = Linear(d, d, ("mlp", "embed"), **kw)
    self.out = Linear(d, 1, ("embed", None), **kw)

  def __call__(self, h: jax.Array) -> jax.Array:
    return self.out(jax.nn.silu(self.fc2(jax.nn.silu(self.fc1(h)))))[..., 0].astype("float32")


class MicroStepDecoder(nnx.Module):
  """Reads [features..., e(t0), ..., e(t_{K-2})] causally at positions 0..F+K-2; no final norm."""

  def __init__(self, base: LlamaConfig, graft: GraftConfig, *, rngs: nnx.Rngs,
               layers: int | None = None):
    """`layers`: its depth (default graft.micro_layers; a drafter's: graft.drafter_layers)."""
    self.decoder = DecoderStack(base, layers or graft.micro_layers, rngs=rngs,
                                param_type=GraftParam, init=torch_linear_init)
    self.stop_head = StopHead(base.hidden_size, rngs=rngs,
                              param_dtype=dtype_of(base.param_dtype), dtype=dtype_of(base.dtype))

  def __call__(self, x_btd: jax.Array, positions_bt: jax.Array, mask_bts: jax.Array | None,
               cache: KVCache | None = None,
               slots_bt: jax.Array | None = None) -> tuple[jax.Array, KVCache | None]:
    """Hidden states [B, T, D]; with a cache, the cache with the inputs' entries written."""
    h, _, kv = self.decoder(x_btd, positions_bt, mask_bts, cache, slots_bt)
    if cache is None:
      return h, None
    return h, cache.write_layers(slots_bt, *kv)
