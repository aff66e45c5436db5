"""The distill recipe: its losses against a slow NumPy reference written from the module's
definitions, and its training stages on the tiny config (stage 1 never runs the base forward,
each stage lowers its loss and starts from its predecessor's export, killed stages resume
exactly, bad inputs are named)."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hamburger_jax import layout
from hamburger_jax.objectives.distillation import (TRACKED_CONFIDENCES, acceptance, acceptance_metrics,
                                        distill_loss, micro_distill_loss)
from hamburger_jax.model.hamburger import Hamburger
from hamburger_jax.model.llama import causal_segment_mask
from hamburger_jax.run_config import ConfigError, DistillConfig, load_run_config
from hamburger_jax.testing import DECODE_CFG, DISTILL_GRAFT, tiny_distill_model

CFG, GRAFT = DECODE_CFG, DISTILL_GRAFT
K, TOP = GRAFT.max_group, 5


@pytest.fixture(scope="module")
def model() -> Hamburger:
  return tiny_distill_model()


def _teacher(rng, r: int, g: int, f: int) -> dict[str, np.ndarray]:
  ids = np.stack([rng.permutation(CFG.vocab_size)[:TOP] for _ in range(r)])
  logp = -np.sort(rng.exponential(2.0, (r, TOP)), axis=-1)
  scale = np.array([1.0, 10.0, 100.0, 1.0])[:f, None]  # raw residuals differ in scale
  return {"topk_ids": ids, "topk_logp": logp,
          "features": rng.normal(size=(g, f, CFG.hidden_size)) * scale}


@pytest.fixture(scope="module")
def batch(model) -> dict[str, np.ndarray]:
  """Two samples in one packed row, with random teacher signals."""
  rng = np.random.default_rng(0)
  samples = []
  for prompt, groups in (([1, 5, 9, 33], [2, 1, 3, 1, 2]), ([7, 8], [1, 4, 2])):
    r = sum(groups)
    response = rng.integers(3, CFG.vocab_size, r)
    samples.append(layout.layout_sample(prompt, response, groups, K, teacher=_teacher(
        rng, r, len(groups), model.num_features)))
  return layout.pack_rows([samples], 24, 10, K).as_dict()


def _log_softmax(x: np.ndarray) -> np.ndarray:
  x = x.astype(np.float64)
  m = x.max(-1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _bce(logit: float, target: float) -> float:
  return max(logit, 0) - logit * target + np.log1p(np.exp(-abs(logit)))


def reference(model: Hamburger, batch: dict, cfg: DistillConfig, stage1: bool) -> dict[str, float]:
  """The losses one group and one micro step at a time, in NumPy float64."""
  b = {k: np.asarray(v) for k, v in batch.items()}
  emb = np.asarray(model.base.embed_tokens[...], np.float64)
  if not stage1:
    feats_all = np.asarray(model.base_features(
        model.smash(jnp.asarray(b["input_ids"]), jnp.asarray(b["input_size"])),
        jnp.asarray(b["positions"]), causal_segment_mask(jnp.asarray(b["segment_ids"])),
        merged_bt=jnp.asarray(b["input_size"] >= 2))[0])
  kl, ce, bce, feat = [], [], [], []
  agree0 = {True: [], False: []}
  groups = {}  # (row, predicting entry) -> what the losses need of that group
  for r in range(b["window_size"].shape[0]):
    for g in range(b["window_size"].shape[1]):
      size = int(b["window_size"][r, g])
      if size == 0:
        continue
      entry = int(b["pred_index"][r, g])
      if stage1:
        f_s = b["teacher_features"][r, g]
        from_merged = False
      else:
        f_s = feats_all[r, entry]
        from_merged = bool(b["input_size"][r, entry] >= 2)
      window = b["window_ids"][r, g]
      h = np.asarray(model.micro_hidden(jnp.asarray(f_s)[None], jnp.asarray(window)[None])[0])
      logq = _log_softmax(h.astype(np.float64) @ emb.T)
      agree = [int(np.argmax(logq[i])) == int(b["teacher_topk_ids"][r, g, i, 0])
               for i in range(size)]
      groups[r, entry] = dict(g=g, size=size, window=window, logq=logq, agree=agree,
                              from_merged=from_merged, f_s=f_s,
                              stop=np.asarray(model.stop_logits(jnp.asarray(h)), np.float64))
  for (r, entry), x in groups.items():
    g, size, window, logq, agree, stop = (x[k] for k in ("g", "size", "window", "logq", "agree",
                                                           "stop"))
    agree0[x["from_merged"]].append(agree[0])
    # "harm": the group read from this group's own entry (the next one) is predicted from a
    # merged entry, and its token 0 is not the teacher's.
    after = groups.get((r, entry + 1))
    harmful = after is not None and after["from_merged"] and not after["agree"][0]
    group_end = int(b["target_size"][r, g])
    for i in range(size):
      p = _log_softmax(b["teacher_topk_logp"][r, g, i])
      kl.append(float(np.sum(np.exp(p) * (p - logq[i, b["teacher_topk_ids"][r, g, i]]))))
      ce.append(-float(logq[i, window[i]]))
      if cfg.stop_target in ("teacher", "harm"):
        target = 0.0 if i + 1 < size and agree[i + 1] else 1.0
        bce.append(_bce(stop[i], 1.0 if cfg.stop_target == "harm" and harmful else target))
      elif i < group_end:
        bce.append(_bce(stop[i], 1.0 if i == group_end - 1 else 0.0))
    if x["from_merged"]:
      t = b["teacher_features"][r, g].astype(np.float64)
      err = ((x["f_s"] - t) ** 2).sum(-1) / ((t * t).sum(-1) + 1e-6)
      feat.append(float(err.mean()))
  out = {"kl": np.mean(kl), "lm_loss": np.mean(ce), "stop_bce": np.mean(bce)}
  out["loss"] = cfg.kl_weight * out["kl"] + cfg.ce_weight * out["lm_loss"] + (
      cfg.stop_weight * out["stop_bce"])
  if not stage1:
    out["feature_loss"] = np.mean(feat)
    out["loss"] += cfg.feature_weight * out["feature_loss"]
    out["agree_merged"] = np.mean(agree0[True])
    out["agree_unmerged"] = np.mean(agree0[False])
  return out


@pytest.mark.parametrize("stop_target", ["teacher", "segments", "harm"])
def test_distill_loss_matches_numpy_reference(model, batch, stop_target):
  cfg = DistillConfig(kl_weight=1.0, feature_weight=0.7, stop_weight=0.5, ce_weight=0.3,
                      stop_target=stop_target)
  got = distill_loss(model, {k: jnp.asarray(v) for k, v in batch.items()}, cfg, ce_chunk=7)[1]
  want = reference(model, batch, cfg, stage1=False)
  assert 0 < int(np.sum(np.asarray(batch["input_size"]) >= 2))  # merged entries are read
  for name, value in want.items():
    np.testing.assert_allclose(float(got[name]), value, rtol=2e-4, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("stop_target", ["teacher", "segments"])
def test_micro_distill_loss_matches_numpy_reference(model, batch, stop_target):
  cfg = DistillConfig(ce_weight=0.2, stop_target=stop_target)
  got = micro_distill_loss(model, {k: jnp.asarray(v) for k, v in batch.items()}, cfg)[1]
  want = reference(model, batch, cfg, stage1=True)
  for name, value in want.items():
    np.testing.assert_allclose(float(got[name]), value, rtol=2e-4, atol=2e-5, err_msg=name)


def test_harm_stop_target_stops_before_a_misread_merge(model, batch):
  """The teacher is the student itself (every micro token agrees), except after one merged
  entry, where the teacher's greedy token 0 is another: "teacher" continues through the merged
  group, "harm" stops at each of its steps."""
  b = {k: jnp.asarray(v) for k, v in batch.items()}
  feats = model.base_features(model.smash(b["input_ids"], b["input_size"]), b["positions"],
                              causal_segment_mask(b["segment_ids"]),
                              merged_bt=b["input_size"] >= 2)[0]
  rows = jnp.arange(feats.shape[0])[:, None]
  feats = feats[rows, b["pred_index"]]
  n, g = feats.shape[:2]
  h = model.micro_hidden(feats.reshape(n * g, *feats.shape[2:]), b["window_ids"].reshape(n * g, K))
  logq = jax.nn.log_softmax(model.logits(h), axis=-1).reshape(n, g, K, -1)
  top_logp, top_ids = jax.lax.top_k(logq, CFG.vocab_size)
  # Group 1 of row 0 is predicted from group 0's merged entry (2 tokens): its teacher's greedy
  # token 0 becomes the student's second choice.
  assert int(b["input_size"][0, int(b["pred_index"][0, 1])]) == 2
  swap = lambda x: x.at[0, 1, 0, :2].set(x[0, 1, 0, 1::-1])
  own = dict(b, teacher_topk_ids=swap(top_ids), teacher_topk_logp=top_logp)
  cfgs = {t: DistillConfig(stop_target=t) for t in ("teacher", "harm")}
  got = {t: distill_loss(model, own, cfg)[1] for t, cfg in cfgs.items()}
  want = {t: reference(model, own, cfg, stage1=False) for t, cfg in cfgs.items()}
  for t in cfgs:
    np.testing.assert_allclose(float(got[t]["stop_bce"]), want[t]["stop_bce"], rtol=2e-4)
  assert float(got["harm"]["agree_merged"]) < 1.0 and float(got["harm"]["agree_s2"]) == 1.0
  assert float(got["harm"]["stop_bce"]) != pytest.approx(float(got["teacher"]["stop_bce"]))


def test_harm_needs_the_merged_forward():
  with pytest.raises(ConfigError, match="stop_target=harm .* stage 1"):
    load_run_config(None, ["train.recipe=distill", "train.trainable=micro",
                           "distill.stop_target=harm"])
  load_run_config(None, ["train.recipe=distill", "train.trainable=stop",
                         "distill.stop_target=harm"])


def test_kl_is_zero_when_the_student_is_the_teacher(model, batch):
  """Teacher top-k taken from the student's own distribution (all of it: k = V): KL = 0."""
  b = {k: jnp.asarray(v) for k, v in batch.items()}
  feats = b["teacher_features"]
  n, g = feats.shape[:2]
  h = model.micro_hidden(feats.reshape(n * g, *feats.shape[2:]), b["window_ids"].reshape(n * g, K))
  logq = jax.nn.log_softmax(model.logits(h), axis=-1).reshape(n, g, K, -1)
  top_logp, top_ids = jax.lax.top_k(logq, CFG.vocab_size)
  own = dict(b, teacher_topk_ids=top_ids, teacher_topk_logp=top_logp)
  got = micro_distill_loss(model, own, DistillConfig())[1]
  assert abs(float(got["kl"])) < 1e-5
  assert float(got["agree_s2"]) == 1.0


def test_acceptance_follows_decoding_at_a_confidence():
  """Against a loop that decodes each teacher-forced window as the engine would: continue from
  token i to i + 1 while P(continue) = sigmoid(-stop) >= c and the window has token i + 1."""
  rng = np.random.default_rng(3)
  n, k = 64, K
  stop = rng.normal(0, 2, (n, k)).astype(np.float32)
  agree = rng.random((n, k)) < 0.6
  size = rng.integers(0, k + 1, n)
  stop[0, 0] = -40.0  # sigmoid(40) == 1.0 in float32: only confidence 1.0 itself stops there
  for c in (0.0, 0.5, 0.8, 1.0 - 1e-6, 1.0):
    got = {name: int(v) for name, v in acceptance(jnp.asarray(stop), jnp.asarray(agree),
                                                  jnp.asarray(size), c).items()}
    want = dict(groups=0, emitted=0, accepted=0, accepted_agree=0)
    for row in range(n):
      if size[row] == 0:
        continue
      want["groups"] += 1
      want["emitted"] += 1
      for i in range(k - 1):
        p_continue = np.float32(1) / (np.float32(1) + np.exp(np.float32(stop[row, i])))
        if not (c < 1.0 and p_continue >= c and i + 1 < size[row]):
          break
        want["emitted"] += 1
        want["accepted"] += 1
        want["accepted_agree"] += int(agree[row, i + 1])
    assert got == want, c
  assert got["accepted"] == 0  # confidence 1.0: never a micro step, like the engine
  ratios = acceptance_metrics({f"n_tf_{k}_c{round(100 * c)}": v for c in TRACKED_CONFIDENCES
                               for k, v in dict(groups=4, emitted=6, accepted=2,
                                                accepted_agree=1).items()})
  assert float(ratios["tf_tokens_per_step_c80"]) == 1.5
  assert float(ratios["tf_accepted_agree_c80"]) == 0.5
  assert got["accepted"] < int(acceptance(jnp.asarray(stop), jnp.asarray(agree),
                                          jnp.asarray(size), 0.0)["accepted"])


# ----------------------------------------------------------------------------- dense alignment


def test_unmerged_rows_lay_each_group_out_and_find_the_predicting_token(batch):
  from hamburger_jax.layout import unmerged_rows
  b = {k: np.asarray(v) for k, v in batch.items()}
  ids, seg, at = (np.asarray(a) for a in unmerged_rows({k: jnp.asarray(v) for k, v in b.items()},
                                                       40))
  expect_ids, expect_seg, last = [], [], []
  for m in range(b["input_size"].shape[1]):
    n = int(b["input_size"][0, m])
    expect_ids += b["input_ids"][0, m, :n].tolist()
    expect_seg += [int(b["segment_ids"][0, m])] * n
    last.append(len(expect_ids) - 1)
  assert ids[0, :len(expect_ids)].tolist() == expect_ids
  assert seg[0, :len(expect_seg)].tolist() == expect_seg and not seg[0, len(expect_seg):].any()
  valid = b["window_size"][0] > 0
  assert at[0][valid].tolist() == [last[e] for e in b["pred_index"][0][valid]]
  # A row too short for an entry marks it as not fitting.
  short = np.asarray(unmerged_rows({k: jnp.asarray(v) for k, v in b.items()}, 6)[2])
  assert (short[0][valid] == 6).sum() == sum(last[e] >= 6 for e in b["pred_index"][0][valid])


def test_dense_alignment_is_zero_where_nothing_is_merged_and_trains_where_it_is():
  from flax import nnx
  import dataclasses
  from hamburger_jax.config import HamburgerConfig
  from hamburger_jax.objectives.distillation import dense_alignment, predicting_features
  from hamburger_jax.testing import sharpen
  plain = Hamburger(HamburgerConfig(CFG, dataclasses.replace(GRAFT, base_lora_rank=0)),
                    rngs=nnx.Rngs(0))
  sharpen(plain, 4.0)
  rng = np.random.default_rng(1)

  def packed(groups):
    r = sum(groups)
    s = layout.layout_sample([3, 4, 5], rng.integers(3, CFG.vocab_size, r), groups, K,
                             teacher=_teacher(rng, r, len(groups), plain.num_features))
    return {k: jnp.asarray(v) for k, v in layout.pack_rows([[s]], 16, 8, K).as_dict().items()}

  singles = packed([1] * 6)
  _, _, inputs, last = predicting_features(plain, singles, layers=True)
  err, fits = dense_alignment(plain, singles, inputs, last, 32)
  valid = np.asarray(singles["window_size"][0] > 0)
  # Every entry is the plain run's own: the pairing of entries and unmerged tokens is exact.
  assert np.asarray(fits)[0][valid].all() and np.abs(np.asarray(err)[0][valid]).max() < 1e-5
  merged = packed([2, 3, 1, 2])
  _, _, inputs, last = predicting_features(plain, merged, layers=True)
  err = np.asarray(dense_alignment(plain, merged, inputs, last, 32)[0])[0]
  size = np.asarray(merged["input_size"])[0][np.asarray(merged["pred_index"])[0]]
  assert (err[valid & (size >= 2)] > 1e-3).all()  # a merged entry is not the plain state


def test_distill_loss_with_dense_alignment_has_gradients(model, batch):
  from flax import nnx
  cfg = DistillConfig(dense_weight=1.0)
  own = {k: jnp.asarray(v) for k, v in batch.items()}
  with pytest.raises(ValueError, match="dense_tokens"):
    distill_loss(model, own, cfg)
  graphdef, state = nnx.split(model)
  loss = lambda st: distill_loss(nnx.merge(graphdef, st), own, cfg, dense_tokens=48)
  (value, metrics), grads = jax.value_and_grad(loss, has_aux=True)(state)
  base = distill_loss(model, own, DistillConfig(), dense_tokens=48)[0]
  assert float(metrics["dense_loss"]) > 0
  assert float(value) == pytest.approx(float(base) + float(metrics["dense_loss"]), rel=1e-5)
  leaves = jax.tree.leaves(grads)
  assert all(np.isfinite(np.asarray(g)).all() for g in leaves)


def test_dense_alignment_needs_the_unmerged_row_length():
  with pytest.raises(ConfigError, match="data.tokens"):
    load_run_config(None, ["distill.dense_weight=1.0", "train.recipe=distill"])
