"""Verify mode's lookup drafts (prompt lookup decoding, Saxena 2023; LLMA, Yang et al. 2023):
where a row's last few tokens occurred before in its prompt or its answer, the tokens that
followed them there are its drafts. They cost no model pass, so a step that finds one drafts
for free; the base's check keeps verify exact whatever the drafts are (they are a function of
the row's tokens alone, which is all the acceptance rule asks of a drafter).

The search runs over a window of each row's last LOOKUP_WINDOW tokens (DecodeState.context),
so its cost does not grow with the row's length and its shape is static."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hamburger_jax.config import LOOKUP_MAX_N

# Tokens of each row the search reads: a chat prompt and the start of its answer (the set's
# prompts run to ~300 tokens).
LOOKUP_WINDOW = 256
# -1: no token (a window's slots before the row's first token).
NO_TOKEN = -1


def context_of(ids: Sequence[int]) -> np.ndarray:
  """The window of a row whose tokens so far are `ids` (the prompt at admission): its last
  LOOKUP_WINDOW, NO_TOKEN-padded on the left [LOOKUP_WINDOW]."""
  out = np.full((LOOKUP_WINDOW,), NO_TOKEN, np.int32)
  tail = np.asarray(ids[-LOOKUP_WINDOW:], np.int32)
  if len(tail):
    out[LOOKUP_WINDOW - len(tail):] = tail
  return out


def shift_in(context: jax.Array, tokens: jax.Array, count: jax.Array) -> jax.Array:
  """Each row's window [B, W] after its first `count` [B] of `tokens` [B, K] are appended."""
  w = context.shape[1]
  both = jnp.concatenate([context, tokens.astype(context.dtype)], axis=1)
  return jnp.take_along_axis(both, count[:, None] + jnp.arange(w)[None, :], axis=1)


def lookup_drafts(context: jax.Array, n_drafts: int, min_n: int) -> tuple[jax.Array, jax.Array]:
  """Each row's drafts [B, n_drafts] and how many it has [B] (0: no match): the tokens after
  the latest earlier occurrence of the row's last n tokens in its window [B, W] that has
  n_drafts tokens after it (else the latest, with as many as follow it: in a run of one token
  the latest occurrence is the one before the last), for the longest n in [min_n,
  LOOKUP_MAX_N] that occurs."""
  b, w = context.shape
  valid = context != NO_TOKEN
  start = jnp.full((b,), -1, jnp.int32)  # index of the first draft in the window
  for n in range(min_n, min(LOOKUP_MAX_N, w - 1) + 1):  # a longer match overrides
    # at[:, s]: the window's tokens s..s+n-1 equal its last n, for s in [0, w - n - 1] (the
    # last n themselves, at s = w - n, excluded)
    at = jnp.ones((b, w - n), bool)
    for i in range(n):
      at &= (context[:, i:i + w - n] == context[:, w - n + i][:, None]) & valid[:, i:i + w - n]
    s = jnp.arange(w - n)
    rank = jnp.where(at, s + w * (s + n + n_drafts <= w), -1)
    start = jnp.where(jnp.any(at, axis=1), jnp.argmax(rank, axis=1) + n, start)
  idx = start[:, None] + jnp.arange(n_drafts)[None, :]
  drafts = jnp.take_along_axis(context, jnp.clip(idx, 0, w - 1), axis=1)
  count = jnp.where(start >= 0, jnp.minimum(w - start, n_drafts), 0)
  return jnp.where(idx < w, drafts, 0), count.astype(jnp.int32)
