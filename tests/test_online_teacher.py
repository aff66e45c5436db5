"""The teacher in the step: the online distill loss equals the loss on the same samples' stored
teacher signals (the data preparation's teacher pass), the token-id layout equals the stored
layout on single-turn samples and generalises it to several responses, and packing keeps every
sample once within a row's limits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hamburger_jax import layout, precision, segmentation
from hamburger_jax.data import teacher_pass
from hamburger_jax.data.tokens.online_batch import TokenSample, layout_row, pack_batch, pack_rows
from hamburger_jax.objectives.distillation import distill_loss, micro_distill_loss
from hamburger_jax.objectives.losses import chunked_topk
from hamburger_jax.model.hamburger import Hamburger
from hamburger_jax.objectives.online_teacher import with_teacher
from hamburger_jax.run_config import DistillConfig
from hamburger_jax.testing import DECODE_CFG, DISTILL_GRAFT, tiny_distill_model

CFG, GRAFT = DECODE_CFG, DISTILL_GRAFT
K, TOP = GRAFT.max_group, 6
SAMPLES = (([1, 5, 9, 33], [2, 1, 3, 1, 2]), ([7, 8], [1, 4, 2]), ([3, 4, 5], [4, 4, 1]))


@pytest.fixture(scope="module")
def model() -> Hamburger:
  return tiny_distill_model()


def _samples():
  rng = np.random.default_rng(1)
  return [(np.asarray(p, np.int32), rng.integers(3, CFG.vocab_size, sum(g)).astype(np.int32),
           np.asarray(g)) for p, g in SAMPLES]


def _token_sample(prompt, response, groups) -> TokenSample:
  starts = np.zeros(len(prompt) + len(response), bool)
  starts[len(prompt) + np.cumsum(groups) - groups] = True
  return TokenSample(np.concatenate([prompt, response]),
                     ((len(prompt), len(prompt) + len(response)),), starts)


def _stored_batch(model, samples, entries, groups):
  spec = segmentation.TeacherSpec(TOP, tuple(model.feature_layers))
  with precision.matmuls("highest"):
    stats = segmentation.response_token_stats(model.base, [(p, r) for p, r, _ in samples],
                                               teacher=spec)
  rows = []
  for (p, r, g), st in zip(samples, stats):
    sig = teacher_pass.teacher_signals(st, g)
    rows.append(layout.layout_sample(p, r, g, K, teacher={
        "topk_ids": sig["teacher_topk_ids"], "topk_logp": sig["teacher_topk_logp"],
        "features": sig["teacher_features"]}))
  return layout.pack_rows([rows[:2], rows[2:]], entries, groups, K).as_dict()


@pytest.mark.parametrize("loss_fn,stop_target", [(distill_loss, "teacher"),
                                                   (distill_loss, "harm"),
                                                   (micro_distill_loss, "segments")])
def test_online_loss_equals_stored_loss(model, loss_fn, stop_target):
  samples = _samples()
  entries, groups, tokens = 24, 10, 32
  stored = _stored_batch(model, samples, entries, groups)
  ts = [_token_sample(*s) for s in samples]
  online = pack_batch([ts[:2], ts[2:]], tokens=tokens, entries=entries, groups=groups,
                      max_group=K)
  for name, v in online.items():  # HAMburger's fields are the stored layout's, exactly
    if name in stored:
      np.testing.assert_array_equal(v, stored[name], err_msg=name)
  cfg = DistillConfig(stop_target=stop_target)
  with precision.matmuls("highest"):
    want = loss_fn(model, {k: jnp.asarray(v) for k, v in stored.items()}, cfg, ce_chunk=7)
    batch = with_teacher(model, {k: jnp.asarray(v) for k, v in online.items()}, TOP, chunk=7)
    got = jax.jit(lambda b: loss_fn(model, b, cfg, ce_chunk=7))(batch)
  np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5, atol=1e-5)
  for name in ("kl", "stop_bce", "agree_s1", "agree_s2", "tf_tokens_per_step_c50"):
    np.testing.assert_allclose(float(got[1][name]), float(want[1][name]), rtol=1e-5,
                               atol=1e-5, err_msg=name)
  valid = stored["window_size"][..., None] > np.arange(K)  # past a window: nothing is read
  np.testing.assert_array_equal(np.asarray(batch["teacher_topk_ids"])[valid],
                                stored["teacher_topk_ids"][valid])


def test_several_responses_in_one_sample():
  """A two-turn sample: template and user tokens are one entry each, each response is smashed
  into its groups, a group is predicted by the entry before it, windows stop at their
  response's end, and positions are the groups' last tokens'."""
  tokens = np.arange(10, 26, dtype=np.int32)  # 16 tokens
  spans = ((3, 8), (11, 14))  # responses of 5 and 3 tokens
  starts = np.zeros(16, bool)
  starts[[3, 5, 6, 11, 13]] = True  # groups [2, 1, 2] and [2, 1]
  row = layout_row([TokenSample(tokens, spans, starts)], K)
  np.testing.assert_array_equal(row["input_size"], [1, 1, 1, 2, 1, 2, 1, 1, 1, 2, 1, 1, 1])
  np.testing.assert_array_equal(row["positions"], [0, 1, 2, 4, 5, 7, 8, 9, 10, 12, 13, 14, 15])
  np.testing.assert_array_equal(row["pred_index"], [2, 3, 4, 8, 9])
  np.testing.assert_array_equal(row["target_size"], [2, 1, 2, 2, 1])
  np.testing.assert_array_equal(row["window_size"], [4, 3, 2, 3, 1])
  np.testing.assert_array_equal(row["window_ids"][0], tokens[3:7])
  np.testing.assert_array_equal(row["window_ids"][3], [tokens[11], tokens[12], tokens[13], 0])
  np.testing.assert_array_equal(row["teacher_index"][:, 0], [2, 4, 5, 10, 12])
  np.testing.assert_array_equal(row["teacher_index"][3, :3], [10, 11, 12])


def test_packing_keeps_each_sample_once_within_limits():
  rng = np.random.default_rng(0)
  samples = []
  for i in range(60):
    p, r = int(rng.integers(1, 12)), int(rng.integers(1, 30))
    tok = np.full(p + r, i, np.int32)  # the sample's index, to find it again
    starts = rng.random(p + r) < 0.5
    starts[::K] = True  # groups of at most K
    samples.append(TokenSample(tok, ((p, p + r),), starts))
  limits = dict(tokens=48, entries=40, groups=24)
  seen = []
  for rows in pack_rows(samples, rows=3, **limits):
    batch = pack_batch(rows, max_group=K, **limits)
    for r, row in enumerate(rows):
      t, e, g = map(sum, zip(*(s.size() for s in row))) if row else (0, 0, 0)
      assert t <= 48 and e <= 40 and g <= 24
      assert (batch["token_segment"][r] > 0).sum() == t
      assert (batch["input_size"][r] > 0).sum() == e and (batch["window_size"][r] > 0).sum() == g
      seen += [int(s.tokens[0]) for s in row]
  assert sorted(seen) == list(range(60))
  big = TokenSample(np.zeros(60, np.int32), ((1, 60),), np.ones(60, bool))
  with pytest.raises(layout.LayoutError, match="more than a row"):
    list(pack_rows([big], rows=2, **limits))
  # Given somewhere to put them, samples larger than a row are left out and the rest packed.
  left: list[TokenSample] = []
  packed = [s for rows in pack_rows([samples[0], big, samples[1]], rows=2, oversize=left.append,
                                    **limits) for row in rows for s in row]
  assert left == [big] and packed == [samples[0], samples[1]]


def _topk(logits, k, select_dtype):
  """chunked_topk of logits given as hidden states through an identity head."""
  v = logits.shape[-1]
  return chunked_topk(logits, jnp.eye(v), k, chunk=3, select_dtype=select_dtype)


def test_bf16_selection_equals_f32_without_near_ties():
  # Logits 0.25 apart in [-16, 16): bfloat16's spacing there is at most 0.125, so no ties.
  rng = np.random.default_rng(0)
  logits = jnp.asarray(np.stack([rng.permutation(128) * 0.25 - 16 for _ in range(5)]),
                       jnp.float32)
  want = _topk(logits, TOP, jnp.float32)
  got = _topk(logits, TOP, jnp.bfloat16)
  np.testing.assert_array_equal(got[1], want[1])
  np.testing.assert_array_equal(got[0], want[0])
  np.testing.assert_array_equal(want[1], np.argsort(-np.asarray(logits), axis=1)[:, :TOP])


def test_bf16_selection_with_ties_keeps_f32_values_in_order():
  keys = jax.random.split(jax.random.key(3))
  logits = 8 * jax.random.normal(keys[0], (6, 512))
  # 20 logits a row at 30 +- 0.03: one value in bfloat16 (0.125 apart there), the top k's.
  logits = logits.at[:, 100:120].set(30 + 0.01 * jax.random.normal(keys[1], (6, 20)))
  logp, ids = _topk(logits, TOP, jnp.bfloat16)
  logp, ids, x = np.asarray(logp), np.asarray(ids), np.asarray(logits)
  want = x - np.asarray(jax.nn.logsumexp(logits, axis=-1, keepdims=True))
  np.testing.assert_allclose(logp, np.take_along_axis(want, ids, 1), rtol=0, atol=1e-6)
  assert (np.diff(logp, axis=1) <= 0).all()  # by decreasing float32 probability
  for row, chosen in zip(x, ids):  # float32's top k up to ties in bfloat16 at the k-th value
    left = np.delete(row, chosen)
    bf16 = lambda a: np.asarray(jnp.asarray(a).astype(jnp.bfloat16), np.float32)
    assert bf16(row[chosen]).min() >= bf16(left).max()


def test_bf16_selection_changes_the_online_loss_little(model):
  samples = _samples()
  ts = [_token_sample(*s) for s in samples]
  online = pack_batch([ts[:2], ts[2:]], tokens=32, entries=24, groups=10, max_group=K)
  batch = {k: jnp.asarray(v) for k, v in online.items()}
  cfg = DistillConfig()
  loss = {}
  for dt in (jnp.float32, jnp.bfloat16):
    taught = with_teacher(model, batch, TOP, chunk=7, select_dtype=dt)
    loss[dt] = float(distill_loss(model, taught, cfg, ce_chunk=7)[0])
  np.testing.assert_allclose(loss[jnp.bfloat16], loss[jnp.float32], rtol=1e-3)
