"""Samplers as pure functions (logits, rng, params) -> tokens: greedy, temperature, top-k, top-p."""

from __future__ import annotations

import dataclasses

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
    if not self.temperature >= 0:
      raise SamplingError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
    if not 0 < self.top_p <= 1:
      raise SamplingError(f"top_p={self.top_p} must be in (0, 1] (1 disables nucleus sampling)")
    if self.top_k < 0:
      raise SamplingError(f"top_k={self.top_k} must be >= 0 (0 disables top-k)")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0

  def static_key(self) -> tuple:
    """What changes the compiled program; temperature and top_p values are traced."""
    return (self.greedy, self.top_k, self.top_p < 1.0)

  def dynamic(self) -> dict[str, jax.Array]:
    return {"temperature": jnp.float32(max(self.temperature, 1e-6)),
            "top_p": jnp.float32(self.top_p)}


def greedy(logits_bv: jax.Array) -> jax.Array:
  return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)


def filter_top_k(logits_bv: jax.Array, k: int) -> jax.Array:
  kth = jax.lax.top_k(logits_bv, k)[0][:, -1:]
  return jnp.where(logits_bv < kth, -jnp.inf, logits_bv)


def filter_top_p(logits_bv: jax.Array, top_p: jax.Array) -> jax.Array:
  """Keeps the smallest set of tokens whose probability mass reaches top_p (always >= 1 token)."""
  sorted_logits = jnp.sort(logits_bv, axis=-1)[:, ::-1]
  probs = jax.nn.softmax(sorted_logits, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  keep = mass_before < top_p
  cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(logits_bv < cutoff, -jnp.inf, logits_bv)


def sample(logits_bv: jax.Array, rng: jax.Array, params: SamplingParams,
           dynamic: dict[str, jax.Array] | None = None) -> jax.Array:
  """One token per row. `dynamic` carries traced temperature/top_p (defaults from params)."""
  if params.greedy:
    return greedy(logits_bv)
  dynamic = dynamic or params.dynamic()
  logits = logits_bv.astype(jnp.float32) / dynamic["temperature"]
  if params.top_k:
    logits = filter_top_k(logits, params.top_k)
  if params.top_p < 1.0:
    logits = filter_top_p(logits, dynamic["top_p"])
  return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)
