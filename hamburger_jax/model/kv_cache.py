"""The KV cache as an explicit pytree, passed into the model and returned (never module state)."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from hamburger_jax.model.attention import attend


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

  def write(self, layer: int, slots_bt: jax.Array, k_bthd: jax.Array,
            v_bthd: jax.Array) -> "KVCache":
    """Writes T new entries per row at per-row slots [B, T]; rows advance independently."""
    rows = jnp.arange(k_bthd.shape[0])[:, None]
    dt = self.k.dtype
    # A scatter on the loop-carried buffer is done in place by XLA (no copy of the cache).
    return self.replace(k=self.k.at[layer, rows, slots_bt].set(k_bthd.astype(dt), mode="drop"),
                        v=self.v.at[layer, rows, slots_bt].set(v_bthd.astype(dt), mode="drop"))

  def mask(self, query_slots_bt: jax.Array) -> jax.Array:
    """[B, T, S] attention mask: a query sees every slot up to and including its own."""
    return jnp.arange(self.slots)[None, None, :] <= query_slots_bt[:, :, None]

  def attend(self, layer: int, q_bthd: jax.Array, mask_bts: jax.Array) -> jax.Array:
    """The queries' attention over this layer's entries, [B, T, H*Dh]."""
    return attend(q_bthd, self.k[layer].astype(q_bthd.dtype), self.v[layer].astype(q_bthd.dtype),
                  mask_bts)
