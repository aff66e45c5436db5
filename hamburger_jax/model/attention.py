"""Grouped-query softmax attention: the dense kernel every cache layout ends in on CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def attend(q_bthd: jax.Array, k_bskd: jax.Array, v_bskd: jax.Array,
           mask_bts: jax.Array) -> jax.Array:
  """Grouped-query softmax attention in fp32; mask True = may attend. Returns [B, T, H*Dh]
  (head h = kv * G + g). q is [B, T, H, Dh], or [B, T, G, Hkv, Dh] (a fused q|k|v kernel's
  layout, taken as it is: no transpose)."""
  b, t = q_bthd.shape[:2]
  dh = q_bthd.shape[-1]
  hkv = k_bskd.shape[2]
  if q_bthd.ndim == 5:
    spec = "btgkd,bskd->bkgts"
    q = q_bthd
  else:
    spec = "btkgd,bskd->bkgts"
    q = q_bthd.reshape(b, t, hkv, -1, dh)
  scores = jnp.einsum(spec, q, k_bskd,
                      preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(dh))
  scores = jnp.where(mask_bts[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_bskd.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v_bskd)
  return out.reshape(b, t, -1)


def attend_with_new(q_bthd: jax.Array, k_bskd: jax.Array, v_bskd: jax.Array, k_new: jax.Array,
                    v_new: jax.Array, slots_bt: jax.Array) -> jax.Array:
  """Attention over S cached entries (a row's view: slot s at index s) and T new ones: a new
  input sees the cached slots before the first new one and the new inputs up to itself. The
  new keys and values are rounded to the cache's dtype first, as a later read would see them.
  [B, T, H*Dh]."""
  t = q_bthd.shape[1]
  b, s = k_bskd.shape[:2]
  dt = k_bskd.dtype
  k = jnp.concatenate([k_bskd, k_new.astype(dt)], axis=1).astype(q_bthd.dtype)
  v = jnp.concatenate([v_bskd, v_new.astype(dt)], axis=1).astype(q_bthd.dtype)
  old = jnp.broadcast_to(jnp.arange(s)[None, None, :] < slots_bt[:, :1, None], (b, t, s))
  new = jnp.broadcast_to(jnp.tri(t, dtype=bool)[None], (b, t, t))
  return attend(q_bthd, k, v, jnp.concatenate([old, new], axis=-1))

