"""The KV cache as an explicit pytree, passed into the model and returned (never module state)."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from hamburger_jax.model.attention import attend_with_new


@flax.struct.dataclass
class KVCache:
  k: jax.Array  # [L, B, S, Hkv, Dh]
  v: jax.Array  # [L, B, S, Hkv, Dh]
  length: jax.Array  # [B] int32: slots written so far (slot != RoPE position in HAMburger)

  @classmethod
  def init(cls, num_layers: int, batch: int, slots: int, num_kv_heads: int, head_dim: int,
           dtype=jnp.float32) -> "KVCache":
    shape = (num_layers, batch, slots, num_kv_heads, head_dim)
    return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
               length=jnp.zeros((batch,), jnp.int32))

  @property
  def slots(self) -> int:
    return self.k.shape[2]

  def write_layers(self, slots_bt: jax.Array, k_lbthd: jax.Array,
                   v_lbthd: jax.Array, start: int = 0) -> "KVCache":
    """Writes T new entries per row at per-row slots [B, T] (rows advance independently), in
    every layer, or in layers start.. (as many as k has: a merge at layer L writes its lower
    and upper layers at different slots); slots past the end are dropped."""
    rows = jnp.arange(k_lbthd.shape[1])[:, None]
    dt = self.k.dtype
    layers = slice(start, start + k_lbthd.shape[0])
    # A scatter on the loop-carried buffer is done in place by XLA (no copy of the cache).
    return self.replace(
        k=self.k.at[layers, rows, slots_bt].set(k_lbthd.astype(dt), mode="drop"),
        v=self.v.at[layers, rows, slots_bt].set(v_lbthd.astype(dt), mode="drop"))

  def layers(self, start: int, stop: int) -> "KVCache":
    """The cache of layers start..stop-1 alone (what a span of the stack reads)."""
    return self.replace(k=self.k[start:stop], v=self.v[start:stop])

  def view(self) -> "KVCache":
    """What a forward reads (a dense cache is its own)."""
    return self

  def attend_new(self, layer: int, q_bthd: jax.Array, k_bthd: jax.Array, v_bthd: jax.Array,
                 slots_bt: jax.Array) -> jax.Array:
    """Attention of T new inputs at slots [B, T] (consecutive) over this layer's entries before
    them and, causally, over the new inputs' own keys and values: [B, T, H*Dh]."""
    return attend_with_new(q_bthd, self.k[layer], self.v[layer], k_bthd, v_bthd, slots_bt)

