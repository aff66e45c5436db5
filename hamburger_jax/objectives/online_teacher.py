"""The teacher in the train step: the distill recipe's signals computed from the frozen base
inside the same jitted step, instead of read from disk (hamburger_jax.data.teacher_pass).

The batch carries each row's samples twice: as HAMburger reads them (entries, groups, windows:
hamburger_jax.data.tokens.online_batch) and unmerged (`tokens`, `token_segment`), with
`teacher_index` [B, G, K]: the unmerged position whose output predicts each window token (for
token 0, the group's predicting position). The base runs once over the unmerged rows, exactly
(no merged-entry adapters), under stop_gradient; its top-k next-token log-probs and its F
features are gathered where the windows need them, giving the same fields a stored dataset
holds (distillation.py), so the recipe's losses are unchanged. Disk then holds token ids only,
and a step's teacher costs one forward of the base, about a quarter of the step.
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

from hamburger_jax.objectives.losses import chunked_topk
from hamburger_jax.model.attention import PackedMask
from hamburger_jax.model.hamburger import Hamburger
from hamburger_jax.segmentation import segment_positions

# The batch fields the teacher reads ([B, L], [B, L], [B, G, K]).
ONLINE_FIELDS = ("tokens", "token_segment", "teacher_index")


def teacher_signals(model: Hamburger, batch: Mapping[str, jax.Array], top_k: int,
                    chunk: int = 1024, select_dtype=None) -> dict[str, jax.Array]:
  """teacher_topk_ids / teacher_topk_logp [B, G, K, k] and teacher_features [B, G, F, D] of
  the batch's windows, from the exact base over its unmerged rows (no gradient). The top-k are
  chosen on logits in `select_dtype` (losses.chunked_topk; default the model's compute dtype),
  their log-probs float32's."""
  base = model.base
  tokens, seg = batch["tokens"], batch["token_segment"]
  b, t = tokens.shape
  out = base.forward(base.embed(tokens), segment_positions(seg), PackedMask(seg),
                     collect=model.feature_layers[:-1])
  feats = jnp.stack([*out.collected, out.hidden], axis=-2)  # [B, L, F, D]
  d = out.hidden.shape[-1]
  logp, ids = chunked_topk(out.hidden.reshape(b * t, d), base.head_dv(), top_k, chunk,
                           out.hidden.dtype, rows=b,
                           select_dtype=select_dtype or out.hidden.dtype)
  logp, ids = logp.reshape(b, t, top_k), ids.reshape(b, t, top_k)
  index = batch["teacher_index"]  # [B, G, K]
  rows = jnp.arange(b)[:, None, None]
  signals = {"teacher_topk_ids": ids[rows, index], "teacher_topk_logp": logp[rows, index],
             "teacher_features": feats[rows[..., 0], index[..., 0]].astype(jnp.float32)}
  return jax.lax.stop_gradient(signals)


def with_teacher(model: Hamburger, batch: Mapping[str, jax.Array], top_k: int,
                 chunk: int = 1024, select_dtype=None) -> dict[str, jax.Array]:
  """`batch` with the teacher's signals added (what a stored distill batch holds)."""
  return {**batch, **teacher_signals(model, batch, top_k, chunk, select_dtype)}
