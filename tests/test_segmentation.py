"""Segmentation strategies on hand-made entropies, and batched entropies vs a NumPy reference."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hamburger_jax import segmentation as seg
from hamburger_jax.config import LlamaConfig
from hamburger_jax.model.llama import Llama

K = 4


# ----------------------------------------------------------------------------- decreasing_v2


def test_decreasing_v2_first_token_opens_group_even_if_certain():
  assert seg.decreasing_v2([0.01], K) == [1]
  assert seg.decreasing_v2([0.01, 0.01], K) == [2]


def test_decreasing_v2_min_threshold_rule():
  # 0.04 < 0.05 joins however large the group's max is relative to it; 0.06 does not join a
  # group whose max is 0.1 (0.06 >= 0.3 * 0.1).
  assert seg.decreasing_v2([0.1, 0.04, 0.06], K) == [2, 1]
  assert seg.decreasing_v2([0.1, 0.049, 0.0499], K) == [3]


def test_decreasing_v2_ratio_rule_uses_the_groups_max():
  # 2.0 opens; 0.59 < 0.6 joins; 0.61 >= 0.6 opens a new group.
  assert seg.decreasing_v2([2.0, 0.59, 0.61], K) == [2, 1]
  # The max is over the group's current members: after 1.0 opens and 0.2 joins, 0.29 < 0.3
  # joins (max stays 1.0); a group opened by 0.5 rejects 0.16 (>= 0.15).
  assert seg.decreasing_v2([1.0, 0.2, 0.29], K) == [3]
  assert seg.decreasing_v2([0.5, 0.16], K) == [1, 1]


def test_decreasing_v2_a_joined_token_can_raise_the_max():
  # 0.04 joins through the min rule and is below the max; rising entropies never join:
  # every token opens its own group.
  assert seg.decreasing_v2([0.01, 0.02, 0.03, 0.2], K) == [3, 1]
  assert seg.decreasing_v2([0.1, 0.2, 0.3, 0.4], K) == [1, 1, 1, 1]


def test_decreasing_v2_caps_groups_at_k():
  assert seg.decreasing_v2([0.0] * 10, K) == [4, 4, 2]
  assert seg.decreasing_v2([3.0] + [0.0] * 4, K) == [4, 1]
  assert seg.decreasing_v2([0.0] * 5, 1) == [1] * 5


def test_decreasing_v2_matches_the_release_loop():
  def release(entropy, max_steps, min_threshold=0.05, ratio_threshold=0.3):
    steps, last_cnt, last_max = [], 0, -1
    for e in entropy:
      if (e < min_threshold or e < last_max * ratio_threshold) and last_cnt < max_steps:
        last_cnt += 1
        last_max = max(last_max, e)
      else:
        if last_cnt > 0:
          steps.append(last_cnt)
        last_cnt, last_max = 1, e
    if last_cnt > 0:
      steps.append(last_cnt)
    return steps

  rng = np.random.default_rng(0)
  for _ in range(200):
    e = rng.exponential(0.3, size=int(rng.integers(1, 40))) * (rng.random(1) < 0.5)
    assert seg.decreasing_v2(e, K) == release(list(e), K)


@pytest.mark.parametrize("name", ["decreasing_v2", "sliding", "small_group", "fixed:1",
                                  "fixed:3"])
def test_strategies_sum_to_length_and_respect_k(name):
  rng = np.random.default_rng(1)
  fn = seg.get_strategy(name)
  for n in (1, 2, 7, 33):
    e = rng.exponential(0.4, size=n)
    sizes = fn(e, K)
    assert sum(sizes) == n and min(sizes) >= 1 and max(sizes) <= K


def test_small_group_caps_at_two():
  assert seg.small_group([0.0] * 5, K) == [2, 2, 1]
  assert seg.small_group([0.0] * 3, 1) == [1, 1, 1]


def test_fixed():
  assert seg.get_strategy("fixed:3")(np.zeros(7), K) == [3, 3, 1]
  assert seg.get_strategy("fixed:2")(np.zeros(4), K) == [2, 2]
  with pytest.raises(seg.SegmentationError, match="max_group"):
    seg.get_strategy("fixed:5")(np.zeros(4), K)


def test_sliding_threshold_is_binary_entropy_of_0_7():
  h = -(0.7 * math.log(0.7) + 0.3 * math.log(0.3))
  assert seg.SLIDING_THRESHOLD == pytest.approx(h)
  assert seg.sliding([5.0, h - 1e-6, h + 1e-6, 0.0, 0.0, 0.0, 0.0], K) == [2, 4, 1]


@pytest.mark.parametrize("name", ["nope", "decreasing", "fixed"])
def test_unknown_strategy_is_an_error_listing_valid_names(name):
  with pytest.raises(seg.SegmentationError, match="valid strategies are: decreasing_v2, fixed:k"):
    seg.get_strategy(name)


@pytest.mark.parametrize("name", ["fixed:", "fixed:x", "fixed:0"])
def test_fixed_needs_a_positive_k(name):
  with pytest.raises(seg.SegmentationError, match="positive integer"):
    seg.get_strategy(name)


# ----------------------------------------------------------------------------- entropies


def _tiny_model() -> Llama:
  cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2)
  return Llama(cfg, rngs=nnx.Rngs(0))


def _numpy_entropies(model: Llama, seqs: list[np.ndarray]) -> list[np.ndarray]:
  """Entropy at every position of each sequence, in float64 NumPy from the model's logits.

  One sequence per row, right-padded: causal attention keeps padding out of earlier positions,
  and one call (one compilation) serves all sequences.
  """
  t = max(len(x) for x in seqs)
  ids = np.zeros((len(seqs), t), np.int32)
  for i, x in enumerate(seqs):
    ids[i, :len(x)] = x
  forward = jax.jit(lambda g, s, x: nnx.merge(g, s)(x))
  logits = np.asarray(forward(*nnx.split(model), jnp.asarray(ids)), np.float64)
  logits = logits - logits.max(-1, keepdims=True)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  ent = -(np.exp(logp) * logp).sum(-1)
  return [ent[i, :len(x)] for i, x in enumerate(seqs)]


def test_response_entropies_match_numpy_with_padding_and_buckets():
  model = _tiny_model()
  rng = np.random.default_rng(0)
  # Lengths span two buckets of 16 and batches of 64 // length rows, so most rows are padded.
  shapes = [(5, 7), (3, 20), (10, 2), (1, 1), (4, 4), (2, 9)]
  samples = [(rng.integers(0, 128, p), rng.integers(0, 128, r)) for p, r in shapes]
  seen = []
  # Rows of 32 tokens (the longest sample, 23, rounded up to 16s), two rows a pass: several
  # samples share a row, and rows and passes end in padding.
  got = seg.response_entropies(model, samples, batch_tokens=64, bucket=16, progress=seen.append)
  assert sum(seen) == len(samples)
  refs = _numpy_entropies(model, [np.concatenate([p, r]) for p, r in samples])
  for (p, r), e, ref in zip(samples, got, refs):
    ref = ref[len(p) - 1:len(p) - 1 + len(r)]
    assert e.dtype == np.float32 and e.shape == (len(r),)
    np.testing.assert_allclose(e, ref, atol=1e-4)


def test_response_entropies_row_len_must_hold_every_sample():
  with pytest.raises(seg.SegmentationError, match="row_len"):
    seg.response_entropies(_tiny_model(), [([1, 2], [3, 4, 5])], row_len=4)
  assert seg.response_entropies(_tiny_model(), []) == []


def test_position_entropies_with_packed_segments():
  model = _tiny_model()
  rng = np.random.default_rng(1)
  a, b = rng.integers(0, 128, 6), rng.integers(0, 128, 5)
  ids = np.zeros((1, 16), np.int32)
  segment_ids = np.zeros((1, 16), np.int32)
  ids[0, :6], ids[0, 6:11] = a, b
  segment_ids[0, :6], segment_ids[0, 6:11] = 1, 2
  got = seg.position_entropies(model, ids, segment_ids)[0]
  ref_a, ref_b = _numpy_entropies(model, [a, b])
  np.testing.assert_allclose(got[:6], ref_a, atol=1e-4)
  np.testing.assert_allclose(got[6:11], ref_b, atol=1e-4)


def test_segment_positions_restart_per_segment():
  s = jnp.asarray([[1, 1, 1, 2, 2, 0, 0], [1, 2, 2, 2, 3, 3, 0]])
  np.testing.assert_array_equal(seg.segment_positions(s),
                                [[0, 1, 2, 0, 1, 0, 1], [0, 0, 1, 2, 0, 1, 0]])


def test_confident_strategy_on_hand_made_probabilities():
  p = [0.1, 0.9, 0.6, 0.59, 0.99, 0.99, 0.99, 0.99, 0.2]
  assert seg.confident(p, K, 0.6) == [3, 4, 1, 1]  # 0.59 opens a group; the K cap splits
  assert seg.confident(p, K, 1.0) == [1] * len(p)
  strategy = seg.get_strategy("confident:0.6")
  assert strategy.reads == "prob" and strategy(p, K) == [3, 4, 1, 1]
  assert seg.get_strategy("decreasing_v2").reads == "entropy"
  for bad in ("confident:0", "confident:1.5", "confident:x"):
    with pytest.raises(seg.SegmentationError, match="probability in"):
      seg.get_strategy(bad)


def test_given_with_a_fallback():
  p = [0.1, 0.9, 0.6, 0.59, 0.99, 0.99, 0.99, 0.99, 0.2]
  strategy = seg.get_strategy("given:confident:0.6")
  assert strategy.reads == "given" and seg.get_strategy("given").fallback is None
  assert strategy.fallback.reads == "prob" and strategy.fallback(p, K) == [3, 4, 1, 1]
  for bad, match in (("given:given", "must segment by the base's statistics"),
                     ("given:confident:2", "probability in"), ("given:", "unknown")):
    with pytest.raises(seg.SegmentationError, match=match):
      seg.get_strategy(bad)


def test_token_probabilities_match_numpy():
  model = _tiny_model()
  rng = np.random.default_rng(2)
  samples = [(rng.integers(0, 128, p), rng.integers(0, 128, r)) for p, r in [(4, 6), (2, 9)]]
  stats = seg.response_token_stats(model, samples, batch_tokens=64, bucket=16)
  for (p, r), st in zip(samples, stats):
    seq = np.concatenate([p, r])
    logits = np.asarray(model(jnp.asarray(seq)[None]))[0].astype(np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want = probs[np.arange(len(p) - 1, len(seq) - 1), r]
    np.testing.assert_allclose(st.prob, want, atol=1e-5)


def test_pack_pass_lays_each_rows_samples_one_after_another():
  seqs = [np.array([5, 6, 7]), np.array([8]), np.array([9, 10])]
  ids, segment_ids, placed = seg.pack_pass([[0, 1], [2]], seqs.__getitem__, 3, 4)
  assert ids.tolist() == [[5, 6, 7, 8], [9, 10, 0, 0], [0, 0, 0, 0]]
  assert segment_ids.tolist() == [[1, 1, 1, 2], [1, 1, 0, 0], [0, 0, 0, 0]]
  assert placed == [(0, 0, 0), (1, 0, 3), (2, 1, 0)]
  assert ids.dtype == segment_ids.dtype == np.int32
