"""The oracle entry: what ANY compositional embedder could reach with a graft's reading side.

At each merged slot of the one-merge context (evaluation/fidelity.py: the record's tokens plain,
one group merged), the embedder's output is replaced by a free input vector, optimised by Adam
against the frozen base and its merged-entry adapters to make the slot predict what the base
predicts after the group's last token (the KL from the teacher's top-k, the distill recipe's
loss). No embedder can do better at that slot with these weights: if the optimised vectors agree
with the base far more often than the embedder's, the embedder is what limits the merged entry;
if not, the single slot or the weights that read it are.

  python -m infer.experiments.oracle_entry --checkpoint C --slots 256 --steps 150
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from hamburger_jax.evaluation import fidelity
from hamburger_jax.objectives.losses import topk_kl


@dataclasses.dataclass
class OracleCurve:
  """Agreement and KL of the optimised slots after each reported step (step 0: the embedder's
  own entries), pooled over every slot; with the slots' group sizes for a split."""
  steps: list[int]
  agree: list[float]
  kl: list[float]
  slots: int
  by_size: dict[str, dict[str, float]]  # {"agree_0" / "agree_final": {size: value}}
  relative_change: float  # ||x - x0|| / ||x0|| of the final vectors, pooled


def _record_slots(records: Sequence[Mapping[str, Any]], max_group: int, offset: int, slots: int):
  """(record, its one-merge rows) pairs, in order, until `slots` rows are taken."""
  out, taken = [], 0
  for rec in records:
    rows = fidelity.one_merge_rows(rec, max_group, offset)
    n = min(len(rows["size"]), slots - taken)
    if n <= 0:
      continue
    out.append((rec, {k: v[:n] for k, v in rows.items()}))
    taken += n
    if taken >= slots:
      break
  return out


def optimise(model, records: Sequence[Mapping[str, Any]], *, slots: int = 256, steps: int = 150,
             lr: float = 0.05, report_every: int = 25,
             log: Callable[[str], None] = lambda line: None) -> OracleCurve:
  """Optimises a free entry per one-merge slot of `records` (with teacher signals), `slots` in
  all, record by record; lr is relative to the embeddings' RMS."""
  k, offset = model.max_group, model.cfg.graft.position_offset
  graphdef, state = nnx.split(model)
  chosen = _record_slots(records, k, offset, slots)
  if not chosen:
    raise ValueError("the records hold no merged group with a next token: nothing to optimise")
  t = fidelity.padded(max(len(r["input_ids"]) for r, _ in chosen), 64)
  r_max = fidelity.padded(max(len(rows["size"]) for _, rows in chosen), 16)
  scale = float(jnp.sqrt(jnp.mean(model.base.embed_tokens[...] ** 2)))
  tx = optax.adam(lr * scale)
  marks = sorted({0, *range(report_every, steps + 1, report_every), steps})

  @jax.jit
  def run(state, ids, rows, mask):
    m = nnx.merge(graphdef, state)
    cache = jax.lax.stop_gradient(fidelity.plain_cache(m, ids)[0])
    x0 = jax.lax.stop_gradient(fidelity.one_merge_entries(m, rows))

    def figures(x):
      logits = m.logits(fidelity.slot_features(m, cache, x, rows["position"], rows["slot"])[:, -1])
      kl = topk_kl(jax.nn.log_softmax(logits, -1), rows["topk_ids"], rows["topk_logp"])
      return kl, jnp.argmax(logits, -1) == rows["topk_ids"][:, 0]

    def loss(x):
      kl, _ = figures(x)
      return jnp.sum(jnp.where(mask, kl, 0)) / jnp.maximum(mask.sum(), 1)

    def step(carry, i):
      x, opt = carry
      g = jax.grad(loss)(x)
      updates, opt = tx.update(g, opt, x)
      x = optax.apply_updates(x, updates)
      kl, agree = figures(x)
      return (x, opt), (kl, agree)

    kl0, agree0 = figures(x0)
    (x, _), (kls, agrees) = jax.lax.scan(step, (x0, tx.init(x0)), jnp.arange(steps))
    change = jnp.sum(jnp.where(mask[:, None], (x - x0) ** 2, 0)), jnp.sum(
        jnp.where(mask[:, None], x0 ** 2, 0))
    return (jnp.concatenate([kl0[None], kls]), jnp.concatenate([agree0[None], agrees]), change)

  kl_sum = np.zeros(steps + 1)
  agree_sum = np.zeros(steps + 1)
  sizes, first, last = [], [], []
  moved = norm = 0.0
  n = 0
  for i, (rec, rows) in enumerate(chosen):
    r = len(rows["size"])
    mask = np.arange(r_max) < r
    kls, agrees, (dx, x0) = jax.device_get(run(state, fidelity.padded_tokens(rec, t),
                                               fidelity.padded_rows(rows, r_max), mask))
    kl_sum += kls[:, :r].sum(1)
    agree_sum += agrees[:, :r].sum(1)
    sizes += rows["size"].tolist()
    first += agrees[0, :r].tolist()
    last += agrees[-1, :r].tolist()
    moved, norm, n = moved + float(dx), norm + float(x0), n + r
    log(f"oracle: record {i + 1}/{len(chosen)}, {n} slots: agreement "
        f"{agree_sum[0] / n:.3f} -> {agree_sum[-1] / n:.3f}")
  by = lambda vals: {str(s): float(np.mean([v for v, z in zip(vals, sizes) if z == s]))
                     for s in sorted(set(sizes))}
  return OracleCurve(marks, [float(agree_sum[s] / n) for s in marks],
                     [float(kl_sum[s] / n) for s in marks], n,
                     {"agree_0": by(first), "agree_final": by(last)},
                     float(np.sqrt(moved / max(norm, 1e-12))))
