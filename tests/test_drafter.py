"""Verify mode's drafter as a run grows and trains it: where it starts (the micro decoder's first
layers, or the base's top layers) and its greedy-token term against a plain computation."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hamburger_jax import graft_checkpoint, pretrained
from hamburger_jax.config import ConfigError, GraftConfig, HamburgerConfig
from hamburger_jax.model.hamburger import Hamburger
from hamburger_jax.objectives.distillation import drafted_window, window_stats
from hamburger_jax.run_config import DistillConfig, RunConfig, TrainConfig
from hamburger_jax.testing import DECODE_CFG, DISTILL_GRAFT, tiny_distill_model


def _state(module) -> dict:
  return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}


@pytest.mark.parametrize("init", ["micro", "base_top"])
def test_a_grown_drafter_starts_where_asked(tmp_path, init):
  plain = tiny_distill_model()
  graft_checkpoint.save_graft(plain, str(tmp_path / "g"), "random", dtype="float32")
  cfg = HamburgerConfig(DECODE_CFG, dataclasses.replace(DISTILL_GRAFT, drafter_layers=2,
                                                         drafter_init=init))
  grown = Hamburger(cfg, rngs=nnx.Rngs(3), base=plain.base)
  pretrained.warm_start(grown, str(tmp_path / "g"))
  source = (plain.micro.decoder.layers[:2] if init == "micro"
            else plain.base.decoder.layers[-2:])
  for got, want in zip(grown.drafter.decoder.layers, source):
    a, b = _state(got), _state(want)
    assert set(a) <= set(b)  # the base's layers also hold their merged-entry adapters
    for path in a:
      np.testing.assert_array_equal(a[path], b[path], err_msg=str(path))
  a, b = _state(grown.drafter.stop_head), _state(plain.micro.stop_head)
  for path in a:  # the stop head is the micro decoder's either way
    np.testing.assert_array_equal(a[path], b[path], err_msg=str(path))
  with pytest.raises(ConfigError, match="drafter_init='fresh'"):
    GraftConfig(drafter_init="fresh")


def test_the_greedy_term_is_the_cross_entropy_of_the_teachers_top_1():
  model = tiny_distill_model()
  k, d, n = model.max_group, DECODE_CFG.hidden_size, 6
  rng = np.random.default_rng(0)
  feats = jnp.asarray(rng.normal(size=(n, model.num_features, d)), jnp.float32)
  top = jnp.asarray(rng.integers(0, DECODE_CFG.vocab_size, (n, k, 4)), jnp.int32)
  batch = {"window_ids": jnp.asarray(rng.integers(0, 90, (1, n, k)), jnp.int32),
           "window_size": jnp.full((1, n), k, jnp.int32), "teacher_topk_ids": top[None],
           "teacher_topk_logp": jnp.zeros((1, n, k, 4), jnp.float32)}
  w = window_stats(model, feats, batch, ce_chunk=8)
  logq = jax.nn.log_softmax(model.logits(w["h"]), axis=-1)  # [N, K, V]
  want = -np.take_along_axis(np.asarray(logq), np.asarray(top[..., :1]), axis=-1)[..., 0]
  np.testing.assert_allclose(np.asarray(w["greedy_ce"]), want, rtol=1e-5, atol=1e-5)


def test_a_drafter_with_a_micro_vocabulary_is_taught_on_it():
  """Steps 1.. over the reduced head: the teacher's top-k restricted to the vocabulary and
  renormalised, the greedy CE where the greedy token is in it, the draft its best id; step 0
  the base's own (agrees, adds nothing)."""
  model = tiny_distill_model()
  vocab_ids = np.arange(0, DECODE_CFG.vocab_size, 3)  # every third id
  model.set_micro_vocab(vocab_ids)
  k, d, n = model.max_group, DECODE_CFG.hidden_size, 5
  rng = np.random.default_rng(1)
  feats = jnp.asarray(rng.normal(size=(n, model.num_features, d)), jnp.float32)
  top = rng.integers(0, DECODE_CFG.vocab_size, (n, k, 4)).astype(np.int32)
  logp = np.sort(rng.normal(size=(n, k, 4)), axis=-1)[..., ::-1].astype(np.float32)
  batch = {"window_ids": jnp.asarray(rng.integers(0, 90, (1, n, k)), jnp.int32),
           "window_size": jnp.full((1, n), k, jnp.int32), "teacher_topk_ids": top[None],
           "teacher_topk_logp": logp[None]}
  w = window_stats(model, feats, batch, ce_chunk=8, drafting=True)
  full = np.asarray(model.logits(w["h"]))  # [N, K, V]; the reduced head's rows are these
  sub = full[..., vocab_ids]
  logq = sub - np.log(np.exp(sub - sub.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - sub.max(-1, keepdims=True)
  pos = {int(t): i for i, t in enumerate(vocab_ids)}
  for r in range(n):
    assert w["agree"][r, 0] and w["kl"][r, 0] == 0 and w["greedy_ce"][r, 0] == 0
    for i in range(1, k):
      assert int(w["argmax"][r, i]) == int(vocab_ids[np.argmax(sub[r, i])])
      inside = [j for j in range(4) if int(top[r, i, j]) in pos]
      if inside:
        p = np.exp(logp[r, i, inside] - np.logaddexp.reduce(logp[r, i, inside]))
        q = np.array([logq[r, i, pos[int(top[r, i, j])]] for j in inside])
        assert float(w["kl"][r, i]) == pytest.approx(float(np.sum(p * (np.log(p) - q))),
                                                     abs=1e-4)
      else:
        assert float(w["kl"][r, i]) == 0
      g = int(top[r, i, 0])
      want = -logq[r, i, pos[g]] if g in pos else 0.0
      assert float(w["greedy_ce"][r, i]) == pytest.approx(want, abs=1e-4)


def test_the_unrolled_window_is_what_decoding_drafts():
  """Training-time test: with distill.draft_unroll the drafter's steps read its own greedy
  drafts, exactly those the decode-time micro steps (one at a time, through the micro cache)
  draft from the same features and token 0 (the last draft is no step's input); the teacher's
  targets are untouched."""
  model = tiny_distill_model()
  model.set_micro_vocab(np.arange(0, DECODE_CFG.vocab_size, 3))
  k, d, n = model.max_group, DECODE_CFG.hidden_size, 6
  rng = np.random.default_rng(2)
  feats = jnp.asarray(rng.normal(size=(n, model.num_features, d)), jnp.float32)
  window = jnp.asarray(rng.integers(0, 90, (n, k)), jnp.int32)
  drafted = np.asarray(drafted_window(model, feats, window))
  cache = model.micro_cache(n, True)
  h, cache = model.micro_step(1, jnp.concatenate(
      [feats, model.base.embed(window[:, :1])], axis=1), cache, True)
  want = [np.asarray(window[:, 0])]
  for i in range(1, k):
    tok = model.micro_token(jnp.argmax(model.micro_logits(h), axis=-1))
    want.append(np.asarray(tok))
    if i < k - 1:
      h, cache = model.micro_step(i + 1, model.base.embed(tok[:, None]), cache, True)
  np.testing.assert_array_equal(drafted[:, :k - 1], np.stack(want, axis=1)[:, :k - 1])
  np.testing.assert_array_equal(drafted[:, -1], np.asarray(window[:, -1]))  # no step reads it
  assert (drafted[:, 1:k - 1] != np.asarray(window[:, 1:k - 1])).any()  # not the data's
  top = jnp.asarray(rng.integers(0, DECODE_CFG.vocab_size, (1, n, k, 4)), jnp.int32)
  batch = {"window_ids": window[None], "window_size": jnp.full((1, n), k, jnp.int32),
           "teacher_topk_ids": top, "teacher_topk_logp": jnp.zeros((1, n, k, 4), jnp.float32)}
  unrolled = window_stats(model, feats, batch, ce_chunk=8, drafting=True, unroll=True)
  on_drafts = window_stats(model, feats, {**batch, "window_ids": jnp.asarray(drafted)[None]},
                           ce_chunk=8, drafting=True)
  for name in ("kl", "greedy_ce", "argmax", "agree"):
    np.testing.assert_array_equal(np.asarray(unrolled[name]), np.asarray(on_drafts[name]))


def test_the_unroll_asks_for_the_drafter_and_its_reduced_head():
  model = tiny_distill_model()  # no micro vocabulary
  with pytest.raises(ValueError, match="train.micro_vocab"):
    drafted_window(model, jnp.zeros((2, model.num_features, DECODE_CFG.hidden_size)),
                   jnp.zeros((2, model.max_group), jnp.int32))
  with pytest.raises(ConfigError, match="draft_unroll"):
    RunConfig(train=TrainConfig(recipe="distill"), distill=DistillConfig(draft_unroll=True))
