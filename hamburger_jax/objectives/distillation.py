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
- greedy: optional cross-entropy on the teacher's greedy token (its top-1), which a drafter
  must rank first for verify to keep it (0 by default).

`micro_distill_loss` is stage 1: the micro-step decoder and stop head on the stored features
alone, no base forward. `distill_loss` runs the HAMburger forward (stages 2 and 3).
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

from hamburger_jax import layout
from hamburger_jax.objectives.losses import bce_with_logits, chunked_token_stats
from hamburger_jax.model import layer_merge
from hamburger_jax.model.attention import PackedMask
from hamburger_jax.model.hamburger import Hamburger, continues
from hamburger_jax.model.llama import ALL_MERGED
from hamburger_jax.segmentation import segment_positions
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


def window_stats(model: Hamburger, feats_nfd: jax.Array, batch: Mapping[str, jax.Array],
                 ce_chunk: int, drafting: bool = False, unroll: bool = False
                 ) -> dict[str, jax.Array]:
  """Every micro step of each window, teacher-forced from the features that predict it [N, F,
  D] (N = flattened groups): the hidden states h [N, K, D], and per step [N, K] the CE, the KL
  from the teacher's top-k, the argmax, whether it is the teacher's greedy token (`agree`) and
  whether the window has that step (`valid`); `size` [N] the window sizes. `drafting`: the
  graft's drafter (verify mode's) instead of its micro decoder; `unroll`: its steps read its
  own drafts (`drafted_window`), the targets stay the teacher's."""
  k = model.max_group
  window = batch["window_ids"].reshape(-1, k)
  size = batch["window_size"].reshape(-1)
  topk_ids = batch["teacher_topk_ids"].reshape(-1, k, batch["teacher_topk_ids"].shape[-1])
  topk_logp = batch["teacher_topk_logp"].reshape(topk_ids.shape)
  n, _, d = feats_nfd.shape
  if unroll:
    window = drafted_window(model, feats_nfd, window)
  h = model.micro_hidden(feats_nfd, window, drafting)  # [N, K, D]
  if drafting and model.micro_head is not None:
    return {"h": h, "window": window, "size": size,
            "valid": jnp.arange(k)[None, :] < size[:, None],
            **micro_vocab_stats(model, h, window, topk_ids, topk_logp)}
  stats = chunked_token_stats(h.reshape(-1, d), model.base.head_dv(), window.reshape(-1),
                              ce_chunk, h.dtype, topk_ids.reshape(n * k, -1),
                              topk_logp.reshape(n * k, -1), rows=batch["window_size"].shape[0])
  ce, kl, argmax, greedy_ce = (stats[name].reshape(n, k)
                               for name in ("ce", "kl", "argmax", "greedy_ce"))
  return {"h": h, "ce": ce, "kl": kl, "argmax": argmax, "window": window, "size": size,
          "greedy_ce": greedy_ce,
          "agree": argmax == topk_ids[..., 0],  # the student's token is the teacher's greedy one
          "valid": jnp.arange(k)[None, :] < size[:, None]}


def drafted_window(model: Hamburger, feats_nfd: jax.Array, window_nk: jax.Array) -> jax.Array:
  """The window as the drafter reads it at decode time: token 0 (the base's), then its own
  greedy drafts 1 .. K-2 in place of the data's (training-time test); token K-1 is no step's
  input and stays the data's. Draft i depends on the drafts before it, so K - 2 passes make
  them exact; they are constants to the gradient (decoding never differentiates an argmax)."""
  if model.micro_head is None:
    raise ValueError("distill.draft_unroll drafts with the reduced head: set train.micro_vocab "
                     "(the full head's logits for every draft would not fit a step)")
  window = window_nk
  for _ in range(model.max_group - 2):
    h = model.micro_hidden(feats_nfd, window, True)
    drafts = model.micro_greedy(h[:, 1:-1])  # the steps whose drafts a later step reads
    window = jax.lax.stop_gradient(jnp.concatenate(
        [window_nk[:, :1], drafts.astype(window_nk.dtype), window_nk[:, -1:]], axis=1))
  return window


def micro_vocab_stats(model: Hamburger, h_nkd: jax.Array, window_nk: jax.Array,
                      topk_ids: jax.Array, topk_logp: jax.Array) -> dict[str, jax.Array]:
  """window_stats' per-step figures [N, K] for a drafter with a reduced micro vocabulary
  (Hamburger.set_micro_vocab): what it drafts among, so what it is taught on. Steps 1.. read the
  reduced head (a small fraction of the full one's cost); the teacher's top-k is restricted to
  the vocabulary and renormalised there, and a step whose teacher tokens all fall outside it
  (or whose greedy / data token does) adds nothing to that term. Step 0 is the base's own token
  (the skip connection: nothing of it trains): agree, and 0 in every loss."""
  vocab = model.cfg.base.vocab_size
  ids = model.micro_ids[...]
  index = jnp.full((vocab,), -1, jnp.int32).at[ids].set(jnp.arange(ids.shape[0], dtype=jnp.int32))
  logits = model.micro_logits(h_nkd)  # [N, K, M] fp32
  logq = jax.nn.log_softmax(logits, axis=-1)
  at = lambda idx: jnp.take_along_axis(logq, jnp.maximum(idx, 0), axis=-1)
  tk = index[topk_ids]  # [N, K, k]
  inside = tk >= 0
  logp = jax.nn.log_softmax(jnp.where(inside, topk_logp.astype(jnp.float32), -1e30), axis=-1)
  kl = jnp.sum(jnp.where(inside, jnp.exp(logp) * (logp - at(tk)), 0.0), axis=-1)
  greedy = index[topk_ids[..., 0]]
  target = index[window_nk]
  later = jnp.arange(h_nkd.shape[1])[None, :] > 0
  keep = lambda ok, x: jnp.where(later & ok, x, 0.0)
  argmax = model.micro_token(jnp.argmax(logits, axis=-1))
  return {"kl": keep(jnp.any(inside, axis=-1), kl),
          "greedy_ce": keep(greedy >= 0, -at(greedy[..., None])[..., 0]),
          "ce": keep(target >= 0, -at(target[..., None])[..., 0]),
          "argmax": jnp.where(later, argmax, topk_ids[..., 0]),
          "agree": ~later | (argmax == topk_ids[..., 0])}


def micro_step_losses(model: Hamburger, feats_nfd: jax.Array, batch: Mapping[str, jax.Array],
                      cfg: DistillConfig, ce_chunk: int, group_end_n: jax.Array | None = None,
                      merge_read_n: jax.Array | None = None, drafting: bool = False
                      ) -> tuple[jax.Array, dict[str, jax.Array], jax.Array]:
  """KL / CE / stop losses of every micro step of each window, given the features that predict
  it [N, F, D] (N = flattened groups). Returns (weighted loss, metrics, agreement of each micro
  step's argmax with the teacher's greedy token [N, K]).

  `merge_read_n` [N] bool (stop target "harm"): group n is a merged entry, and group n + 1's
  token 0 is predicted from it."""
  k = model.max_group
  w = window_stats(model, feats_nfd, batch, ce_chunk, drafting,
                   unroll=drafting and cfg.draft_unroll)
  h, ce, kl, argmax, window, size = (w[n] for n in ("h", "ce", "kl", "argmax", "window", "size"))
  step = jnp.arange(k)[None, :]
  valid, agree = w["valid"], w["agree"]
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
  stop = model.stop_logits(h, drafting)  # [N, K] fp32
  bce = bce_with_logits(stop, stop_target.astype(jnp.float32))
  n_tok = jnp.maximum(valid.sum(), 1)
  mean = lambda x: jnp.sum(jnp.where(valid, x, 0)) / n_tok
  n_stop = jnp.maximum(stop_valid.sum(), 1)
  stop_mean = lambda x: jnp.sum(jnp.where(stop_valid, x, 0)) / n_stop
  kl_loss, ce_loss, stop_loss = mean(kl), mean(ce), stop_mean(bce)
  greedy_loss = mean(w["greedy_ce"])
  loss = (cfg.kl_weight * kl_loss + cfg.ce_weight * ce_loss + cfg.stop_weight * stop_loss
          + cfg.greedy_weight * greedy_loss)
  metrics = {"kl": kl_loss, "lm_loss": ce_loss, "stop_bce": stop_loss, "greedy_ce": greedy_loss,
             "tokens": valid.sum(),
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
                       ce_chunk: int = 1024, drafting: bool = False
                       ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Stage 1: the micro-step decoder and stop head on the teacher's stored features (exact base
  features, nothing merged upstream). Never runs the base forward. `drafting`: the graft's
  drafter instead (verify mode's: on data grouped one token a group, every position of a plain
  context drafts, and the stop target "teacher" is "the next draft is the base's")."""
  feats = batch["teacher_features"]
  b, g, f, d = feats.shape
  loss, metrics, _ = micro_step_losses(model, feats.reshape(b * g, f, d), batch, cfg, ce_chunk,
                                       batch["target_size"].reshape(-1), drafting=drafting)
  metrics["loss"] = loss
  return loss, metrics


def predicting_features(model: Hamburger, batch: Mapping[str, jax.Array], *,
                        layers: bool = False, tokens: int | None = None) -> tuple[jax.Array, ...]:
  """The HAMburger forward of a packed batch (merged entries, adapters where the graft puts
  them): the features at each group's predicting entry [B, G, F, D], and that entry's group
  size [B, G] (1: a prompt token or a single-token group; >= 2: a merged entry). With `layers`,
  also that entry's input to every base layer [B, G, L, D] (the entry itself, then each layer's
  residual output) and the last layer's residual output [B, G, D] (`dense_alignment`).

  A merge at layer L > 0 (model/layer_merge.py) runs the lower layers over the rows unmerged in
  `tokens` slots; a predicting entry whose group does not fit them gets size 0 (`fit_windows`
  then drops what it predicts)."""
  ids, size = batch["input_ids"], batch["input_size"]
  rows = jnp.arange(ids.shape[0])[:, None]
  at = lambda a: a[rows, batch["pred_index"]]
  adapted = model.adapted_entries(size, batch["segment_ids"])
  mask = PackedMask(batch["segment_ids"])
  if model.merge_layer:
    if layers:
      raise ValueError("dense alignment (distill.dense_weight) aligns a merged input entry: a "
                       f"merge at layer {model.merge_layer} has none; use merge_layer=0")
    if not tokens:
      raise ValueError(f"a merge at layer {model.merge_layer} runs the lower layers over the rows "
                       "unmerged: give their length (tokens; the trainer passes data.tokens)")
    x, lower, fits = layer_merge.entry_states(model, batch, tokens)
    feats, _ = model.base_features(x, batch["positions"], mask, merged_bt=adapted,
                                   span=(model.merge_layer, model.cfg.base.num_layers),
                                   lower=lower)
    return at(feats), jnp.where(at(fits), at(size), 0)
  context = entry_context(model, batch) if model.embedder.contextual else None
  x = model.smash(ids, size, context)
  if not layers:
    feats, _ = model.base_features(x, batch["positions"], mask, merged_bt=adapted)
    return at(feats), at(size)
  n = model.cfg.base.num_layers
  out = model.base.forward(x, batch["positions"], mask, collect=tuple(range(n)), merged_bt=adapted)
  outs = [at(o) for o in out.collected]  # [B, G, D] each
  feats = jnp.stack([outs[i] for i in model.feature_layers[:-1]] + [at(out.hidden)], axis=-2)
  return feats, at(size), jnp.stack([at(x)] + outs[:-1], axis=-2), outs[-1]


def _relative_error(student: jax.Array, teacher: jax.Array) -> jax.Array:
  """feature_error over every axis after the leading [B, G] (a head's keys: heads x dims)."""
  s, t = (a.reshape(*a.shape[:2], -1) for a in (student, teacher))
  return feature_error(s, t)


def dense_alignment(model: Hamburger, batch: Mapping[str, jax.Array], inputs: jax.Array,
                    last: jax.Array, tokens: int) -> tuple[jax.Array, jax.Array]:
  """Per predicting entry [B, G]: the relative error of every base layer's residual output, keys
  and values there against the exact base's at the same token of the unmerged rows (the last of
  the entry's group), averaged over the layers and the three; and whether the entry fits the
  unmerged rows (`tokens` slots). The teacher runs here, under stop_gradient."""
  base, n = model.base, model.cfg.base.num_layers
  ids, seg, at = layout.unmerged_rows(batch, tokens)
  b = ids.shape[0]
  rows = jnp.arange(b)[:, None]
  t_out = base.forward(base.embed(ids), segment_positions(seg), PackedMask(seg),
                       collect=tuple(range(n)))
  gather = lambda a: jax.lax.stop_gradient(jnp.pad(a, ((0, 0), (0, 1), (0, 0)))[rows, at])
  t_in = [gather(base.embed(ids))] + [gather(o) for o in t_out.collected[:-1]]
  t_last = gather(t_out.collected[-1])
  err = []
  for i, layer in enumerate(base.decoder.layers):
    s_kv = layer.self_attn.project(layer.input_layernorm(inputs[:, :, i]), ALL_MERGED)[1:]
    t_kv = layer.self_attn.project(layer.input_layernorm(t_in[i]))[1:]
    err += [_relative_error(s, jax.lax.stop_gradient(t)) for s, t in zip(s_kv, t_kv)]
    s_res = inputs[:, :, i + 1] if i + 1 < n else last
    err.append(_relative_error(s_res, t_in[i + 1] if i + 1 < n else t_last))
  return jnp.mean(jnp.stack(err, axis=-1), axis=-1), at < tokens


def teacher_context(model: Hamburger, features_nfd: jax.Array, window_nk: jax.Array
                    ) -> jax.Array:
  """What a contextual embedder reads of N groups [N, K, D]: the micro decoder's hidden states
  over each group's window (layout.py: its K tokens from its first), teacher-forced from the
  teacher's features that predicted it (stored in float32: run in the base's dtype, as decoding
  runs its own). The one construction that training (entry_context) and the one-merge
  evaluations (evaluation/fidelity.py: one_merge_entries) read."""
  return model.group_context(features_nfd.astype(jnp.dtype(model.cfg.base.dtype)), window_nk)


def entry_context(model: Hamburger, batch: Mapping[str, jax.Array]) -> jax.Array:
  """A contextual embedder's input at every entry [B, M, K, D] (zero at prompt entries): each
  group's teacher_context, at the entry of the packed row that holds the group. Teacher-forced:
  decoding reads the states of its own features."""
  ids = batch["input_ids"]
  b, m, k = ids.shape
  feats = batch["teacher_features"]  # [B, G, F, D]
  g, f, d = feats.shape[1:]
  h = teacher_context(model, feats.reshape(b * g, f, d),
                      batch["window_ids"].reshape(b * g, k)).reshape(b, g, k, d)
  # Group g's own entry follows the entry that predicts it (padded groups go nowhere).
  entry = jnp.where(batch["window_size"] > 0, batch["pred_index"] + 1, m)
  rows = jnp.arange(b)[:, None]
  return jnp.zeros((b, m, k, d), h.dtype).at[rows, entry].set(h, mode="drop")


def fit_windows(batch: Mapping[str, jax.Array], read_size: jax.Array) -> dict[str, jax.Array]:
  """The batch without the windows whose predicting entry did not fit (read size 0 there:
  predicting_features), so that no loss or metric counts them."""
  keep = read_size > 0
  return {**batch, "window_size": jnp.where(keep, batch["window_size"], 0),
          "target_size": jnp.where(keep, batch["target_size"], 0)}


def distill_loss(model: Hamburger, batch: Mapping[str, jax.Array], cfg: DistillConfig,
                 ce_chunk: int = 1024, dense_tokens: int | None = None
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Stages 2 and 3: the HAMburger forward (merged entries, adapters on them) against the
  teacher: micro-step KL and stop on each window, feature regression at merged entries, and
  with distill.dense_weight the dense alignment of every layer there (`dense_alignment`, on
  unmerged rows of `dense_tokens` slots; a merge at layer L > 0 runs its lower layers over
  those rows too)."""
  b = batch["input_ids"].shape[0]
  dense = cfg.dense_weight > 0
  if dense and not dense_tokens:
    raise ValueError("distill.dense_weight > 0 aligns against the unmerged rows: give their "
                     "length (dense_tokens; the trainer passes data.tokens)")
  feats, read_size, *layer_states = predicting_features(model, batch, layers=dense,
                                                        tokens=dense_tokens)
  batch = fit_windows(batch, read_size)
  g, f, d = feats.shape[1:]
  # Groups predicted from a merged entry: the teacher saw the same context unmerged.
  from_merged = (read_size >= 2) & (batch["window_size"] > 0)  # [B, G]
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
  if dense:
    dense_err, fits = dense_alignment(model, batch, *layer_states, dense_tokens)
    aligned = from_merged & fits
    dense_loss = jnp.sum(jnp.where(aligned, dense_err, 0)) / jnp.maximum(aligned.sum(), 1)
    loss = loss + cfg.dense_weight * dense_loss
    metrics["dense_loss"] = dense_loss
  # Token-0 agreement with the teacher after merged vs unmerged entries: the quality split.
  agree0 = agree[:, 0].reshape(b, g)
  unmerged = (batch["window_size"] > 0) & ~from_merged
  metrics.update(
      loss=loss, feature_loss=feature_loss,
      agree_merged=jnp.sum(agree0 & from_merged) / n_merged,
      agree_unmerged=jnp.sum(agree0 & unmerged) / jnp.maximum(unmerged.sum(), 1))
  return loss, metrics
