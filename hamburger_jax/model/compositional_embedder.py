"""Compositional embedder (docs/SPEC.md 1.1): smashes a group of up to K token embeddings into
one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hamburger_jax.model.llama import GraftParam, Linear, RMSNorm, torch_linear_init


class CompositionalEmbedder(nnx.Module):
  """Attention merger: the group mean is the query; keys/values read [embedding ; in-group pos].

  `contextual` (GraftConfig.contextual_entry): each token's embedding first gets its context
  added, a projection of its normed hidden state (the micro decoder's, at the step that chose the
  token). The projection starts at zero, so a contextual embedder starts as the plain one (and
  continues a trained plain graft unchanged)."""

  def __init__(self, hidden_size: int, max_group: int, head_dim: int, *, rngs: nnx.Rngs,
               param_dtype=jnp.float32, dtype=jnp.float32, contextual: bool = False,
               eps: float = 1e-5):
    d, half = hidden_size, hidden_size // 2
    if d % head_dim:
      raise ValueError(f"merger_head_dim={head_dim} must divide hidden_size={d}")
    kw = dict(rngs=rngs, use_bias=True, param_type=GraftParam, param_dtype=param_dtype,
              dtype=dtype)
    # torch.nn.init.xavier_normal_ on a [K, D/2] tensor: fan_in D/2, fan_out K.
    std = (2.0 / (half + max_group)) ** 0.5
    self.pos = GraftParam(std * jax.random.normal(rngs.params(), (max_group, half), param_dtype),
                          logical_axes=(None, "embed"))
    self.q_proj = Linear(d, d, ("embed", "heads"), init=torch_linear_init(d), **kw)
    self.k_proj = Linear(d + half, d, ("embed", "heads"), init=torch_linear_init(d + half), **kw)
    self.v_proj = Linear(d + half, d, ("embed", "heads"), init=torch_linear_init(d + half), **kw)
    self.out_proj = Linear(d, d, ("heads", "embed"), init=torch_linear_init(d), **kw)
    self.num_heads = d // head_dim
    self.head_dim = head_dim
    self.dtype = dtype
    self.context_norm = nnx.data(None)
    self.context_proj = nnx.data(None)
    if contextual:
      self.context_norm = RMSNorm(d, eps, param_type=GraftParam, param_dtype=param_dtype,
                                  dtype=dtype)
      self.context_proj = Linear(d, d, ("embed", "heads"), rngs=rngs, param_type=GraftParam,
                                 init=nnx.initializers.zeros, param_dtype=param_dtype,
                                 dtype=dtype)

  @property
  def contextual(self) -> bool:
    return self.context_proj is not None

  def __call__(self, e_nkd: jax.Array, size_n: jax.Array,
               context_nkd: jax.Array | None = None) -> jax.Array:
    """Embeddings of each group padded to K [..., K, D] and group sizes [...] -> [..., D];
    a contextual embedder also takes the tokens' hidden states [..., K, D].

    Groups of one token are returned unchanged (never merged); size 0 (padding) returns row 0.
    """
    *lead, k, d = e_nkd.shape
    valid = jnp.arange(k) < size_n[..., None]  # [..., K]
    single = e_nkd[..., 0, :].astype(self.dtype)
    if self.contextual != (context_nkd is not None):
      raise ValueError("a contextual embedder takes the group tokens' hidden states, a plain "
                       "one none")
    e = e_nkd.astype(self.dtype)
    if context_nkd is not None:
      e = e + self.context_proj(self.context_norm(context_nkd.astype(self.dtype)))
    mean = jnp.sum(jnp.where(valid[..., None], e, 0), axis=-2) / jnp.maximum(
        size_n[..., None], 1).astype(self.dtype)
    pos = jnp.broadcast_to(self.pos[...].astype(self.dtype), (*lead, k, d // 2))
    kv_in = jnp.concatenate([e, pos], axis=-1)
    h, dh = self.num_heads, self.head_dim
    q = self.q_proj(mean).reshape(*lead, h, dh)
    keys = self.k_proj(kv_in).reshape(*lead, k, h, dh)
    vals = self.v_proj(kv_in).reshape(*lead, k, h, dh)
    scores = jnp.einsum("...hd,...khd->...hk", q, keys,
                        preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(dh))
    scores = jnp.where(valid[..., None, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
    o = jnp.einsum("...hk,...khd->...hd", probs, vals).reshape(*lead, d)
    merged = mean + self.out_proj(o)
    return jnp.where((size_n <= 1)[..., None], single, merged)
