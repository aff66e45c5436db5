"""Segmentation of responses into groups of 1..K tokens by the base model's confidence
(docs/SPEC.md 2.1).

The original base model reads (prompt + response) teacher-forced; the distribution that predicts
response token j is taken at position j - 1. Per token we keep its entropy (nats) and the
probability the model gives the token itself. A strategy turns one of those statistics into group
sizes that sum to the response length: the SPEC's strategies read entropies; `confident:p` reads
token probabilities (our addition, see its docstring).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hamburger_jax.model.llama import BaseOutput, causal_segment_mask


@dataclasses.dataclass(frozen=True)
class Strategy:
  """A segmentation rule and the per-token statistic it reads ("entropy" or "prob")."""
  fn: Callable[[np.ndarray, int], list[int]]  # (statistic [R], max_group K) -> group sizes
  reads: str = "entropy"  # or "given": each sample's recorded groups are used as they are
  # "given" only: the rule for samples that recorded no groups (the base's own answers mixed
  # into on-policy ones); None: such a sample is an error.
  fallback: Strategy | None = None

  def __call__(self, values, max_group: int) -> list[int]:
    return self.fn(values, max_group)


@dataclasses.dataclass(frozen=True)
class TokenStats:
  entropy: np.ndarray  # [R] nats of the distribution predicting each response token
  prob: np.ndarray  # [R] probability that distribution gives the token itself
  # Teacher signals (TeacherSpec given): the distribution predicting each response token as its
  # top-k (ids by decreasing probability, log-probabilities), and the base's F micro-decoder
  # features (docs/SPEC.md 1.3) at each predicting position (row j predicts response token j).
  topk_ids: np.ndarray | None = None  # [R, k] int32
  topk_logp: np.ndarray | None = None  # [R, k] float32
  features: np.ndarray | None = None  # [R, F, D] float32


@dataclasses.dataclass(frozen=True)
class TeacherSpec:
  """What the distillation recipe stores per sample from the original base's forward."""
  top_k: int
  feature_layers: tuple[int, ...]  # the graft's resolved feature layers (last = normed output)


MIN_THRESHOLD = 0.05  # nats: a token this certain always joins (decreasing_v2)
RATIO_THRESHOLD = 0.3  # a token joins if its entropy < this x the group's max entropy
SMALL_GROUP_CAP = 2


class SegmentationError(ValueError):
  """An unknown strategy or an invalid strategy argument (named)."""


def binary_entropy(p: float) -> float:
  """H(p) in nats."""
  return -(p * math.log(p) + (1 - p) * math.log(1 - p))


SLIDING_THRESHOLD = binary_entropy(0.7)  # ~0.611 nats


def _as_entropies(entropies) -> np.ndarray:
  e = np.asarray(entropies, dtype=np.float64)
  if e.ndim != 1:
    raise SegmentationError(f"entropies must be a 1-D array, got shape {e.shape}")
  return e


def decreasing_v2(entropies, max_group: int, min_threshold: float = MIN_THRESHOLD,
                  ratio_threshold: float = RATIO_THRESHOLD) -> list[int]:
  """The release's strategy.

  The first token always opens group 0. Token j then extends the current group iff the group
  has fewer than `max_group` tokens and (e_j < min_threshold or e_j < ratio_threshold * m),
  where m is the max entropy over the group's current members (the tokens already in it,
  its opening token included, not token j); otherwise j opens a new group. So a group starts
  at an uncertain token and collects the much more certain tokens that follow it.
  """
  e = _as_entropies(entropies)
  sizes: list[int] = []
  count, group_max = 0, 0.0
  for x in e:
    if count and count < max_group and (x < min_threshold or x < ratio_threshold * group_max):
      count += 1
      group_max = max(group_max, x)
    else:
      if count:
        sizes.append(count)
      count, group_max = 1, x
  if count:
    sizes.append(count)
  return sizes


def small_group(entropies, max_group: int) -> list[int]:
  """decreasing_v2 with groups capped at min(2, max_group): merges only the safest pairs."""
  return decreasing_v2(entropies, min(SMALL_GROUP_CAP, max_group))


def sliding(entropies, max_group: int, threshold: float = SLIDING_THRESHOLD) -> list[int]:
  """Token j (after the first) joins the current group iff it has < max_group tokens and
  e_j < threshold (default H(0.7) nats: the model is at least ~70% sure of the token)."""
  e = _as_entropies(entropies)
  sizes: list[int] = []
  for j, x in enumerate(e):
    if j and sizes[-1] < max_group and x < threshold:
      sizes[-1] += 1
    else:
      sizes.append(1)
  return sizes


def confident(probs, max_group: int, threshold: float) -> list[int]:
  """Token j (after the first) joins the current group iff it has < max_group tokens and the
  base model gives token j probability >= threshold.

  Entropy counts the whole tail of the distribution; for self-distilled (greedy) responses what
  the micro-step decoder must reproduce is the base's top token, so its probability is the more
  direct measure of "predictable". With SmolLM2-135M most tokens have entropy > 1 nat even when
  the greedy token has p > 0.6, so the entropy rules give groups of ~1.3 tokens (docs/results/data.md).
  """
  p = _as_entropies(probs)
  if not len(p):
    return []
  first = np.zeros(len(p), bool)
  first[0] = True
  starts = np.flatnonzero(confident_starts(p, np.ones(len(p), bool), first, max_group, threshold))
  return np.diff(np.append(starts, len(p))).tolist()


def confident_starts(probs: np.ndarray, response: np.ndarray, span_start: np.ndarray,
                     max_group: int, threshold: float) -> np.ndarray:
  """`confident` over many responses at once (vectorised: the boundary pass applies it to
  millions of tokens): a response token opens a group iff it opens its response, or the base
  gives it probability < threshold, or the group it would join already has max_group tokens.
  [n] bool (False off responses)."""
  hard = span_start | ~(probs >= threshold)  # as confident: a NaN never joins
  idx = np.arange(len(probs))
  run_start = np.maximum.accumulate(np.where(hard, idx, 0))
  return response & (hard | ((idx - run_start) % max_group == 0))


def fixed(entropies, max_group: int, k: int) -> list[int]:
  """Groups of k tokens, the last one shorter; ignores the entropies."""
  if not 1 <= k <= max_group:
    raise SegmentationError(f"fixed:{k} needs 1 <= k <= max_group={max_group}")
  n = len(_as_entropies(entropies))
  return [k] * (n // k) + ([n % k] if n % k else [])


def _recorded(values, max_group: int) -> list[int]:
  raise SegmentationError("strategy 'given' reads each sample's recorded groups, not a statistic")


# On-policy groups: the ones HAMburger itself emitted (train.self_distill --checkpoint), so that
# training meets the merged entries decoding makes, not the ones a rule on the base would make.
GIVEN = Strategy(_recorded, reads="given")

STRATEGIES = ("decreasing_v2", "fixed:k", "sliding", "small_group", "confident:p", "given",
              "given:STRATEGY")


def get_strategy(name: str) -> Strategy:
  """`name` is one of STRATEGIES; "fixed:k" takes an integer k (e.g. fixed:2), "confident:p" a
  probability in (0, 1] (e.g. confident:0.6); "given" keeps each sample's recorded groups, and
  "given:STRATEGY" segments the samples that recorded none by STRATEGY (given:confident:0.6)."""
  if name == "given":
    return GIVEN
  if name.startswith("given:"):
    fallback = get_strategy(name.removeprefix("given:"))
    if fallback.reads == "given":
      raise SegmentationError(f"strategy {name!r}: the fallback after 'given:' must segment by "
                              "the base's statistics, e.g. given:confident:0.6")
    return dataclasses.replace(GIVEN, fallback=fallback)
  if name in ("decreasing_v2", "sliding", "small_group"):
    return Strategy({"decreasing_v2": decreasing_v2, "sliding": sliding,
                     "small_group": small_group}[name])
  kind, sep, arg = name.partition(":")
  if sep and kind == "fixed":
    try:
      k = int(arg)
    except ValueError:
      k = 0
    if k < 1:
      raise SegmentationError(f"strategy {name!r}: k must be a positive integer, e.g. fixed:2")
    return Strategy(functools.partial(fixed, k=k))
  if sep and kind == "confident":
    try:
      threshold = float(arg)
    except ValueError:
      threshold = 0.0
    if not 0 < threshold <= 1:
      raise SegmentationError(f"strategy {name!r}: p must be a probability in (0, 1], "
                              "e.g. confident:0.6")
    return Strategy(functools.partial(confident, threshold=threshold), reads="prob")
  raise SegmentationError(
      f"unknown segmentation strategy {name!r}; valid strategies are: {', '.join(STRATEGIES)}")


# ----------------------------------------------------------------------------- entropies


def segment_positions(segment_ids_bt: jax.Array) -> jax.Array:
  """Positions restarting at 0 at the start of every segment of a (packed) row. [B, T]"""
  t = segment_ids_bt.shape[1]
  idx = jnp.broadcast_to(jnp.arange(t), segment_ids_bt.shape)
  prev = jnp.pad(segment_ids_bt[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
  starts = jnp.where(segment_ids_bt != prev, idx, 0)
  return idx - jax.lax.cummax(starts, axis=1)


def packed_forward(model: nnx.Module, ids_bt: jax.Array, segment_ids_bt: jax.Array,
                   collect: Sequence[int] = ()) -> BaseOutput:
  """The base's forward over rows that pack several samples (segment ids 1.., 0 = padding):
  positions restart and attention stays within each segment."""
  return model.forward(model.embed(ids_bt), segment_positions(segment_ids_bt),
                       causal_segment_mask(segment_ids_bt), collect=collect)


def pack_pass(rows: Sequence[Sequence[int]], ids_of: Callable[[int], np.ndarray],
              rows_per_pass: int, row_len: int
              ) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int, int]]]:
  """One pass's input: ids and segment ids [rows_per_pass, row_len] int32 where row r holds the
  samples rows[r] one after the other (sample k's ids: ids_of(k); segment j + 1 for the j-th
  of a row, 0 after them), and (k, row, column) of each sample's first token."""
  ids = np.zeros((rows_per_pass, row_len), np.int32)
  seg = np.zeros((rows_per_pass, row_len), np.int32)
  placed = []
  for r, row in enumerate(rows):
    t = 0
    for j, k in enumerate(row, start=1):
      x = ids_of(k)
      ids[r, t:t + len(x)] = x
      seg[r, t:t + len(x)] = j
      placed.append((k, r, t))
      t += len(x)
  return ids, seg, placed


@functools.partial(jax.jit, static_argnames=("teacher",))
def token_stats_program(graphdef: nnx.GraphDef, state: nnx.State, ids_bt: jax.Array,
               segment_ids_bt: jax.Array, teacher: TeacherSpec | None = None) -> tuple:
  """Entropy at every position and the probability given to the token at the next position;
  with `teacher`, also the top-k (ids, log-probs) and the features at every position."""
  model = nnx.merge(graphdef, state)
  layers = teacher.feature_layers if teacher else ()
  out = packed_forward(model, ids_bt, segment_ids_bt, collect=layers[:-1])
  logp = jax.nn.log_softmax(model.logits(out.hidden), axis=-1)  # [B, T, V] fp32
  next_ids = jnp.pad(ids_bt[:, 1:], ((0, 0), (0, 1)))
  p_next = jnp.exp(jnp.take_along_axis(logp, next_ids[..., None], axis=-1)[..., 0])
  entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
  if teacher is None:
    return entropy, p_next
  top_logp, top_ids = jax.lax.top_k(logp, teacher.top_k)
  features = jnp.stack([*out.collected, out.hidden], axis=-2)  # [B, T, F, D]
  return entropy, p_next, top_ids, top_logp, features


def position_entropies(model: nnx.Module, ids_bt, segment_ids_bt) -> np.ndarray:
  """Entropy (nats, fp32) of the next-token distribution at every position. [B, T]

  Rows may pack several samples (segment ids 1.., 0 = padding; positions restart per segment).
  """
  graphdef, state = nnx.split(model)
  return np.asarray(token_stats_program(graphdef, state, jnp.asarray(ids_bt, jnp.int32),
                               jnp.asarray(segment_ids_bt, jnp.int32))[0])


def response_entropies(model: nnx.Module, samples: Sequence[tuple[Sequence[int], Sequence[int]]],
                       **kwargs) -> list[np.ndarray]:
  """Teacher-forced entropies of each sample's response tokens. One array [R] per sample."""
  return [s.entropy for s in response_token_stats(model, samples, **kwargs)]


def pack_rows(lengths: Sequence[int], row_len: int) -> list[list[int]]:
  """Sample indices per row of `row_len` tokens: longest first, first fit."""
  rows: list[list[int]] = []
  free: list[int] = []  # tokens left per row
  for k in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
    r = next((r for r, f in enumerate(free) if f >= lengths[k]), None)
    if r is None:
      rows.append([])
      free.append(row_len)
      r = len(rows) - 1
    rows[r].append(k)
    free[r] -= lengths[k]
  return rows


def packed_token_stats(forward: Callable, samples: Sequence[tuple[Sequence[int], Sequence[int]]],
                       row_len: int, rows_per_pass: int, teacher: TeacherSpec | None,
                       progress: Callable[[int], None] | None = None
                       ) -> Iterator[tuple[int, TokenStats]]:
  """(index in `samples`, its TokenStats) of every (prompt ids, response ids) sample, packed
  by pack_rows into passes of `rows_per_pass` rows; `forward(ids, seg, teacher)` runs one pass
  (token_stats_program's outputs as numpy, on one device or split over a mesh)."""
  seqs = [np.concatenate([np.asarray(p, np.int32), np.asarray(r, np.int32)]) for p, r in samples]
  rows = pack_rows([len(x) for x in seqs], row_len)
  for first in range(0, len(rows), rows_per_pass):
    batch = rows[first:first + rows_per_pass]
    ids, seg, placed = pack_pass(batch, seqs.__getitem__, rows_per_pass, row_len)
    starts = {k: (r, t) for k, r, t in placed}
    arrays = forward(ids, seg, teacher)
    for row in batch:
      for k in row:
        r, t = starts[k]
        p, n = len(samples[k][0]), len(samples[k][1])
        span = slice(t + p - 1, t + p - 1 + n)  # row j predicts response token j
        yield k, TokenStats(*(a[r, span].copy() for a in arrays))
    if progress is not None:
      progress(sum(len(row) for row in batch))


def response_token_stats(model: nnx.Module,
                         samples: Sequence[tuple[Sequence[int], Sequence[int]]], *,
                         batch_tokens: int = 2048, row_len: int | None = None, bucket: int = 64,
                         teacher: TeacherSpec | None = None,
                         progress: Callable[[int], None] | None = None) -> list[TokenStats]:
  """Teacher-forced entropies and token probabilities of each sample's response tokens (and,
  with `teacher`, its teacher signals: see TokenStats).

  `samples` are (prompt ids, response ids). They are packed (longest first, first fit) into rows
  of `row_len` tokens (default: the longest sample rounded up to a multiple of `bucket`), one
  segment per sample, `batch_tokens // row_len` rows per forward pass: every pass has the same
  shape, so one compilation serves all calls with the same row_len, and little is padding.
  `progress(n)` is called after each pass with the number of samples it held.
  """
  if any(len(p) == 0 or len(r) == 0 for p, r in samples):
    raise SegmentationError("every sample needs a non-empty prompt and response")
  if not samples:
    return []
  longest = max(len(p) + len(r) for p, r in samples)
  if row_len is None:
    row_len = -(-longest // bucket) * bucket
  if longest > row_len:
    raise SegmentationError(f"a sample has {longest} tokens but row_len is {row_len}: raise "
                            "row_len or drop longer samples first")
  rows_per_pass = max(1, batch_tokens // row_len)
  graphdef, state = nnx.split(model)
  forward = lambda ids, seg, teacher: [np.asarray(a) for a in token_stats_program(
      graphdef, state, jnp.asarray(ids), jnp.asarray(seg), teacher)]
  out: list[TokenStats | None] = [None] * len(samples)
  for k, stats in packed_token_stats(forward, samples, row_len, rows_per_pass, teacher,
                                     progress):
    out[k] = stats
  return out  # type: ignore[return-value]
