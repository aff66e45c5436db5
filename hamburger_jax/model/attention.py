"""Grouped-query softmax attention: the dense kernel every cache layout ends in on CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def attend(q_bthd: jax.Array, k_bskd: jax.Array, v_bskd: jax.Array,
           mask_bts: jax.Array) -> jax.Array:
  """Grouped-query softmax attention in fp32; mask True = may attend. Returns [B, T, H*Dh]."""
  b, t, h, dh = q_bthd.shape
  hkv = k_bskd.shape[2]
  q = q_bthd.reshape(b, t, hkv, h // hkv, dh)
  scores = jnp.einsum("btkgd,bskd->bkgts", q, k_bskd,
                      preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(dh))
  scores = jnp.where(mask_bts[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_bskd.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v_bskd)
  return out.reshape(b, t, h * dh)
