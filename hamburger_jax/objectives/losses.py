"""HAMburger training forward and loss (docs/SPEC.md 2.2) on a packed static-shape batch."""

from __future__ import annotations

import functools
from typing import Mapping

import jax
import jax.numpy as jnp

from hamburger_jax import layout
from hamburger_jax.model.attention import PackedMask
from hamburger_jax.model.hamburger import Hamburger
from hamburger_jax.model.llama import Llama

STOP_WEIGHT = 0.5


@functools.partial(jax.checkpoint, static_argnums=(5,))
def _chunk_stats(h_cd: jax.Array, head_dv: jax.Array, targets_c: jax.Array,
                 topk_ids_ck: jax.Array | None, topk_logp_ck: jax.Array | None,
                 dtype) -> dict[str, jax.Array]:
  """One chunk's CE, argmax and (with teacher top-k) KL; rematerialised so that [tokens, V] is
  never stored for the backward pass."""
  logits = jnp.dot(h_cd.astype(dtype), head_dv.astype(dtype), preferred_element_type=jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  gold = jnp.take_along_axis(logits, targets_c[:, None], axis=-1)[:, 0]
  out = {"ce": lse - gold, "argmax": jnp.argmax(logits, axis=-1).astype(jnp.int32)}
  if topk_ids_ck is not None:
    out["kl"] = topk_kl(logits - lse[:, None], topk_ids_ck, topk_logp_ck)
    # CE on the teacher's greedy token (its top-1): what a drafter must rank first.
    out["greedy_ce"] = lse - jnp.take_along_axis(logits, topk_ids_ck[:, :1], axis=-1)[:, 0]
  return out


def bce_with_logits(logit: jax.Array, target: jax.Array) -> jax.Array:
  """Binary cross-entropy of logits against targets in [0, 1], stable for large |logit|."""
  return jnp.maximum(logit, 0) - logit * target + jnp.log1p(jnp.exp(-jnp.abs(logit)))


def topk_kl(logq_nv: jax.Array, topk_ids_nk: jax.Array, topk_logp_nk: jax.Array) -> jax.Array:
  """KL(p || q) [N] where p is the teacher's distribution restricted to its stored top-k and
  renormalised there, q the student's full log-softmax. (The teacher's tail beyond k is not
  stored; renormalising keeps this a true KL between distributions, >= 0, 0 iff q = p on the
  top-k up to the tail mass.)"""
  logp = jax.nn.log_softmax(topk_logp_nk.astype(jnp.float32), axis=-1)
  logq = jnp.take_along_axis(logq_nv, topk_ids_nk, axis=-1)
  return jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)


def _row_chunks(rows: int, per_row: int, chunk: int):
  """(to_chunks, from_chunks) of `rows` batch rows of `per_row` tokens, row-major [N, ...]: each
  chunk takes chunk_tokens(...) of every row, so a batch split over devices by rows stays split
  (chunks cut across rows would move tokens between devices)."""
  c = chunk_tokens(rows, per_row, chunk)
  pad = -per_row % c

  def to_chunks(x):  # [N, ...] -> [chunks, rows * c, ...]
    x = jnp.pad(x.reshape(rows, per_row, *x.shape[1:]),
                ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 1))
    x = x.reshape(rows, -1, c, *x.shape[2:])
    return jnp.moveaxis(x, 1, 0).reshape(x.shape[1], rows * c, *x.shape[3:])

  def from_chunks(v):  # [chunks, rows * c, ...] -> [N, ...]
    v = jnp.moveaxis(v.reshape(v.shape[0], rows, c, *v.shape[2:]), 0, 1)
    return v.reshape(rows, -1, *v.shape[3:])[:, :per_row].reshape(-1, *v.shape[3:])

  return to_chunks, from_chunks


def chunked_token_stats(h_nd: jax.Array, head_dv: jax.Array, targets_n: jax.Array, chunk: int,
                        dtype=jnp.float32, topk_ids_nk: jax.Array | None = None,
                        topk_logp_nk: jax.Array | None = None,
                        rows: int = 1) -> dict[str, jax.Array]:
  """Per token [N]: CE against `targets`, the argmax token, and (given the teacher's top-k)
  the KL from the teacher; computed about `chunk` tokens at a time.

  The N tokens are `rows` batch rows of N / rows tokens each (_row_chunks)."""
  chunks, tokens = _row_chunks(rows, h_nd.shape[0] // rows, chunk)
  xs = (chunks(h_nd), chunks(targets_n),
        None if topk_ids_nk is None else chunks(topk_ids_nk),
        None if topk_logp_nk is None else chunks(topk_logp_nk))
  _, out = jax.lax.scan(
      lambda carry, x: (carry, _chunk_stats(x[0], head_dv, x[1], x[2], x[3], dtype)), None, xs)
  return {k: tokens(v) for k, v in out.items()}


def chunked_topk(h_nd: jax.Array, head_dv: jax.Array, k: int, chunk: int, dtype=jnp.float32,
                 rows: int = 1, select_dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
  """The top-k of each token's next-token distribution, (log-probs [N, k] float32, ids [N, k]
  int32) by decreasing probability, about `chunk` tokens at a time (rows: as
  chunked_token_stats): what the teacher hands the distill loss, without [N, V] in memory.

  `select_dtype`: the logits the k are chosen on. bfloat16 halves what the top-k reads (on a GPU
  it reads all V logits of every token); rounding keeps their order but makes ties, so the k
  chosen are float32's up to ties at the k-th value, and their log-probs are float32's, sorted
  by them."""
  chunks, tokens = _row_chunks(rows, h_nd.shape[0] // rows, chunk)

  def one(h_cd):
    logits = jnp.dot(h_cd.astype(dtype), head_dv.astype(dtype),
                     preferred_element_type=jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    if jnp.dtype(select_dtype) == jnp.float32:
      top, ids = jax.lax.top_k(logits, k)
    else:
      _, ids = jax.lax.top_k(logits.astype(select_dtype), k)
      top, order = jax.lax.top_k(jnp.take_along_axis(logits, ids, axis=-1), k)
      ids = jnp.take_along_axis(ids, order, axis=-1)
    return top - lse, ids.astype(jnp.int32)

  logp, ids = jax.lax.map(one, chunks(h_nd))
  return tokens(logp), tokens(ids)


def chunk_tokens(rows: int, per_row: int, chunk: int) -> int:
  """Tokens of each row in one chunk of chunked_token_stats: `chunk` spread over the rows."""
  return max(1, min(per_row, chunk // rows))


def chunked_cross_entropy(h_nd: jax.Array, head_dv: jax.Array, targets_n: jax.Array,
                          chunk: int, dtype=jnp.float32, rows: int = 1
                          ) -> tuple[jax.Array, jax.Array]:
  """Per-token CE [N] and argmax correctness [N], computed about `chunk` tokens at a time
  (`rows`: as chunked_token_stats)."""
  out = chunked_token_stats(h_nd, head_dv, targets_n, chunk, dtype, rows=rows)
  return out["ce"], out["argmax"] == targets_n


def hamburger_loss(model: Hamburger, batch: Mapping[str, jax.Array],
                   ce_chunk: int = 1024) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Token-mean CE over response tokens + 0.5 x mean stop BCE. Batch: layout.PackedBatch fields."""
  ids, size = batch["input_ids"], batch["input_size"]
  b, _, k = ids.shape
  x = model.smash(ids, size)
  mask = PackedMask(batch["segment_ids"])
  feats, _ = model.base_features(x, batch["positions"], mask, merged_bt=size >= 2)  # [B,M,F,D]
  feats = feats[jnp.arange(b)[:, None], batch["pred_index"]]  # [B, G, F, D]
  g, f, d = feats.shape[1:]
  targets = batch["target_ids"].reshape(b * g, k)
  h = model.micro_hidden(feats.reshape(b * g, f, d), targets)  # [B*G, K, D]
  sizes = batch["target_size"].reshape(b * g)
  stop_target, valid = layout.stop_targets(sizes, k)  # [B*G, K]

  ce, correct = chunked_cross_entropy(h.reshape(-1, d), model.base.head_dv(), targets.reshape(-1),
                                      ce_chunk, h.dtype, rows=b)
  ce, correct = ce.reshape(b * g, k), correct.reshape(b * g, k)
  stop = model.stop_logits(h)  # [B*G, K] fp32
  bce = bce_with_logits(stop, stop_target)

  n_tok = jnp.maximum(valid.sum(), 1)
  lm_loss = jnp.sum(jnp.where(valid, ce, 0)) / n_tok
  stop_loss = jnp.sum(jnp.where(valid, bce, 0)) / n_tok
  loss = lm_loss + STOP_WEIGHT * stop_loss
  metrics = {"loss": loss, "lm_loss": lm_loss, "stop_bce": stop_loss,
             "tokens": valid.sum(), "groups": (sizes > 0).sum(),
             "stop_acc": jnp.sum(valid & ((stop > 0) == (stop_target > 0))) / n_tok}
  for i in range(k):
    metrics[f"acc_s{i + 1}"] = jnp.sum(valid[:, i] & correct[:, i]) / jnp.maximum(
        valid[:, i].sum(), 1)
  return loss, metrics


def sft_loss(model: Llama, batch: Mapping[str, jax.Array],
             ce_chunk: int = 1024) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Plain next-token SFT of the base on the same tokens (the baseline of the train bench).

  Batch: tokens [B, T], segment_ids [B, T], positions [B, T], loss_mask [B, T] (1 where the token
  at t+1 is a response token to predict).
  """
  tokens = batch["tokens"]
  out = model.forward(model.embed(tokens), batch["positions"],
                      PackedMask(batch["segment_ids"]))
  b, t, d = out.hidden.shape
  targets = jnp.roll(tokens, -1, axis=1)
  ce, _ = chunked_cross_entropy(out.hidden.reshape(-1, d), model.head_dv(), targets.reshape(-1),
                                ce_chunk, out.hidden.dtype, rows=b)
  m = batch["loss_mask"].reshape(-1).astype(jnp.float32)
  loss = jnp.sum(ce * m) / jnp.maximum(m.sum(), 1)
  return loss, {"loss": loss, "tokens": m.sum()}
