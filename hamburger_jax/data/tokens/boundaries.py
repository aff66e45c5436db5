"""Group boundaries at accelerator speed: one forward-only, batched, jitted pass of the base over
token-id samples gives the probability it assigns each response token, and the segmentation
rule `confident:p` (hamburger_jax.segmentation.confident_starts) turns those into the
tokens that open a group. Nothing else is kept: the teacher's signals are computed again inside
the train step (hamburger_jax.objectives.online_teacher), so the pass writes one byte per token.

Rows pack whole samples (segments, positions restarting in each), longest with shortest, so a
pass over a corpus compiles one program.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hamburger_jax.segmentation import confident_starts, pack_pass, packed_forward


@functools.partial(jax.jit, static_argnames=("chunk_rows",))
def token_probs_program(graphdef: nnx.GraphDef, state: nnx.State, ids_bt: jax.Array,
                        segment_ids_bt: jax.Array, chunk_rows: int = 8) -> jax.Array:
  """The probability the base gives each token from the position before it [B, T] float32
  (position 0 of a segment: 1, it is never a response token). The logits are made
  `chunk_rows` rows at a time: [B, T, V] is never in memory at once."""
  model = nnx.merge(graphdef, state)
  out = packed_forward(model, ids_bt, segment_ids_bt)
  b, t, d = out.hidden.shape
  nxt = jnp.pad(ids_bt[:, 1:], ((0, 0), (0, 1)))

  def one(xs):
    h, ids = xs
    logits = model.logits(h)  # [c, T, V] float32
    gold = jnp.take_along_axis(logits, ids[..., None], axis=-1)[..., 0]
    return jnp.exp(gold - jax.nn.logsumexp(logits, axis=-1))

  c = max(1, min(chunk_rows, b))
  pad = -b % c
  h = jnp.pad(out.hidden, ((0, pad), (0, 0), (0, 0))).reshape(-1, c, t, d)
  ids = jnp.pad(nxt, ((0, pad), (0, 0))).reshape(-1, c, t)
  p_next = jax.lax.map(one, (h, ids)).reshape(-1, t)[:b]
  # Token j's probability is read at j - 1; a segment's first token has none.
  p = jnp.pad(p_next[:, :-1], ((0, 0), (1, 0)), constant_values=1.0)
  first = segment_ids_bt != jnp.pad(segment_ids_bt[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
  return jnp.where(first, 1.0, p)


@dataclasses.dataclass
class BoundaryStats:
  tokens: int = 0
  timed_tokens: int = 0  # those of the passes after the first
  response_tokens: int = 0
  groups: int = 0
  seconds: float = 0.0  # the passes, compilation excluded (the first pass is timed apart)
  compile_seconds: float = 0.0
  passes: int = 0

  @property
  def tokens_per_s(self) -> float:
    return self.timed_tokens / max(self.seconds, 1e-9)

  @property
  def mean_group(self) -> float:
    return self.response_tokens / max(self.groups, 1)


def pair_rows(lengths: np.ndarray, row_len: int) -> list[list[int]]:
  """Sample indices per row of `row_len` tokens: the longest left with the shortest that still
  fit (linear time: a corpus has ~10^5 samples)."""
  order = np.argsort(-lengths, kind="stable")
  rows: list[list[int]] = []
  i, j = 0, len(order) - 1
  while i <= j:
    row, free = [int(order[i])], row_len - int(lengths[order[i]])
    i += 1
    while i <= j and lengths[order[j]] <= free:
      row.append(int(order[j]))
      free -= int(lengths[order[j]])
      j -= 1
    rows.append(row)
  return rows


def boundary_pass(model: nnx.Module, tokens: np.ndarray, samples: np.ndarray,
                  responses: np.ndarray, sample_ids: Sequence[int], *, row_len: int,
                  rows_per_pass: int, max_group: int, threshold: float,
                  out: np.ndarray | None = None,
                  progress: Callable[[BoundaryStats], None] | None = None
                  ) -> tuple[np.ndarray, BoundaryStats]:
  """Group starts of the given samples' responses (a TokenCorpus's tokens, samples [S, 2] and
  responses [T, 3] arrays): `out` [len(tokens)] uint8 (made if None) gets 1 where a group opens,
  for those samples' tokens only. `model` is the base (a Llama), run as it is (its dtype)."""
  out = np.zeros(len(tokens), np.uint8) if out is None else out
  graphdef, state = nnx.split(model)
  sample_ids = np.asarray(sample_ids, np.int64)
  lengths = samples[sample_ids, 1]
  if lengths.max(initial=0) > row_len:
    raise ValueError(f"a sample has {int(lengths.max())} tokens, more than row_len={row_len}")
  rows = pair_rows(lengths, row_len)
  # (start, end) in the corpus of each given sample
  spans = [(int(a), int(a) + int(n)) for a, n in samples[sample_ids]]
  stats = BoundaryStats()
  # Response masks over the corpus, for the samples' tokens.
  resp = np.zeros(len(tokens), bool)
  span_start = np.zeros(len(tokens), bool)
  chosen = np.zeros(len(samples), bool)
  chosen[sample_ids] = True
  for _, a, b in responses[chosen[responses[:, 0]]]:
    resp[a:b] = True
    span_start[a] = True
  def finish(probs, where) -> None:
    for r, col, start, n in where:
      sl = slice(start, start + n)
      out[sl] = confident_starts(probs[r, col:col + n], resp[sl], span_start[sl], max_group,
                                 threshold)
      stats.tokens += n
      stats.response_tokens += int(resp[sl].sum())
      stats.groups += int(out[sl].sum())

  pending = None  # the pass in flight: the next one is laid out while it runs
  t0 = time.perf_counter()
  for first in range(0, len(rows) + rows_per_pass, rows_per_pass):
    batch = rows[first:first + rows_per_pass]
    launched = None
    if batch:
      ids, seg, placed = pack_pass(batch, lambda s: tokens[slice(*spans[s])], rows_per_pass,
                                   row_len)
      where = [(r, col, spans[s][0], spans[s][1] - spans[s][0]) for s, r, col in placed]
      launched = (token_probs_program(graphdef, state, jnp.asarray(ids), jnp.asarray(seg)),
                  where)
    if pending is not None:
      probs = np.asarray(pending[0])
      now = time.perf_counter()
      if stats.passes == 0:  # the first pass compiled the program: timed apart
        stats.compile_seconds = now - t0
      else:
        stats.seconds += now - t0
        stats.timed_tokens += sum(w[3] for w in pending[1])
      t0 = now
      finish(probs, pending[1])
      stats.passes += 1
      if progress is not None:
        progress(stats)
    pending = launched
    if pending is None:
      break
  return out, stats
