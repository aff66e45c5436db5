"""Rotary position embeddings (HF rotate-half layout), with optional llama3 frequency scaling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from hamburger_jax.config import LlamaConfig


def inverse_frequencies(cfg: LlamaConfig) -> np.ndarray:
  """[head_dim // 2] float32, computed as transformers does so parity holds to the last bit."""
  d = cfg.head_dim
  inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
  inv = inv.astype(np.float32)
  s = cfg.rope_scaling
  if s is None:
    return inv
  low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
  high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
  wavelen = 2 * math.pi / inv
  scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
  smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
      s.high_freq_factor - s.low_freq_factor)
  smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
  medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x_bthd: jax.Array, positions_bt: jax.Array, inv_freq: np.ndarray) -> jax.Array:
  """Rotates q or k [B, T, (heads...), Dh] by per-token positions [B, T] (positions need not be
  contiguous); the heads may span several dimensions (a fused projection's [G, Hkv])."""
  freqs = positions_bt.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, Dh/2]
  heads = (None,) * (x_bthd.ndim - 3)
  cos = jnp.cos(freqs)[:, :, *heads, :]
  sin = jnp.sin(freqs)[:, :, *heads, :]
  x = x_bthd.astype(jnp.float32)
  x1, x2 = jnp.split(x, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_bthd.dtype)
