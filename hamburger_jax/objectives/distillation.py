"""The distillation recipe: HAMburger taught densely by the original base (the teacher).

The teacher is the frozen base on the UNMERGED sequence; its signals were stored when the data was
segmented (hamburger_jax.data.teacher_pass), so a training step never runs it. Per predicted group g
the batch holds (layout.py): the K-token window from the group's first token (window_ids,
window_size), the teacher's top-k next-token distribution at each window token, and the
teacher's F micro-decoder features at the group's predicting position.

Losses, each weighted by DistillConfig:
- kl: KL from the teacher's (top-k) next-token distribution to HAMburger's, every micro step of
  the window, token 0 included (for token 0 this teaches the embedder and adapters, through the
  base, to make merged contexts predict like unmerged ones).
- feature: at every merged entry, relative squared error between HAMburger's features there and
  the teacher's features at the last token of that group (same predicting position, unmerged).
- stop: BCE of the stop head. Target "segments" (the paper): stop at the group's last token.
  Target "teacher": continue after micro step i iff step i + 1's argmax is the teacher's greedy
  token there, so P(continue) reads "the next token is the one the base would emit". Target
  "harm" (stages 2 and 3 only): "teacher", and stop at every step of a merged group after which
  HAMburger's next token 0 is not the teacher's (the merge cost the base its reading), so the stop
  head learns where merging is safe, not only where the micro tokens are right.
- ce: optional cross-entropy on the data's tokens (0 by default: the KL carries that signal).

`micro_distill_loss` is stage 1: the micro-step decoder and stop head on the stored features
alone, no base forward. `distill_loss` runs the HAMburger forward (stages 2 and 3).
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

from hamburger_jax import layout
from hamburger_jax.objectives.losses import bce_with_logits, chunked_token_stats
from hamburger_jax.model.attention import PackedMask
from hamburger_jax.model.hamburger import Hamburger, continues
from hamburger_jax.run_config import DistillConfig


def feature_error(student: jax.Array, teacher: jax.Array) -> jax.Array:
  """Relative squared error per feature layer, [..., F]: the raw residual streams differ in
  scale by orders of magnitude between layers, so each is measured against its own norm."""
  s, t = student.astype(jnp.float32), teacher.astype(jnp.float32)
  return jnp.sum((s - t) ** 2, axis=-1) / (jnp.sum(t * t, axis=-1) + 1e-6)


# Confidences at which validation reports teacher-forced acceptance (see `acceptance`).
TRACKED_CONFIDENCES = (0.3, 0.5, 0.7, 0.8, 0.9)


def confidence_tag(confidence: float) -> str:
  """The suffix of a confidence's acceptance metrics: 0.8 -> "c80"."""
  return f"c{round(100 * confidence)}"


def acceptance(stop_nk: jax.Array, agree_nk: jax.Array, size_n: jax.Array,
               confidence: float) -> dict[str, jax.Array]:
  """What decoding at `confidence` would do on teacher-forced windows, without generating: after
  token i a row goes on to token i + 1 while the engine's rule (`continues`) holds at every step
  so far and the window has token i + 1. Returns counts: the groups, the tokens they would emit
  (token 0 plus every accepted micro step), the accepted micro steps, and how many of those are
  the teacher's greedy token: the compression / fidelity trade-off that the stop target decides."""
  k = stop_nk.shape[1]
  goes = continues(stop_nk[:, :k - 1], confidence) & (
      jnp.arange(1, k)[None, :] < size_n[:, None])
  accepted = jnp.cumprod(goes.astype(jnp.int32), axis=1).astype(bool)  # token i + 1 emitted
  live = size_n > 0
  return {"groups": live.sum(), "emitted": jnp.sum(jnp.where(live, 1 + accepted.sum(1), 0)),
          "accepted": accepted.sum(), "accepted_agree": jnp.sum(accepted & agree_nk[:, 1:])}


def acceptance_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
  """tf_tokens_per_step_cXX and tf_accepted_agree_cXX from the summed counts (n_tf_*) of one
  batch or of many: ratios of sums, so a validation over batches weighs every group alike."""
  out = {}
  for c in TRACKED_CONFIDENCES:
    tag = confidence_tag(c)
    n = lambda name: metrics[f"n_tf_{name}_{tag}"]
    out[f"tf_tokens_per_step_{tag}"] = n("emitted") / jnp.maximum(n("groups"), 1)
    out[f"tf_accepted_agree_{tag}"] = n("accepted_agree") / jnp.maximum(n("accepted"), 1)
  return out


def micro_step_losses(model: Hamburger, feats_nfd: jax.Array, batch: Mapping[str, jax.Array],
                      cfg: DistillConfig, ce_chunk: int, group_end_n: jax.Array | None = None,
                      merge_read_n: jax.Array | None = None
                      ) -> tuple[jax.Array, dict[str, jax.Array], jax.Array]:
  """KL / CE / stop losses of every micro step of each window, given the features that predict
  it [N, F, D] (N = flattened groups). Returns (weighted loss, metrics, agreement of each micro
  step's argmax with the teacher's greedy token [N, K]).

  `merge_read_n` [N] bool (stop target "harm"): group n is a merged entry, and group n + 1's
  token 0 is predicted from it."""
  k = model.max_group
  window = batch["window_ids"].reshape(-1, k)
  size = batch["window_size"].reshape(-1)
  topk_ids = batch["teacher_topk_ids"].reshape(-1, k, batch["teacher_topk_ids"].shape[-1])
  topk_logp = batch["teacher_topk_logp"].reshape(topk_ids.shape)
  n, _, d = feats_nfd.shape
  h = model.micro_hidden(feats_nfd, window)  # [N, K, D]
  stats = chunked_token_stats(h.reshape(-1, d), model.base.head_dv(), window.reshape(-1),
                              ce_chunk, h.dtype, topk_ids.reshape(n * k, -1),
                              topk_logp.reshape(n * k, -1), rows=batch["window_size"].shape[0])
  ce, kl, argmax = (stats[name].reshape(n, k) for name in ("ce", "kl", "argmax"))
  step = jnp.arange(k)[None, :]
  valid = step < size[:, None]  # [N, K]
  agree = argmax == topk_ids[..., 0]  # the student's token is the teacher's greedy token
  if cfg.stop_target in ("teacher", "harm"):
    next_agrees = jnp.pad(agree[:, 1:], ((0, 0), (0, 1)))
    stop_target = ~(next_agrees & (step + 1 < size[:, None]))
    stop_valid = valid
    if cfg.stop_target == "harm":
      # A merge after which the base no longer predicts its own next token: stop before it.
      harmful = merge_read_n & ~jnp.pad(agree[1:, 0], (0, 1))
      stop_target = stop_target | harmful[:, None]
  else:  # the segmentation's group ends (the paper's targets): labels inside the group only
    ends, inside = layout.stop_targets(group_end_n, k)
    stop_target = ends > 0
    stop_valid = valid & inside
  stop = model.stop_logits(h)  # [N, K] fp32
  bce = bce_with_logits(stop, stop_target.astype(jnp.float32))
  n_tok = jnp.maximum(valid.sum(), 1)
  mean = lambda x: jnp.sum(jnp.where(valid, x, 0)) / n_tok
  n_stop = jnp.maximum(stop_valid.sum(), 1)
  stop_mean = lambda x: jnp.sum(jnp.where(stop_valid, x, 0)) / n_stop
  kl_loss, ce_loss, stop_loss = mean(kl), mean(ce), stop_mean(bce)
  loss = cfg.kl_weight * kl_loss + cfg.ce_weight * ce_loss + cfg.stop_weight * stop_loss
  metrics = {"kl": kl_loss, "lm_loss": ce_loss, "stop_bce": stop_loss, "tokens": valid.sum(),
             "groups": (size > 0).sum(),
             "stop_acc": stop_mean((stop > 0) == stop_target),
             "continue_rate": stop_mean(stop < 0)}  # steps where P(continue) > 0.5
  for c in TRACKED_CONFIDENCES:
    tag = confidence_tag(c)
    counts = acceptance(stop, agree, size, c)
    metrics.update({f"n_tf_{name}_{tag}": v for name, v in counts.items()})
  metrics.update(acceptance_metrics(metrics))
  for i in range(k):
    denom = jnp.maximum(valid[:, i].sum(), 1)
    metrics[f"agree_s{i + 1}"] = jnp.sum(valid[:, i] & agree[:, i]) / denom
    metrics[f"acc_s{i + 1}"] = jnp.sum(valid[:, i] & (argmax[:, i] == window[:, i])) / denom
  return loss, metrics, agree


def micro_distill_loss(model: Hamburger, batch: Mapping[str, jax.Array], cfg: DistillConfig,
                       ce_chunk: int = 1024) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Stage 1: the micro-step decoder and stop head on the teacher's stored features (exact base
  features, nothing merged upstream). Never runs the base forward."""
  feats = batch["teacher_features"]
  b, g, f, d = feats.shape
  loss, metrics, _ = micro_step_losses(model, feats.reshape(b * g, f, d), batch, cfg, ce_chunk,
                                       batch["target_size"].reshape(-1))
  metrics["loss"] = loss
  return loss, metrics


def distill_loss(model: Hamburger, batch: Mapping[str, jax.Array], cfg: DistillConfig,
                 ce_chunk: int = 1024) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Stages 2 and 3: the HAMburger forward (merged entries, adapters on them) against the
  teacher: micro-step KL and stop on each window, feature regression at merged entries."""
  ids, size = batch["input_ids"], batch["input_size"]
  b = ids.shape[0]
  merged = size >= 2
  x = model.smash(ids, size)
  feats, _ = model.base_features(x, batch["positions"], PackedMask(batch["segment_ids"]),
                                 merged_bt=merged)
  rows = jnp.arange(b)[:, None]
  feats = feats[rows, batch["pred_index"]]  # [B, G, F, D]
  g, f, d = feats.shape[1:]
  # Groups predicted from a merged entry: the teacher saw the same context unmerged.
  from_merged = merged[rows, batch["pred_index"]] & (batch["window_size"] > 0)  # [B, G]
  # Groups are laid out in order, so group g + 1 reads the entry of group g (false across rows:
  # the last group of a row is padded).
  merge_read = jnp.pad(from_merged[:, 1:], ((0, 0), (0, 1))).reshape(-1)
  loss, metrics, agree = micro_step_losses(model, feats.reshape(b * g, f, d), batch, cfg,
                                           ce_chunk, batch["target_size"].reshape(-1),
                                           merge_read)
  err = feature_error(feats, batch["teacher_features"]).mean(-1)  # [B, G]
  n_merged = jnp.maximum(from_merged.sum(), 1)
  feature_loss = jnp.sum(jnp.where(from_merged, err, 0)) / n_merged
  loss = loss + cfg.feature_weight * feature_loss
  # Token-0 agreement with the teacher after merged vs unmerged entries: the quality split.
  agree0 = agree[:, 0].reshape(b, g)
  unmerged = (batch["window_size"] > 0) & ~from_merged
  metrics.update(
      loss=loss, feature_loss=feature_loss,
      agree_merged=jnp.sum(agree0 & from_merged) / n_merged,
      agree_unmerged=jnp.sum(agree0 & unmerged) / jnp.maximum(unmerged.sum(), 1))
  return loss, metrics
