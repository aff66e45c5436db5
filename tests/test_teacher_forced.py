"""The teacher-forced evaluator (hamburger_jax.evaluation.teacher_forced): the items each metric
is pooled over, on a batch written by hand; the pooling rule on known totals; and the pooled
metrics of the tiny random model against a NumPy computation of the per-token losses, whatever
the packing. That the trainer and infer.eval report its numbers is tested in test_eval_cli.py."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from hamburger_jax import pretrained
from hamburger_jax.objectives.distillation import TRACKED_CONFIDENCES, confidence_tag
from hamburger_jax.evaluation import teacher_forced
from hamburger_jax.model.llama import causal_segment_mask
from hamburger_jax.run_config import load_run_config

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")


def _hand_batch() -> dict[str, np.ndarray]:
  """One row, K = 4, three groups: group 0 (3 tokens, window 4) predicted from a merged entry
  (2 tokens), group 1 (1 token, window 2) from a single-token entry, group 2 padding."""
  return {"target_size": np.array([[3, 1, 0]]), "window_size": np.array([[4, 2, 0]]),
          "input_size": np.array([[2, 1, 3, 0]]), "pred_index": np.array([[0, 1, 2]])}


def test_item_counts_of_a_hand_written_batch():
  counts = lambda recipe, stop="teacher": {
      k: int(v) for k, v in teacher_forced.item_counts(_hand_batch(), 4, recipe, stop).items()}
  paper = counts("paper")
  assert {n: paper[n] for n in ("loss", "lm_loss", "stop_bce", "stop_acc")} == dict.fromkeys(
      ("loss", "lm_loss", "stop_bce", "stop_acc"), 3 + 1)
  assert [paper[f"acc_s{i}"] for i in range(1, 5)] == [2, 1, 1, 0]
  # Agreement is over the teacher's windows, whatever the recipe.
  assert [paper[f"agree_s{i}"] for i in range(1, 5)] == [2, 2, 1, 1]
  assert (paper["agree_merged"], paper["agree_unmerged"], paper["feature_loss"]) == (1, 1, 1)
  distill = counts("distill")
  assert (distill["lm_loss"], distill["kl"], distill["stop_acc"]) == (4 + 2, 6, 6)
  assert [distill[f"acc_s{i}"] for i in range(1, 5)] == [2, 2, 1, 1]
  # stop_target "segments" labels only the window tokens inside the group: min(4, 3) + min(2, 1).
  assert counts("distill", "segments")["stop_bce"] == 3 + 1
  with pytest.raises(ValueError, match="use one of paper, distill"):
    teacher_forced.item_counts(_hand_batch(), 4, "sft")


def _acceptance_counts(groups: float, emitted: float, accepted: float, agree: float):
  return {f"n_tf_{name}_{confidence_tag(c)}": v for c in TRACKED_CONFIDENCES
          for name, v in (("groups", groups), ("emitted", emitted), ("accepted", accepted),
                          ("accepted_agree", agree))}


def test_pool_divides_summed_values_by_summed_items():
  pool = teacher_forced.Pool()
  # lm_loss: a mean of 2.0 over 3 tokens, then 5.0 over 1 token; acc_s4: no items at all.
  pool.add({"sums": {"lm_loss": 6.0, "acc_s4": 0.0}, "items": {"lm_loss": 3, "acc_s4": 0},
            "counts": _acceptance_counts(4, 6, 2, 1)})
  pool.add({"sums": {"lm_loss": 5.0, "acc_s4": 0.0}, "items": {"lm_loss": 1, "acc_s4": 0},
            "counts": _acceptance_counts(2, 2, 0, 0)})
  out = pool.result()
  assert out["lm_loss"] == pytest.approx(11 / 4)  # not (2 + 5) / 2, the mean of batch means
  assert out["acc_s4"] is None  # undefined, not 0
  assert pool.items["lm_loss"] == 4
  assert out["n_tf_groups_c80"] == 6 and out["n_tf_accepted_c80"] == 2
  assert out["tf_tokens_per_step_c80"] == pytest.approx(8 / 6)  # a ratio of the sums
  assert out["tf_accepted_agree_c80"] == pytest.approx(1 / 2)
  idle = teacher_forced.Pool()
  idle.add({"sums": {}, "items": {}, "counts": _acceptance_counts(3, 3, 0, 0)})
  assert idle.result()["tf_accepted_agree_c50"] is None  # nothing accepted: no share


@pytest.fixture(scope="module")
def tiny(tiny_data_dir: str):
  model, _ = pretrained.build_run_model(load_run_config(TINY))
  return model, teacher_forced.read_records(tiny_data_dir, "validation", model.max_group, 5)


def _hand_sums(model, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Per-token CE, argmax hits and stop BCE / hits of one batch in NumPy (float64) from the
  model's micro-step hidden states, summed per metric; and their token counts."""
  ids, size = batch["input_ids"], batch["input_size"]
  feats, _ = model.base_features(model.smash(ids, size), batch["positions"],
                                 causal_segment_mask(batch["segment_ids"]), merged_bt=size >= 2)
  feats = feats[np.arange(ids.shape[0])[:, None], batch["pred_index"]]
  b, g, f, d = feats.shape
  k = model.max_group
  targets = batch["target_ids"].reshape(b * g, k)
  h = model.micro_hidden(feats.reshape(b * g, f, d), targets)
  stop = np.asarray(model.stop_logits(h), np.float64)
  logits = np.asarray(h, np.float64) @ np.asarray(model.base.head_dv(), np.float64)
  logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)
                         ) - logits.max(-1, keepdims=True)
  ce = -np.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  hit = logits.argmax(-1) == targets
  sizes = np.minimum(batch["target_size"].reshape(-1), k)
  valid = np.arange(k)[None, :] < sizes[:, None]
  last = np.arange(k)[None, :] == sizes[:, None] - 1  # stop after the group's last token
  bce = np.maximum(stop, 0) - stop * last + np.log1p(np.exp(-np.abs(stop)))
  return {"ce": (ce * valid).sum(), "stop_bce": (bce * valid).sum(),
          "stop_hit": (((stop > 0) == last) & valid).sum(), "tokens": valid.sum(),
          "hits": (hit & valid).sum(0), "steps": valid.sum(0)}


def test_evaluate_matches_a_hand_computation(tiny):
  model, records = tiny
  k = model.max_group
  batches = list(teacher_forced.split_batches(records, k, 1))
  assert len(batches) > 1
  hand = [_hand_sums(model, b) for b in batches]
  total = lambda name: sum(h[name] for h in hand)
  got = teacher_forced.evaluate(model, batches).result()
  tokens = total("tokens")
  assert got["lm_loss"] == pytest.approx(total("ce") / tokens, rel=1e-5)
  assert got["stop_bce"] == pytest.approx(total("stop_bce") / tokens, rel=1e-5)
  assert got["stop_acc"] == pytest.approx(total("stop_hit") / tokens, rel=1e-5)
  assert got["loss"] == pytest.approx((total("ce") + 0.5 * total("stop_bce")) / tokens, rel=1e-5)
  hits, steps = total("hits"), total("steps")
  for i in range(k):  # micro step i + 1: over the groups that have that token
    assert got[f"acc_s{i + 1}"] == pytest.approx(hits[i] / steps[i], rel=1e-5)
  # Batches hold different numbers of tokens: the mean of the batch means would differ.
  assert abs(np.mean([h["ce"] / h["tokens"] for h in hand]) - got["lm_loss"]) > 1e-4


def test_packing_does_not_change_the_numbers(tiny):
  model, records = tiny
  one = teacher_forced.evaluate(model, teacher_forced.split_batches(records, 4, 1)).result()
  five = teacher_forced.evaluate(model, teacher_forced.split_batches(records, 4, 5)).result()
  assert one.keys() == five.keys()
  for name, value in one.items():
    assert five[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name


def test_a_metric_without_a_pooling_rule_is_refused(tiny):
  model, records = tiny
  batch = next(iter(teacher_forced.split_batches(records, 4, 2)))
  odd = lambda m, b: (0.0, {"perplexity": jax.numpy.float32(1.0)})
  with pytest.raises(KeyError, match="'perplexity' has no pooling rule"):
    teacher_forced.batch_totals(model, batch, loss_fn=odd)
