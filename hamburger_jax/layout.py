"""Token smashing layout of one sample (docs/SPEC.md 1.2, 2.2): base-input entries and predicted
groups.

A sample is (prompt ids [P], response ids [R], group sizes summing to R). The base model sees P
unmerged prompt entries, then one merged entry per response group, at the RoPE position of the
group's last token. The last prompt entry predicts group 0; the entry of group g predicts g + 1.
Plain NumPy (used by the data pipeline's packing, tests and reference implementations), except
`stop_targets`, which the losses also call on jax arrays.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np


class LayoutError(ValueError):
  """A sample's groups do not describe its response."""


@dataclasses.dataclass(frozen=True)
class SampleLayout:
  input_ids: np.ndarray  # [M, K] token ids of each base-input entry (prompt entries: one id)
  input_size: np.ndarray  # [M] tokens in each entry (1 for prompt tokens)
  positions: np.ndarray  # [M] RoPE position of each entry
  pred_index: np.ndarray  # [G] entry whose base output predicts group g
  target_ids: np.ndarray  # [G, K] tokens of group g
  target_size: np.ndarray  # [G]
  # The K response tokens from group g's first one on (past the group's end too, so that a
  # micro step's agreement with the teacher is defined after the group's last token).
  window_ids: np.ndarray  # [G, K]
  window_size: np.ndarray  # [G] min(K, tokens left in the response)
  # Teacher signals (distillation recipe), aligned to the windows; None without them.
  teacher_topk_ids: np.ndarray | None = None  # [G, K, k]
  teacher_topk_logp: np.ndarray | None = None  # [G, K, k]
  teacher_features: np.ndarray | None = None  # [G, F, D] the base's features predicting g

  @property
  def num_entries(self) -> int:
    return len(self.input_size)

  @property
  def num_groups(self) -> int:
    return len(self.target_size)


def check_groups(groups, response_len: int, max_group: int) -> np.ndarray:
  groups = np.asarray(groups, dtype=np.int64)
  if groups.ndim != 1 or len(groups) == 0:
    raise LayoutError("groups must be a non-empty list of group sizes")
  if groups.min() < 1 or groups.max() > max_group:
    raise LayoutError(f"group sizes must be in [1, {max_group}], got {groups.tolist()}")
  if int(groups.sum()) != response_len:
    raise LayoutError(
        f"group sizes sum to {int(groups.sum())} but the response has {response_len} tokens")
  return groups


def merged_positions(prompt_len: int, groups, position_offset: int = 0) -> np.ndarray:
  """Prompt positions 0..P-1, then the position of each group's last token (docs/SPEC.md 1.2)."""
  groups = np.asarray(groups, dtype=np.int64)
  return np.concatenate([np.arange(prompt_len),
                         prompt_len - 1 + np.cumsum(groups) + position_offset]).astype(np.int32)


def layout_sample(prompt_ids, response_ids, groups, max_group: int,
                  position_offset: int = 0,
                  teacher: dict[str, np.ndarray] | None = None) -> SampleLayout:
  """`teacher`: per-response-token topk_ids / topk_logp [R, k] and per-group features [G, F, D]
  (as the data preparation stores them)."""
  prompt_ids = np.asarray(prompt_ids, dtype=np.int32)
  response_ids = np.asarray(response_ids, dtype=np.int32)
  p = len(prompt_ids)
  if p == 0:
    raise LayoutError("the prompt is empty: a group needs a prompt token to predict it")
  groups = check_groups(groups, len(response_ids), max_group)
  n = len(groups)
  starts = np.concatenate([[0], np.cumsum(groups)[:-1]])
  target_ids = np.zeros((n, max_group), np.int32)
  for g, (s, size) in enumerate(zip(starts, groups)):
    target_ids[g, :size] = response_ids[s:s + size]
  input_ids = np.zeros((p + n, max_group), np.int32)
  input_ids[:p, 0] = prompt_ids
  input_ids[p:] = target_ids
  input_size = np.concatenate([np.ones(p, np.int32), groups.astype(np.int32)])
  pred_index = np.concatenate([[p - 1], p + np.arange(n - 1)]).astype(np.int32)
  r = len(response_ids)
  window = starts[:, None] + np.arange(max_group)[None, :]  # [G, K] response indices
  inside = window < r
  window_ids = np.where(inside, response_ids[np.minimum(window, r - 1)], 0).astype(np.int32)
  window_size = np.minimum(max_group, r - starts).astype(np.int32)
  extra = {}
  if teacher is not None:
    ids, logp, feats = (np.asarray(teacher[k]) for k in ("topk_ids", "topk_logp", "features"))
    if len(ids) != r or len(logp) != r or len(feats) != n:
      raise LayoutError(f"teacher signals cover {len(ids)} tokens and {len(feats)} groups but "
                        f"the sample has {r} response tokens in {n} groups")
    rows = np.minimum(window, r - 1)
    extra = dict(teacher_topk_ids=np.where(inside[..., None], ids[rows], 0).astype(np.int32),
                 teacher_topk_logp=np.where(inside[..., None], logp[rows], 0).astype(np.float32),
                 teacher_features=feats.astype(np.float32))
  return SampleLayout(input_ids, input_size, merged_positions(p, groups, position_offset),
                      pred_index, target_ids, groups.astype(np.int32), window_ids, window_size,
                      **extra)


def stop_targets(group_sizes, max_group: int) -> tuple[Any, Any]:
  """Per micro step: stop target (1.0 at each group's last token, float32) and validity (bool),
  both [..., K] for group sizes [...] (0 = a padding group: nothing valid). NumPy in, NumPy out;
  a jax array (traced too) in, jax arrays out: the paper loss and the distill recipe's
  `segments` target use this one definition inside jit."""
  xp = jnp if isinstance(group_sizes, jax.Array) else np
  sizes = xp.asarray(group_sizes)[..., None]
  step = xp.arange(max_group)
  return (step == sizes - 1).astype(xp.float32), step < sizes


@dataclasses.dataclass
class PackedBatch:
  """Static-shape training batch: several samples per row (NumPy or jax arrays)."""
  input_ids: np.ndarray  # [B, M, K]
  input_size: np.ndarray  # [B, M] 0 = padding entry
  positions: np.ndarray  # [B, M]
  segment_ids: np.ndarray  # [B, M] 1.. per sample in the row, 0 = padding
  pred_index: np.ndarray  # [B, G] index into M
  target_ids: np.ndarray  # [B, G, K]
  target_size: np.ndarray  # [B, G] 0 = padding group
  window_ids: np.ndarray  # [B, G, K]
  window_size: np.ndarray  # [B, G] 0 = padding group
  teacher_topk_ids: np.ndarray | None = None  # [B, G, K, k]
  teacher_topk_logp: np.ndarray | None = None  # [B, G, K, k] float32
  teacher_features: np.ndarray | None = None  # [B, G, F, D] float32

  def as_dict(self) -> dict[str, np.ndarray]:
    """The fields that are present (teacher signals only in distillation data)."""
    return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def pack_rows(rows: list[list[SampleLayout]], entries: int, groups: int,
              max_group: int) -> PackedBatch:
  """Lays out rows of samples into fixed [entries] and [groups] slots; raises if one overflows."""
  b = len(rows)
  samples = [s for row in rows for s in row]
  teacher = {}
  if samples and samples[0].teacher_features is not None:
    s0 = samples[0]
    if any(s.teacher_features is None for s in samples):
      raise LayoutError("some samples of a batch carry teacher signals and some do not")
    teacher = dict(
        teacher_topk_ids=np.zeros((b, groups, *s0.teacher_topk_ids.shape[1:]), np.int32),
        teacher_topk_logp=np.zeros((b, groups, *s0.teacher_topk_logp.shape[1:]), np.float32),
        teacher_features=np.zeros((b, groups, *s0.teacher_features.shape[1:]), np.float32))
  out = PackedBatch(
      input_ids=np.zeros((b, entries, max_group), np.int32),
      input_size=np.zeros((b, entries), np.int32), positions=np.zeros((b, entries), np.int32),
      segment_ids=np.zeros((b, entries), np.int32), pred_index=np.zeros((b, groups), np.int32),
      target_ids=np.zeros((b, groups, max_group), np.int32),
      target_size=np.zeros((b, groups), np.int32),
      window_ids=np.zeros((b, groups, max_group), np.int32),
      window_size=np.zeros((b, groups), np.int32), **teacher)
  for r, samples in enumerate(rows):
    m = g = 0
    for seg, s in enumerate(samples, start=1):
      if m + s.num_entries > entries or g + s.num_groups > groups:
        raise LayoutError(f"row {r} overflows its {entries} entries / {groups} groups")
      sl, gl = slice(m, m + s.num_entries), slice(g, g + s.num_groups)
      out.input_ids[r, sl] = s.input_ids
      out.input_size[r, sl] = s.input_size
      out.positions[r, sl] = s.positions
      out.segment_ids[r, sl] = seg
      out.pred_index[r, gl] = s.pred_index + m
      out.target_ids[r, gl] = s.target_ids
      out.target_size[r, gl] = s.target_size
      out.window_ids[r, gl] = s.window_ids
      out.window_size[r, gl] = s.window_size
      for name in teacher:
        getattr(out, name)[r, gl] = getattr(s, name)
      m += s.num_entries
      g += s.num_groups
  return out


def unmerged_rows(batch: Mapping[str, jax.Array], tokens: int
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """A packed batch's rows unmerged, in `tokens` slots: token ids and segment ids [B, tokens]
  (each entry's group laid out token by token, in order), and the unmerged index of each
  group's predicting entry's last token [B, G] (`tokens` where the row is too short for it)."""
  ids, size, seg = batch["input_ids"], batch["input_size"], batch["segment_ids"]
  b, m, k = ids.shape
  valid = (jnp.arange(k)[None, None, :] < size[..., None]).reshape(b, m * k)
  dest = jnp.where(valid, jnp.cumsum(valid, axis=1) - 1, tokens)
  rows = jnp.arange(b)[:, None]
  flat = lambda a: a.reshape(b, m * k)
  out_ids = jnp.zeros((b, tokens), ids.dtype).at[rows, dest].set(flat(ids), mode="drop")
  out_seg = jnp.zeros((b, tokens), seg.dtype).at[rows, dest].set(
      flat(jnp.broadcast_to(seg[..., None], (b, m, k))), mode="drop")
  last = jnp.cumsum(size, axis=1) - 1  # [B, M]
  pred = last[rows, batch["pred_index"]]
  return out_ids, out_seg, jnp.where(pred < tokens, pred, tokens)
