"""Teacher-forced evaluation of HAMburger on packed batches: the one evaluator behind the
trainer's validation (`Trainer.evaluate`) and `infer.eval --tasks nll`.

Pooling rule, the same for every metric: a batch reports each metric as a mean over its own
items (tokens of some kind, or groups); the split's value is the sum of the per-item values over
the split divided by the number of those items over the split, i.e. every batch mean weighted
by the number of items it averaged. Packing (rows per batch, shapes, padding) therefore does
not change the numbers, and a batch with few of a metric's items weighs little for it. A metric
with no items in the whole split is None (undefined, not 0).

The items of each metric:

  paper recipe (losses.hamburger_loss; each predicted group's own tokens)
    loss, lm_loss, stop_bce, stop_acc  the groups' tokens (the response tokens)
    acc_s{i}                           the groups with an i-th token
  distill recipe (distillation.distill_loss / micro_distill_loss; each group's window, the up
  to K tokens from its first, as the teacher saw them)
    loss, kl, lm_loss, greedy_ce       the windows' tokens
    stop_bce, stop_acc, continue_rate  the window tokens with a stop label (all of them; for
                                       distill.stop_target "segments" those inside the group)
    acc_s{i}, agree_s{i}               the windows with an i-th token
    agree_merged, feature_loss,        the windows predicted from a merged entry
    dense_loss
    agree_unmerged                     the other windows
  counts n_* (distillation.acceptance's n_tf_*)  summed over the split
  ratios tf_*                          recomputed from the summed counts (acceptance_metrics):
                                       ratios of sums, as above

The distill loss adds a feature term averaged over merged windows to token means; it is pooled
by the window tokens like its other terms. On data with teacher signals the paper recipe also
reports distill_loss's agree_*, n_tf_* and tf_* (one yardstick for every recipe), pooled as the
distill rows say.
"""

from __future__ import annotations

import collections
import sys
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from hamburger_jax.data import pipeline
from hamburger_jax.data.teacher_pass import base_fingerprint
from hamburger_jax.objectives.distillation import (acceptance_metrics, distill_loss,
                                                    micro_distill_loss)
from hamburger_jax.objectives.losses import chunked_cross_entropy, hamburger_loss
from hamburger_jax.model.llama import causal_segment_mask
from hamburger_jax.run_config import RECIPES, DistillConfig

LossFn = Callable[[Any, Mapping[str, jax.Array]], tuple[jax.Array, dict[str, jax.Array]]]
# Batch-level counts of the losses, not metrics: the pooled items replace them.
SKIPPED = ("tokens", "groups")
# The metrics of distill_loss that every recipe reports on data with teacher signals.
TEACHER_PREFIXES = ("agree_", "tf_", "n_tf_")


class SplitError(ValueError):
  """The split cannot be evaluated as asked (no such split, or data for a larger K)."""


def item_counts(batch: Mapping[str, Any], max_group: int, recipe: str = "paper",
                stop_target: str = "teacher") -> dict[str, jax.Array]:
  """How many items each metric's batch mean averages (the module docstring's table), computed
  from the batch; traceable, so that a sharded batch counts its global items."""
  if recipe not in RECIPES:
    raise ValueError(f"recipe={recipe!r}: use one of {', '.join(RECIPES)}")
  k = max_group
  target = jnp.minimum(jnp.asarray(batch["target_size"]), k)
  window = jnp.minimum(jnp.asarray(batch["window_size"]), k)
  rows = jnp.arange(target.shape[0])[:, None]
  from_merged = (jnp.asarray(batch["input_size"])[rows, jnp.asarray(batch["pred_index"])] >= 2
                 ) & (window > 0)
  steps = lambda sizes: {i: jnp.sum(sizes >= i) for i in range(1, k + 1)}
  window_steps = steps(window)
  counts = {"agree_merged": jnp.sum(from_merged), "feature_loss": jnp.sum(from_merged),
            # dense_loss averages the merged windows that fit the unmerged rows: almost all
            "dense_loss": jnp.sum(from_merged),
            "agree_unmerged": jnp.sum((window > 0) & ~from_merged),
            **{f"agree_s{i}": n for i, n in window_steps.items()}}
  if recipe == "paper":
    tokens = jnp.sum(target)
    counts.update({name: tokens for name in ("loss", "lm_loss", "stop_bce", "stop_acc")})
    counts.update({f"acc_s{i}": n for i, n in steps(target).items()})
  else:
    tokens = jnp.sum(window)
    stop = jnp.sum(jnp.minimum(window, target)) if stop_target == "segments" else tokens
    counts.update({name: tokens for name in ("loss", "kl", "lm_loss", "greedy_ce")})
    counts.update({name: stop for name in ("stop_bce", "stop_acc", "continue_rate")})
    counts.update({f"acc_s{i}": n for i, n in window_steps.items()})
  return counts


def batch_totals(model, batch: Mapping[str, jax.Array], *, recipe: str = "paper",
                 loss_fn: LossFn | None = None, distill: DistillConfig | None = None,
                 ce_chunk: int = 1024, yardstick: bool = True) -> dict[str, dict[str, jax.Array]]:
  """One batch's metrics as what pools: {"sums": per-item values summed, "items": their counts,
  "counts": the n_* counts}. Traceable (the caller jits it, sharded or not).

  `loss_fn(model, batch) -> (loss, metrics)` gives the recipe's metrics (default: the recipe's
  loss, hamburger_loss or distill_loss); on data with teacher signals distill_loss adds its
  agreement and acceptance metrics where the loss has none (`yardstick`: False for a loss whose
  own agreement is the one that means something, verify mode's drafter's)."""
  distill = distill or DistillConfig()
  if loss_fn is None:
    loss_fn = ((lambda m, b: hamburger_loss(m, b, ce_chunk)) if recipe == "paper" else
               (lambda m, b: distill_loss(m, b, distill, ce_chunk)))
  _, metrics = loss_fn(model, batch)
  metrics = dict(metrics)
  if yardstick and "teacher_features" in batch and "agree_merged" not in metrics:
    _, full = distill_loss(model, batch, distill, ce_chunk)
    metrics.update({k: v for k, v in full.items() if k.startswith(TEACHER_PREFIXES)})
  items = item_counts(batch, model.max_group, recipe, distill.stop_target)
  out = {"sums": {}, "items": {}, "counts": {}}
  for name, value in metrics.items():
    if name in SKIPPED or name.startswith("tf_"):  # tf_*: ratios, retaken from summed counts
      continue
    if name.startswith("n_"):
      out["counts"][name] = value
      continue
    if name not in items:
      raise KeyError(f"metric {name!r} has no pooling rule: give its items in item_counts")
    n = items[name].astype(jnp.float32)
    # The losses divide by max(n, 1): times n gives back the sum (0 where there are no items).
    out["sums"][name] = value.astype(jnp.float32) * n
    out["items"][name] = n
  return out


class Pool:
  """Batch totals summed over a split; `result()` applies the pooling rule."""

  def __init__(self):
    self.sums: dict[str, float] = collections.defaultdict(float)
    self.items: dict[str, float] = collections.defaultdict(float)
    self.counts: dict[str, float] = collections.defaultdict(float)

  def add(self, totals: Mapping[str, Mapping[str, Any]]) -> None:
    totals = jax.device_get(totals)
    for part, acc in (("sums", self.sums), ("items", self.items), ("counts", self.counts)):
      for name, value in totals[part].items():
        acc[name] += float(value)

  def result(self) -> dict[str, float | None]:
    """Every metric pooled by the rule; None where the split has none of its items."""
    out: dict[str, float | None] = {
        name: self.sums[name] / n if n else None for name, n in self.items.items()}
    if self.counts:
      out.update(self.counts)
      counts = dict(self.counts)
      for name, value in acceptance_metrics(counts).items():
        tag = name.rsplit("_", 1)[1]
        per = "groups" if name.startswith("tf_tokens_per_step_") else "accepted"
        out[name] = float(value) if counts.get(f"n_tf_{per}_{tag}") else None
    return out


def evaluate(model, batches: Iterable[Mapping[str, np.ndarray]], *, recipe: str = "paper",
             loss_fn: LossFn | None = None, distill: DistillConfig | None = None,
             ce_chunk: int = 1024, bar=None, yardstick: bool = True) -> Pool:
  """`batch_totals` of every batch (on the default device), pooled; `bar` counts batches."""
  graphdef, state = nnx.split(model)

  # Jitted per call, not once: a caller may change how the model traces between calls
  # (infer.experiments.ablate_merged swaps the merged-entry forward).
  @jax.jit
  def totals(state, batch):
    return batch_totals(nnx.merge(graphdef, state), batch, recipe=recipe, loss_fn=loss_fn,
                        distill=distill, ce_chunk=ce_chunk, yardstick=yardstick)

  pool = Pool()
  for b in batches:
    pool.add(totals(state, b))
    if bar is not None:
      bar.update(1)
  return pool


# ----------------------------------------------------------------------------- a tfds split


def read_records(data_dir: str, split: str, max_group: int,
                 limit: int | None = None) -> list[dict[str, Any]]:
  """The first `limit` records (all by default) of a split written by train.prepare_data."""
  try:
    source = pipeline.open_split(data_dir, split, max_group)
  except ValueError as e:  # no such split, or segmented for a larger max_group
    raise SplitError(str(e)) from None
  return [source[i] for i in range(min(limit or len(source), len(source)))]


def split_batches(records: Sequence[Mapping[str, Any]], max_group: int, batch: int,
                  position_offset: int = 0):
  """The records in file order as packed training-layout batches of `batch` rows, shaped to fit
  the largest record (rounded up to a multiple of 16, so that few shapes compile), merged
  entries at the model's `position_offset`."""
  layouts = [pipeline.record_layout(r, max_group, position_offset) for r in records]
  round_up = lambda n, m: -(-n // m) * m
  entries = round_up(max(lay.num_entries for lay in layouts), 16)
  groups = round_up(max(lay.num_groups for lay in layouts), 16)
  return pipeline.packed_dataset(records, batch_rows=batch, entries=entries, groups=groups,
                                 max_group=max_group, seed=None, num_epochs=1, prefetch=0,
                                 position_offset=position_offset)


def teacher_mismatch(model, data_dir: str) -> str | None:
  """Why the teacher signals of `data_dir` cannot be compared with this model, or None: another
  base made them (its greedy tokens are not this base's), or for other feature layers."""
  meta = pipeline.dataset_metadata(data_dir)
  layers = (meta.get("teacher") or {}).get("feature_layers")
  if layers is not None and list(layers) != list(model.feature_layers):
    return (f"{data_dir} stores the teacher's features of layers {list(layers)} but the graft "
            f"reads layers {list(model.feature_layers)}: prepare the data with this model's config")
  stored = meta.get("base_fingerprint")
  if stored and stored != base_fingerprint(model.base):
    return (f"{data_dir} was segmented with another base ({meta.get('base', '?')}, fingerprint "
            f"{stored}), so its teacher is not this model's base: prepare the data with this base")
  return None


def base_nll(base, records: Sequence[Mapping[str, Any]], batch: int, bar=None) -> dict[str, float]:
  """The base's plain forward on the records' tokens: NLL and argmax accuracy of the response
  tokens, each summed over them and divided by their number (the rule above)."""
  graphdef, state = nnx.split(base)

  @jax.jit
  def sums(state, tokens_bt, lens_b, prompt_lens_b):
    model = nnx.merge(graphdef, state)
    b, t = tokens_bt.shape
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    segments = (pos < lens_b[:, None]).astype(jnp.int32)
    hidden = model.forward(model.embed(tokens_bt), pos, causal_segment_mask(segments)).hidden
    ce, correct = chunked_cross_entropy(hidden.reshape(b * t, -1), model.head_dv(),
                                        jnp.roll(tokens_bt, -1, axis=1).reshape(-1), 1024,
                                        hidden.dtype, rows=b)
    # Position t predicts token t + 1: response tokens are predicted from prompt_len - 1 on.
    mask = ((pos >= prompt_lens_b[:, None] - 1) & (pos < lens_b[:, None] - 1)).reshape(-1)
    return jnp.sum(ce * mask), jnp.sum(correct * mask), jnp.sum(mask)

  # One record per row, padded to a fixed length (a few static shapes across datasets; rows
  # past the records are empty).
  width = -(-max(len(r["input_ids"]) for r in records) // 64) * 64
  ce_sum = correct_sum = count = 0.0
  for i in range(0, len(records), batch):
    chunk = records[i:i + batch]
    tokens = np.zeros((batch, width), np.int32)
    lens, prompt_lens = np.zeros((batch,), np.int32), np.zeros((batch,), np.int32)
    for j, r in enumerate(chunk):
      tokens[j, :len(r["input_ids"])] = r["input_ids"]
      lens[j], prompt_lens[j] = len(r["input_ids"]), r["prompt_len"]
    ce, correct, n = jax.device_get(sums(state, tokens, lens, prompt_lens))
    ce_sum, correct_sum, count = ce_sum + float(ce), correct_sum + float(correct), count + float(n)
    if bar is not None:
      bar.update(1)
  return {"score": ce_sum / max(count, 1.0), "accuracy": correct_sum / max(count, 1.0),
          "tokens": int(count)}


def nll_task(model, data_dir: str, split: str, limit: int | None, batch: int) -> dict[str, Any]:
  """results.json's `nll` entry: HAMburger's teacher-forced metrics on a split (`evaluate`,
  paper recipe: lm_loss is the score, with per-micro-step and stop accuracies) next to the base's
  NLL and accuracy on the same response tokens (`base_nll`).

  On data with teacher signals of this model's base, also "teacher_agreement" (agree_merged,
  agree_unmerged, agree_s{i} as merged, unmerged, s{i}, with the groups each counted) and
  "teacher_acceptance" (the tf_* ratios). SplitError when the split cannot be read."""
  k = model.max_group
  records = read_records(data_dir, split, k, limit)
  skipped = teacher_mismatch(model, data_dir) if "teacher_features" in records[0] else None
  if skipped:
    print(f"warning: no teacher agreement: {skipped}", file=sys.stderr)
  teacher = "teacher_features" in records[0] and skipped is None
  # Signals that do not apply are left out of the forward.
  packed = [b if teacher else {n: v for n, v in b.items() if not n.startswith("teacher_")}
            for b in split_batches(records, k, batch, model.cfg.graft.position_offset)]
  # Packing puts several records in a row, so HAMburger runs fewer batches than the base.
  with tqdm(total=len(packed) + -(-len(records) // batch), desc="nll", unit="batch",
            file=sys.stderr) as bar:
    pool = evaluate(model, packed, bar=bar)
    base = base_nll(model.base, records, batch, bar)
  metrics = pool.result()
  ham = {n: v for n, v in metrics.items() if not n.startswith(TEACHER_PREFIXES)}
  response_tokens = sum(len(r["input_ids"]) - int(r["prompt_len"]) for r in records)
  data_groups = sum(len(r["groups"]) for r in records)
  result = {"metric": "nll", "n": len(records), "split": split, "data": data_dir,
            "tokens": base.pop("tokens"), "base": base,
            "hamburger": {"score": ham.pop("lm_loss"), **dict(sorted(ham.items()))},
            "data_kv_compression": response_tokens / max(data_groups, 1)}
  if skipped:
    result["teacher_agreement"] = {"skipped": skipped}
  elif teacher:
    names = ["merged", "unmerged", *[f"s{i}" for i in range(1, k + 1)]]
    result["teacher_agreement"] = {
        **{n: metrics[f"agree_{n}"] for n in names},
        "groups": {n: int(pool.items[f"agree_{n}"]) for n in names}}
    result["teacher_acceptance"] = {n: v for n, v in metrics.items() if n.startswith("tf_")}
    result["verify_drafts"] = verify_drafts(model, packed)
  return result


def verify_drafts(model, batches: Sequence[Mapping[str, np.ndarray]]) -> dict[str, Any]:
  """What verify mode's drafts would be, teacher-forced on stored teacher signals: from the
  base's exact features at each predicting entry (a plain context, as verify drafts), draft i
  (micro step i of the window) is the base's greedy token with share `agree`["s{i+1}"] (s1,
  the base's own token 0, is 1 by construction), over the windows counted in `groups`; and
  the stop head's gate at each confidence (`acceptance`: tokens per step, share of kept drafts
  that are the base's). `drafter`: which decoder drafts (the graft's drafter, or its micro
  decoder where it has none)."""
  drafting = lambda m, b: micro_distill_loss(m, b, DistillConfig(), drafting=True)
  pool = evaluate(model, batches, recipe="distill", loss_fn=drafting, yardstick=False)
  metrics = pool.result()
  steps = [f"s{i}" for i in range(2, model.max_group + 1)]
  return {"drafter": model.drafts_with,
          "agree": {n: metrics[f"agree_{n}"] for n in steps},
          "groups": {n: int(pool.items[f"agree_{n}"]) for n in steps},
          "kl": metrics["kl"],
          "acceptance": {n: v for n, v in metrics.items() if n.startswith("tf_")}}
