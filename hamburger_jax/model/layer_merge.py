"""Merge at layer L (graft.merge_layer): a group's tokens run the base's first L layers as ordinary
tokens, in context, and ONE entry per group goes on through layers L..N-1.

L = 0 is the paper (the compositional embedder merges the group's input embeddings). At L > 0 the
lower layers hold exact keys and values, one per token, and the upper layers one per group: a
group of g tokens costs L g + (N - L) layer entries of KV against N g unmerged (`kv_compression`).
The group's entry at layer L is its last token's layer-L state (merge_pooling "last"), or that
state plus a learned attention over the group's states ("attention", `GroupPooling`: zero at
init, so it starts as "last"). The merged-entry adapters act on merged entries at layers >= L;
a single-token group is never merged, so c = 1.0 decodes the base exactly at every L.

Training is a gather (`entry_states`): the lower layers run over each packed row unmerged
(causal, exact), each entry takes its group's layer-L state, and the upper layers run over the
shorter row of entries at the groups' RoPE positions (the last token's, docs/SPEC.md 1.2).
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from hamburger_jax import layout
from hamburger_jax.model.attention import PackedMask
from hamburger_jax.model.llama import GraftParam, Linear, RMSNorm, torch_linear_init
from hamburger_jax.segmentation import segment_positions


def kv_compression(tokens: float, groups: float, merge_layer: int, num_layers: int) -> float:
  """Layer entries of KV unmerged over those at merge layer L: N t / (L t + (N - L) g) for t
  tokens in g groups (L = 0: t / g, the paper's KV compression)."""
  n, l = num_layers, merge_layer
  return n * tokens / (l * tokens + (n - l) * groups)


class GroupPooling(nnx.Module):
  """A group's entry at layer L from its tokens' layer-L states: the last token's state plus an
  attention over the group's states (query from the last, keys and values from each, each
  normed, with a learned in-group position), through an output projection that is zero at init.
  Groups of one token return their state unchanged."""

  def __init__(self, hidden_size: int, max_group: int, head_dim: int, *, rngs: nnx.Rngs,
               param_dtype=jnp.float32, dtype=jnp.float32, eps: float = 1e-5):
    d = hidden_size
    if d % head_dim:
      raise ValueError(f"merger_head_dim={head_dim} must divide hidden_size={d}")
    kw = dict(rngs=rngs, use_bias=True, param_type=GraftParam, param_dtype=param_dtype,
              dtype=dtype)
    self.norm = RMSNorm(d, eps, param_type=GraftParam, param_dtype=param_dtype, dtype=dtype)
    self.pos = GraftParam(0.02 * jax.random.normal(rngs.params(), (max_group, d), param_dtype),
                          logical_axes=(None, "embed"))
    self.q_proj = Linear(d, d, ("embed", "heads"), init=torch_linear_init(d), **kw)
    self.k_proj = Linear(d, d, ("embed", "heads"), init=torch_linear_init(d), **kw)
    self.v_proj = Linear(d, d, ("embed", "heads"), init=torch_linear_init(d), **kw)
    self.out_proj = Linear(d, d, ("heads", "embed"), init=nnx.initializers.zeros, **kw)
    self.num_heads, self.head_dim, self.dtype = d // head_dim, head_dim, dtype

  def __call__(self, states_nkd: jax.Array, size_n: jax.Array) -> jax.Array:
    """The group's tokens' layer-L states padded to K [..., K, D] and sizes [...] -> [..., D]."""
    *lead, k, d = states_nkd.shape
    valid = jnp.arange(k) < size_n[..., None]
    x = states_nkd.astype(self.dtype)
    last = last_of_group(x, size_n)
    normed = self.norm(x) + self.pos[...].astype(self.dtype)
    h, dh = self.num_heads, self.head_dim
    q = self.q_proj(self.norm(last)).reshape(*lead, h, dh)
    keys = self.k_proj(normed).reshape(*lead, k, h, dh)
    vals = self.v_proj(normed).reshape(*lead, k, h, dh)
    scores = jnp.einsum("...hd,...khd->...hk", q, keys,
                        preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(dh))
    scores = jnp.where(valid[..., None, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
    o = jnp.einsum("...hk,...khd->...hd", probs, vals).reshape(*lead, d)
    return jnp.where((size_n >= 2)[..., None], last + self.out_proj(o), last)


def last_of_group(x_nkd: jax.Array, size_n: jax.Array) -> jax.Array:
  """Each group's last valid row [..., D] of [..., K, D] (row 0 for an empty group)."""
  last = jnp.clip(size_n - 1, 0, x_nkd.shape[-2] - 1)
  return jnp.take_along_axis(x_nkd, last[..., None, None], axis=-2)[..., 0, :]


def group_token_index(size_bm: jax.Array, k: int, tokens: int) -> tuple[jax.Array, jax.Array]:
  """Where each entry's tokens sit in its row unmerged (the entries' groups laid out in order,
  as layout.unmerged_rows lays them): [B, M, K] indices (`tokens` past a group's end or
  the row's room), and whether the entry's whole group fits the row's `tokens` slots [B, M]."""
  end = jnp.cumsum(size_bm, axis=1)  # one past each entry's last token
  first = end - size_bm
  idx = first[..., None] + jnp.arange(k)
  inside = jnp.arange(k) < size_bm[..., None]
  fits = (end <= tokens) & (size_bm > 0)
  return jnp.where(inside & (idx < tokens), idx, tokens), fits


def gather_rows(x_btd: jax.Array, idx_b_: jax.Array) -> jax.Array:
  """x [B, T, D] at per-row indices [B, ...] -> [B, ..., D]; index T reads zeros."""
  b = x_btd.shape[0]
  padded = jnp.pad(x_btd, ((0, 0), (0, 1), (0, 0)))
  flat = idx_b_.reshape(b, -1)
  return padded[jnp.arange(b)[:, None], flat].reshape(*idx_b_.shape, x_btd.shape[-1])


def entry_states(model, batch: Mapping[str, jax.Array], tokens: int
                 ) -> tuple[jax.Array, dict[int, jax.Array], jax.Array]:
  """The gather of a packed batch at merge layer L = model.merge_layer > 0: each entry's input to
  layer L [B, M, D] (its group's pooled layer-L state), the residual outputs of the feature
  layers below L at each entry's last token {layer: [B, M, D]}, and whether the entry's group
  fits the row unmerged in `tokens` slots [B, M] (an entry that does not reads zeros: mask what
  it predicts). The lower layers are the exact base, frozen (no gradient reaches them)."""
  base, l = model.base, model.merge_layer
  ids, seg, _ = layout.unmerged_rows(batch, tokens)
  size = batch["input_size"]
  k = batch["input_ids"].shape[-1]
  below = tuple(i for i in model.feature_layers if i < l - 1)
  out = base.forward(base.embed(ids), segment_positions(seg), PackedMask(seg),
                     collect=below, span=(0, l), norm=False)
  hidden = jax.lax.stop_gradient(out.hidden)  # [B, T, D]: layer L's input, every token
  idx, fits = group_token_index(size, k, tokens)
  group_states = gather_rows(hidden, idx)  # [B, M, K, D]
  last = jnp.take_along_axis(idx, jnp.clip(size - 1, 0, k - 1)[..., None], axis=-1)[..., 0]
  lower = {i: gather_rows(jax.lax.stop_gradient(h), last) for i, h in zip(below, out.collected)}
  lower[l - 1] = gather_rows(hidden, last)
  return model.pool_group(group_states, size), lower, fits
