"""Samplers as pure functions (logits, rng, params) -> tokens: greedy, temperature, top-k, top-p.

Settings are per row ([B] arrays), so one compiled program serves a batch whose requests each
sample their own way; a row with temperature 0 is greedy whatever the others do.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp


class SamplingError(ValueError):
  """Invalid sampling parameters; the message says the valid range."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """temperature 0 is greedy. top_k 0 and top_p 1 switch those filters off."""
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    for name in ("temperature", "top_p"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SamplingError(f"{name}={value!r} must be a number")
    if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral):
      raise SamplingError(f"top_k={self.top_k!r} must be an integer (0 disables top-k)")
    if not (self.temperature >= 0 and math.isfinite(self.temperature)):
      raise SamplingError(f"temperature={self.temperature} must be >= 0 and finite "
                          "(0 means greedy)")
    if not 0 < self.top_p <= 1:
      raise SamplingError(f"top_p={self.top_p} must be in (0, 1] (1 disables nucleus sampling)")
    if self.top_k < 0:
      raise SamplingError(f"top_k={self.top_k} must be >= 0 (0 disables top-k)")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0

  def check_vocab(self, vocab_size: int) -> None:
    if self.top_k > vocab_size:
      raise SamplingError(f"top_k={self.top_k} exceeds the vocabulary ({vocab_size} tokens): "
                          f"use at most {vocab_size}, or 0 to disable top-k")


def greedy(logits_bv: jax.Array) -> jax.Array:
  return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)


def filter_top_k(logits_bv: jax.Array, k_b) -> jax.Array:
  """Keeps each row's k highest logits (k per row, 0 keeps all)."""
  b, v = logits_bv.shape
  k_b = jnp.broadcast_to(jnp.asarray(k_b, jnp.int32), (b,))
  descending = -jnp.sort(-logits_bv, axis=-1)
  kth = jnp.take_along_axis(descending, jnp.clip(k_b - 1, 0, v - 1)[:, None], axis=-1)
  return jnp.where((k_b[:, None] > 0) & (logits_bv < kth), -jnp.inf, logits_bv)


def filter_top_p(logits_bv: jax.Array, top_p_b) -> jax.Array:
  """Keeps the smallest set of tokens whose probability mass reaches top_p (always >= 1 token)."""
  top_p = jnp.broadcast_to(jnp.asarray(top_p_b, jnp.float32), logits_bv.shape[:1])[:, None]
  sorted_logits = -jnp.sort(-logits_bv, axis=-1)
  probs = jax.nn.softmax(sorted_logits, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  keep = mass_before < top_p
  cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(logits_bv < cutoff, -jnp.inf, logits_bv)


def sampling_logits(logits_bv: jax.Array, temperature_b: jax.Array, top_k_b: jax.Array,
                    top_p_b: jax.Array) -> jax.Array:
  """The logits a sampling row draws from: scaled by its temperature, then its top-k and top-p
  filters (-inf outside); their softmax is the row's sampling distribution."""
  logits = logits_bv.astype(jnp.float32) / jnp.maximum(temperature_b, 1e-6)[:, None]
  return filter_top_p(filter_top_k(logits, top_k_b), top_p_b)


def sample_rows(logits_bv: jax.Array, keys_b: jax.Array, temperature_b: jax.Array,
                top_k_b: jax.Array, top_p_b: jax.Array, *, stochastic: bool,
                veto_b: jax.Array | None = None) -> jax.Array:
  """One token per row, each row with its own key and settings. `stochastic` False compiles
  the greedy-only program (no sort, no draw) for batches where every row is greedy. `veto_b`
  [B] (-1: none): a sampling row draws from its distribution with that token removed and the
  rest renormalised (speculative sampling's residual after a rejected draft); a greedy row's
  argmax never is a vetoed token (a draft is rejected only where it is not the argmax)."""
  best = greedy(logits_bv)
  if not stochastic:
    return best
  logits = sampling_logits(logits_bv, temperature_b, top_k_b, top_p_b)
  if veto_b is not None:
    logits = jnp.where(jnp.arange(logits.shape[-1])[None, :] == veto_b[:, None], -jnp.inf,
                       logits)
  drawn = jax.vmap(jax.random.categorical)(keys_b, logits).astype(jnp.int32)
  return jnp.where(temperature_b > 0, drawn, best)


def sample(logits_bv: jax.Array, rng: jax.Array, params: SamplingParams) -> jax.Array:
  """One token per row, every row with the same settings (row r draws with fold_in(rng, r))."""
  b = logits_bv.shape[0]
  full = lambda x, dt: jnp.full((b,), x, dt)
  keys = jax.vmap(lambda r: jax.random.fold_in(rng, r))(jnp.arange(b))
  return sample_rows(logits_bv, keys, full(params.temperature, jnp.float32),
                     full(params.top_k, jnp.int32), full(params.top_p, jnp.float32),
                     stochastic=not params.greedy)
