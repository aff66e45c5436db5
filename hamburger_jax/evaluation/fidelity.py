"""How faithfully the base reads a graft's merged entries, teacher-forced on fixed records
(the committed fidelity set, evaluation/fidelity_set.py, or a prepared split): `infer.eval
--tasks fidelity`, results.json's task `fidelity`.

The teacher is the exact base on the unmerged tokens; the records are its own greedy answers,
so its greedy token is the record's next token. Two contexts:

  merged      every response group of the record is one entry, as HAMburger decodes it (the
              trainer's forward, distillation.predicting_features). Token 0 of each group is
              predicted from the entry before it: after a merged entry (`agree_merged`), after
              a single-token entry or the prompt's last token (`agree_single`); micro steps 2-4
              (`agree_s2`..) from the same windows, teacher-forced.
  one merge   the record's tokens plain, and ONE group merged: each merged group of the record in
              turn, reading the plain tokens before it (a row each). Its token 0 agreement is the
              slot's own error, free of what earlier merged entries do to the context.

Each figure is pooled over its items (tokens of that kind) across the records; `by_size` splits
the after-merged figures by the merged entry's group size and the micro steps' by the predicted
group's size; `kl_*` is the KL from the teacher's top-k distribution, as the distill recipe's.
"""

from __future__ import annotations

import collections
import functools
import sys
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from hamburger_jax.data.tfds_builder import bfloat16_bits
from hamburger_jax.model import layer_merge
from hamburger_jax.model.kv_cache import KVCache
from hamburger_jax.model.llama import ALL_MERGED
from hamburger_jax.objectives.distillation import (predicting_features, teacher_context,
                                                   window_stats)
from hamburger_jax.objectives.losses import topk_kl
from hamburger_jax.run_config import DEFAULT_TEACHER_TOP_K

_ROWS_BUCKET = 16  # one-merge rows per record, padded to a multiple (few compiled shapes)
_TOKENS_BUCKET = 64


# ----------------------------------------------------------------------------- records


def teacher_records(model, records, top_k: int = DEFAULT_TEACHER_TOP_K, bar=None
                    ) -> list[dict[str, Any]]:
  """Fidelity-set records (prompt, response, groups) as a prepared dataset stores them, with the
  teacher's signals from the exact base (`model.base` with no merged entry)."""
  # pylint: disable=import-outside-toplevel
  from hamburger_jax import segmentation
  from hamburger_jax.data.teacher_pass import teacher_signals
  spec = segmentation.TeacherSpec(top_k, model.feature_layers)
  stats = segmentation.response_token_stats(
      model.base, [(r.prompt, r.response) for r in records], teacher=spec,
      progress=(lambda n: bar.update(n)) if bar is not None else None)
  out = []
  for r, st in zip(records, stats):
    sig = teacher_signals(st, r.groups)
    out.append({"input_ids": np.asarray(r.prompt + r.response, np.int32),
                "prompt_len": len(r.prompt), "groups": np.asarray(r.groups, np.int32),
                "teacher_topk_ids": sig["teacher_topk_ids"],
                "teacher_topk_logp": sig["teacher_topk_logp"],
                "teacher_features": bfloat16_bits(sig["teacher_features"]), "id": r.id})
  return out


# ----------------------------------------------------------------------------- pooling


class Tally:
  """Sums and counts of per-item values, by figure and by a size key."""

  def __init__(self):
    self.sums: dict[tuple, float] = collections.defaultdict(float)
    self.counts: dict[tuple, int] = collections.defaultdict(int)

  def add(self, name: str, values: np.ndarray, mask: np.ndarray, sizes: np.ndarray) -> None:
    values, mask, sizes = np.asarray(values, np.float64), np.asarray(mask, bool), np.asarray(sizes)
    self.sums[(name, None)] += float(values[mask].sum())
    self.counts[(name, None)] += int(mask.sum())
    for s in np.unique(sizes[mask]):
      sel = mask & (sizes == s)
      self.sums[(name, int(s))] += float(values[sel].sum())
      self.counts[(name, int(s))] += int(sel.sum())

  def result(self) -> dict[str, Any]:
    """{name: mean (None without items)}, {"by_size": {name: {size: mean}}}, {"items": ...}."""
    mean = lambda key: self.sums[key] / self.counts[key] if self.counts[key] else None
    names = sorted({n for n, _ in self.counts})
    out: dict[str, Any] = {n: mean((n, None)) for n in names}
    out["by_size"] = {n: {str(s): mean((m, s)) for m, s in sorted(self.counts, key=str)
                          if m == n and s is not None} for n in names}
    out["items"] = {n: self.counts[(n, None)] for n in names}
    return out


# ----------------------------------------------------------------------------- merged context


def merged_context(model, records: Sequence[Mapping[str, Any]], batch: int = 8,
                   ce_chunk: int = 1024, bar=None) -> dict[str, Any]:
  """The figures of the merged context over `records` (module docstring)."""
  from hamburger_jax.evaluation.teacher_forced import split_batches  # pylint: disable=C0415
  k = model.max_group
  graphdef, state = nnx.split(model)

  @functools.partial(jax.jit, static_argnums=2)
  def per_window(state, b, tokens):
    m = nnx.merge(graphdef, state)
    feats, read_size = predicting_features(m, b, tokens=tokens)
    bb, g, f, d = feats.shape
    w = window_stats(m, feats.reshape(bb * g, f, d), b, ce_chunk)
    return {"agree": w["agree"], "kl": w["kl"], "valid": w["valid"],
            "read_size": read_size.reshape(-1), "group_size": b["target_size"].reshape(-1)}

  tally = Tally()
  for b in split_batches(records, k, batch, model.cfg.graft.position_offset):
    # A merge at layer L runs the lower layers over every row unmerged: room for the longest.
    tokens = padded(int(np.asarray(b["input_size"]).sum(1).max()), _TOKENS_BUCKET)
    out = jax.device_get(per_window(state, b, tokens if model.merge_layer else None))
    valid, read, group = out["valid"], out["read_size"], out["group_size"]
    first = valid[:, 0]
    for name, values in (("agree", out["agree"]), ("kl", out["kl"])):
      tally.add(f"{name}_merged", values[:, 0], first & (read >= 2), read)
      tally.add(f"{name}_single", values[:, 0], first & (read == 1), group)
      for i in range(1, k):
        tally.add(f"{name}_s{i + 1}", values[:, i], valid[:, i], group)
    if bar is not None:
      bar.update(1)
  return tally.result()


# ----------------------------------------------------------------------------- one merge


def one_merge_rows(record: Mapping[str, Any], max_group: int, position_offset: int = 0
                   ) -> dict[str, np.ndarray]:
  """A row per merged group of `record` that has a next token: the group's ids [R, K] and size
  [R], its first token's index in the plain sequence (the entries it reads come before it:
  `slot`), its RoPE position (its last token's, docs/SPEC.md 1.2), the teacher's top-k for
  the token after it, and what a contextual entry reads: the K tokens from the group's first
  (`window`) and the teacher's features that predicted it [R, F, D]: each as the packed
  batches that train the entry lay it out (pipeline.record_layout)."""
  from hamburger_jax.data.pipeline import record_layout  # pylint: disable=C0415
  lay = record_layout(record, max_group, position_offset)
  p = int(record["prompt_len"])
  groups = lay.target_size
  rows = np.flatnonzero(groups[:-1] >= 2)
  nxt = rows + 1  # the group after: its window's first token is the one each row predicts
  return {"ids": lay.target_ids[rows], "size": groups[rows],
          "slot": (p + np.cumsum(groups) - groups)[rows].astype(np.int32),
          "position": lay.positions[p + rows],
          "topk_ids": lay.teacher_topk_ids[nxt, 0], "topk_logp": lay.teacher_topk_logp[nxt, 0],
          "window": lay.window_ids[rows], "features": lay.teacher_features[rows]}


def one_merge_entries(model, rows: Mapping[str, jax.Array]) -> jax.Array:
  """The embedder's entry [R, D] of each one-merge row: its group smashed, reading (a contextual
  embedder) the teacher_context of its window."""
  context = (teacher_context(model, rows["features"], rows["window"])
             if model.embedder.contextual else None)
  return model.smash(rows["ids"], rows["size"], context)


def plain_cache(model, ids_1t: jax.Array, collect: tuple[int, ...] = ()
                ) -> tuple[KVCache, list[jax.Array]]:
  """The exact base's keys and values of a plain token row [1, T], every layer, and the
  residual outputs of layers `collect` there [1, T, D] each."""
  base, cfg = model.base, model.cfg.base
  t = ids_1t.shape[1]
  cache = KVCache.init(cfg.num_layers, 1, t, cfg.num_kv_heads, cfg.head_dim,
                       jnp.dtype(cfg.dtype))
  positions = jnp.arange(t)[None]
  out = base.forward(base.embed(ids_1t), positions, None, cache, positions, collect=collect)
  return out.cache, out.collected


def slot_features(model, cache_1: KVCache, x_rd: jax.Array, positions_r: jax.Array,
                  slots_r: jax.Array, lower: dict[int, jax.Array] | None = None) -> jax.Array:
  """Features [R, F, D] of R merged inputs x [R, D], each alone after the cache's entries before
  its slot (one row each, read side as HAMburger decodes a merged entry). A merge at layer L:
  x is the entry's input to layer L, read by layers L.. of the cache, and `lower` ({layer:
  [R, D]}) gives the features below L."""
  r, l, n = x_rd.shape[0], model.merge_layer, model.cfg.base.num_layers
  grow = lambda a: jnp.broadcast_to(a[l:], (n - l, r, *a.shape[2:]))
  cache = cache_1.replace(k=grow(cache_1.k), v=grow(cache_1.v),
                          length=jnp.broadcast_to(cache_1.length, (r,)))
  feats, _ = model.base_features(x_rd[:, None], positions_r[:, None], None, cache,
                                 slots_r[:, None], merged_bt=ALL_MERGED, write=False,
                                 span=(l, n) if l else None,
                                 lower={i: v[:, None] for i, v in (lower or {}).items()})
  return feats[:, 0]


def one_merge_logits(model, ids_1t, rows: Mapping[str, jax.Array],
                     x_rd: jax.Array | None = None) -> jax.Array:
  """fp32 next-token logits [R, V] at each one-merge row (its embedder's entry, or `x_rd`; a
  merge at layer L: the group's pooled layer-L states)."""
  l, k = model.merge_layer, model.max_group
  below = tuple(i for i in model.feature_layers if i < l - 1)
  cache, states = plain_cache(model, ids_1t, below + (l - 1,) if l else ())
  lower = None
  if l:  # each group's tokens' layer-L states, and the features below L at its last token
    idx = rows["slot"][:, None] + jnp.arange(k)  # [R, K]
    idx = jnp.where(jnp.arange(k) < rows["size"][:, None], idx, rows["slot"][:, None])
    at = lambda h: jnp.take(h[0], idx, axis=0)  # [R, K, D]
    hidden = at(states[-1])
    x_rd = model.pool_group(hidden, rows["size"])
    lower = {i: layer_merge.last_of_group(at(h), rows["size"])
             for i, h in zip(below + (l - 1,), states)}
  elif x_rd is None:
    x_rd = one_merge_entries(model, rows)
  return model.logits(slot_features(model, cache, x_rd, rows["position"], rows["slot"],
                                    lower)[:, -1])


def padded(n: int, bucket: int) -> int:
  return max(bucket, -(-n // bucket) * bucket)


def padded_rows(rows: Mapping[str, np.ndarray], r: int) -> dict[str, np.ndarray]:
  """`rows` padded to r rows (copies of row 0: valid inputs whose outputs are dropped)."""
  n = len(rows["size"])
  return {k: np.concatenate([v, np.repeat(v[:1], r - n, axis=0)]) if r > n else v
          for k, v in rows.items()}


def padded_tokens(record: Mapping[str, Any], t: int) -> np.ndarray:
  ids = np.zeros((1, t), np.int32)
  ids[0, :len(record["input_ids"])] = record["input_ids"]
  return ids


def one_merge(model, records: Sequence[Mapping[str, Any]], bar=None) -> dict[str, Any]:
  """The one-merge figures over `records` (module docstring), by the merged group's size."""
  k, offset = model.max_group, model.cfg.graft.position_offset
  graphdef, state = nnx.split(model)
  all_rows = [one_merge_rows(r, k, offset) for r in records]
  t = padded(max(len(r["input_ids"]) for r in records), _TOKENS_BUCKET)
  r_max = padded(max(len(rows["size"]) for rows in all_rows), _ROWS_BUCKET)

  @jax.jit
  def figures(state, ids, rows):
    m = nnx.merge(graphdef, state)
    logits = one_merge_logits(m, ids, rows)
    logq = jax.nn.log_softmax(logits, axis=-1)
    return {"agree": jnp.argmax(logits, -1) == rows["topk_ids"][:, 0],
            "kl": topk_kl(logq, rows["topk_ids"], rows["topk_logp"])}

  tally = Tally()
  for rec, rows in zip(records, all_rows):
    n = len(rows["size"])
    if n:
      out = jax.device_get(figures(state, padded_tokens(rec, t), padded_rows(rows, r_max)))
      mask = np.arange(r_max) < n
      sizes = np.pad(rows["size"], (0, r_max - n))
      tally.add("agree_one_merge", out["agree"], mask, sizes)
      tally.add("kl_one_merge", out["kl"], mask, sizes)
    if bar is not None:
      bar.update(1)
  return tally.result()


# ----------------------------------------------------------------------------- the task


def fidelity_figures(model, records: Sequence[Mapping[str, Any]], batch: int = 8,
                     one_merge_too: bool = True, progress: bool = True) -> dict[str, Any]:
  """Every figure of both contexts over records with teacher signals (`teacher_records`, or a
  prepared split's), merged into one dict: the merged context's names, then `agree_one_merge`
  and `kl_one_merge`, with their `by_size` and `items`."""
  with tqdm(total=-(-len(records) // batch) + (len(records) if one_merge_too else 0),
            desc="fidelity", unit="batch", file=sys.stderr, disable=not progress) as bar:
    out = merged_context(model, records, batch, bar=bar)
    if one_merge_too:
      single = one_merge(model, records, bar=bar)
      for key in ("by_size", "items"):
        out[key].update(single.pop(key))
      out.update(single)
  return out


def kv_compression(records: Sequence[Mapping[str, Any]], merge_layer: int, num_layers: int
                   ) -> float:
  """The records' answers' KV compression when their groups merge at layer `merge_layer`
  (layer_merge.kv_compression: layer entries unmerged over merged)."""
  tokens = sum(int(np.sum(r["groups"])) for r in records)
  groups = sum(len(r["groups"]) for r in records)
  return layer_merge.kv_compression(tokens, groups, merge_layer, num_layers)


def merge_layer_sweep(model, records: Sequence[Mapping[str, Any]], layers: Sequence[int],
                      batch: int = 8) -> list[dict[str, Any]]:
  """The untrained merge at each layer L of `layers` (the last token's layer-L state, read by
  the exact base: with_merge_layer + with_merged_entry "last_token"; the micro steps are the
  graft's): each L's figures and KV compression, on the same records."""
  # pylint: disable=import-outside-toplevel
  from hamburger_jax.model.hamburger import with_merge_layer, with_merged_entry
  n = model.cfg.base.num_layers
  out = []
  for l in layers:
    untrained = with_merged_entry(with_merge_layer(model, l), "last_token")
    figures = fidelity_figures(untrained, records, batch)
    out.append({"merge_layer": l, "kv_compression": kv_compression(records, l, n),
                **{c: figures.get(c) for c in SWEEP_FIGURES},
                "items": {c: figures["items"].get(c) for c in SWEEP_FIGURES}})
  return out


SWEEP_FIGURES = ("agree_merged", "agree_single", "agree_one_merge", "kl_merged", "kl_single")


def fidelity_task(model, *, path: str | None = None, data: str | None = None,
                  split: str = "validation", limit: int | None = None,
                  batch: int = 8, merge_layers: Sequence[int] = ()) -> dict[str, Any]:
  """results.json's `fidelity` entry: the figures on the fidelity set at `path` (default: the
  committed one), or on a prepared split (`data`, `split`: e.g. a training split, for the gap
  between the data a graft learned from and held-out answers). `merge_layers`: also the
  untrained merge at each of those layers (`merge_layer_sweep`)."""
  # pylint: disable=import-outside-toplevel
  from hamburger_jax.evaluation import fidelity_set
  from hamburger_jax.evaluation.teacher_forced import read_records, teacher_mismatch
  if data is not None:
    why = teacher_mismatch(model, data)
    if why:
      raise fidelity_set.FidelitySetError(why)
    records = read_records(data, split, model.max_group, limit)
    if not records or "teacher_features" not in records[0]:
      raise fidelity_set.FidelitySetError(
          f"{data} split {split} holds no teacher signals: prepare it with --teacher-top-k")
    source = {"data": data, "split": split}
  else:
    fset = fidelity_set.load(path)
    fidelity_set.check_fits(fset, model.base, model.max_group)
    chosen = fset.records[:limit] if limit else fset.records
    with tqdm(total=len(chosen), desc="fidelity: the teacher", unit="record",
              file=sys.stderr) as bar:
      records = teacher_records(model, chosen, bar=bar)
    source = {"set": path or fidelity_set.DEFAULT_PATH, "created": fset.meta.get("created")}
  figures = fidelity_figures(model, records, batch)
  out = {"metric": "agree_merged", "score": figures["agree_merged"], "n": len(records),
         "merge_layer": model.merge_layer,
         "kv_compression": kv_compression(records, model.merge_layer, model.cfg.base.num_layers),
         **source, **figures}
  if merge_layers:
    out["merge_layer_sweep"] = merge_layer_sweep(model, records, merge_layers, batch)
  return out
