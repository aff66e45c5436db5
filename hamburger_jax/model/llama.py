"""The Llama-family base decoder in Flax NNX: RMSNorm, RoPE, GQA attention, SwiGLU MLP."""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from hamburger_jax import sharding
from hamburger_jax.config import REMAT, LlamaConfig
from hamburger_jax.model.attention import attend
from hamburger_jax.model.kv_cache import KVCache
from hamburger_jax.model.rope import apply_rope, inverse_frequencies

Initializer = Callable[..., jax.Array]
_BASE_INIT = nnx.initializers.normal(0.02)  # transformers' LlamaPreTrainedModel default


def torch_linear_init(fan_in: int) -> Initializer:
  """PyTorch's nn.Linear default, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), for weights and biases."""
  bound = 1.0 / fan_in ** 0.5
  return lambda key, shape, dtype=jnp.float32: jax.random.uniform(
      key, shape, dtype, -bound, bound)


class GraftParam(nnx.Param):
  """Weights of the grafted HAMburger modules; a variable type so freezing is a filter."""


def dtype_of(name: str):
  return jnp.dtype(name)


class Linear(nnx.Module):
  """y = x @ kernel (+ bias). kernel is [in, out]: transformers' weight transposed."""

  def __init__(self, in_features: int, out_features: int, axes: tuple[str | None, str | None],
               *, rngs: nnx.Rngs, use_bias: bool = False, param_type=nnx.Param,
               init: Initializer | None = None, param_dtype=jnp.float32, dtype=jnp.float32):
    init = init or _BASE_INIT
    self.kernel = param_type(init(rngs.params(), (in_features, out_features), param_dtype),
                             logical_axes=axes)
    self.bias = (param_type(init(rngs.params(), (out_features,), param_dtype),
                            logical_axes=(axes[1],)) if use_bias else None)
    self.dtype = dtype
    self.lora = nnx.data(None)  # an adapter (hamburger_jax.model.lora.LoRA) once attached

  def __call__(self, x: jax.Array, merged: jax.Array | None = None) -> jax.Array:
    """`merged` [...] (x's leading dims): where True, an attached adapter adds its delta; where
    False, or when None, this is the plain layer (the adapters are merged-entry adapters)."""
    y = jnp.dot(x.astype(self.dtype), self.kernel[...].astype(self.dtype))
    if self.bias is not None:
      y = y + self.bias[...].astype(self.dtype)
    if self.lora is not None and merged is not None:
      y = jnp.where(merged[..., None], y + self.lora(x), y)
    return y


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, *, param_type=nnx.Param, param_dtype=jnp.float32,
               dtype=jnp.float32):
    self.weight = param_type(jnp.ones((dim,), param_dtype), logical_axes=("norm",))
    self.eps = eps
    self.dtype = dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    # transformers casts back to the input dtype before the weight multiply.
    return (self.weight[...].astype(self.dtype) * x32.astype(x.dtype)).astype(self.dtype)


class Attention(nnx.Module):

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, param_type=nnx.Param,
               init: Callable[[int], Initializer] | None = None):
    d, h, hkv, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    kw = dict(rngs=rngs, param_type=param_type, param_dtype=dtype_of(cfg.param_dtype),
              dtype=dtype_of(cfg.dtype))
    mk = (lambda fan_in: init(fan_in)) if init else (lambda fan_in: None)
    self.q_proj = Linear(d, h * dh, ("embed", "heads"), init=mk(d), **kw)
    self.k_proj = Linear(d, hkv * dh, ("embed", "kv_heads"), init=mk(d), **kw)
    self.v_proj = Linear(d, hkv * dh, ("embed", "kv_heads"), init=mk(d), **kw)
    self.o_proj = Linear(h * dh, d, ("heads", "embed"), init=mk(h * dh), **kw)
    self.num_heads, self.num_kv_heads, self.head_dim = h, hkv, dh
    self.rope_cfg = cfg  # static; frequencies are recomputed at trace time (an array here
    # would become module state)

  def __call__(self, x_btd: jax.Array, positions_bt: jax.Array, mask_bts: jax.Array,
               cache: KVCache | None = None, slots_bt: jax.Array | None = None,
               layer: int = 0, merged_bt: jax.Array | None = None
               ) -> tuple[jax.Array, KVCache | None]:
    b, t, _ = x_btd.shape
    q = self.q_proj(x_btd, merged_bt).reshape(b, t, self.num_heads, self.head_dim)
    k = self.k_proj(x_btd, merged_bt).reshape(b, t, self.num_kv_heads, self.head_dim)
    v = self.v_proj(x_btd, merged_bt).reshape(b, t, self.num_kv_heads, self.head_dim)
    inv_freq = inverse_frequencies(self.rope_cfg)
    q = apply_rope(q, positions_bt, inv_freq)
    k = apply_rope(k, positions_bt, inv_freq)
    if cache is None:
      return self.o_proj(attend(q, k, v, mask_bts), merged_bt), None
    # The cache owns how its entries are read (a dense row, or a paged pool's blocks).
    cache = cache.write(layer, slots_bt, k, v)
    return self.o_proj(cache.attend(layer, q, mask_bts), merged_bt), cache


class MLP(nnx.Module):

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, param_type=nnx.Param,
               init: Callable[[int], Initializer] | None = None):
    d, f = cfg.hidden_size, cfg.intermediate_size
    kw = dict(rngs=rngs, param_type=param_type, param_dtype=dtype_of(cfg.param_dtype),
              dtype=dtype_of(cfg.dtype))
    mk = (lambda fan_in: init(fan_in)) if init else (lambda fan_in: None)
    self.gate_proj = Linear(d, f, ("embed", "mlp"), init=mk(d), **kw)
    self.up_proj = Linear(d, f, ("embed", "mlp"), init=mk(d), **kw)
    self.down_proj = Linear(f, d, ("mlp", "embed"), init=mk(f), **kw)

  def __call__(self, x: jax.Array, merged_bt: jax.Array | None = None) -> jax.Array:
    h = jax.nn.silu(self.gate_proj(x, merged_bt)) * self.up_proj(x, merged_bt)
    return self.down_proj(h, merged_bt)


class DecoderLayer(nnx.Module):

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, param_type=nnx.Param,
               init: Callable[[int], Initializer] | None = None):
    kw = dict(param_type=param_type, param_dtype=dtype_of(cfg.param_dtype),
              dtype=dtype_of(cfg.dtype))
    self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
    self.self_attn = Attention(cfg, rngs=rngs, param_type=param_type, init=init)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
    self.mlp = MLP(cfg, rngs=rngs, param_type=param_type, init=init)

  def __call__(self, x_btd, positions_bt, mask_bts, cache=None, slots_bt=None, layer=0,
               merged_bt=None):
    a, cache = self.self_attn(self.input_layernorm(x_btd), positions_bt, mask_bts, cache,
                              slots_bt, layer, merged_bt)
    x_btd = x_btd + a
    return x_btd + self.mlp(self.post_attention_layernorm(x_btd), merged_bt), cache


class DecoderStack(nnx.Module):
  """A list of decoder layers sharing one KV cache pytree (the base and the micro decoder).

  `scan` (an uncached forward: training, the teacher pass): the layers run as one
  `lax.scan` over their stacked weights, so a compiler sees one layer, not N (compile time);
  the weights stay one module per layer (checkpoints, converters, sharding rules unchanged).
  `remat` "layers": each layer's activations are recomputed in the backward pass from its
  input, which alone is kept (memory for compute, with `scan`)."""

  def __init__(self, cfg: LlamaConfig, num_layers: int, *, rngs: nnx.Rngs, param_type=nnx.Param,
               init: Callable[[int], Initializer] | None = None):
    self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs, param_type=param_type, init=init)
                            for _ in range(num_layers)])
    self.scan = False
    self.remat = "none"

  def __call__(self, x_btd: jax.Array, positions_bt: jax.Array, mask_bts: jax.Array,
               cache: KVCache | None = None, slots_bt: jax.Array | None = None,
               collect: Sequence[int] = (), merged_bt: jax.Array | None = None
               ) -> tuple[jax.Array, list[jax.Array], KVCache | None]:
    """Returns the last residual stream, the residual outputs of layers `collect`, the cache.

    `merged_bt` [B, T] bool: entries that are merged groups (only there do adapters act)."""
    x_btd = sharding.constrain_rows(x_btd)
    if self.scan and cache is None and len(self.layers) > 1:
      return self._scanned(x_btd, positions_bt, mask_bts, collect, merged_bt)
    collected = []
    for i, layer in enumerate(self.layers):
      x_btd, cache = layer(x_btd, positions_bt, mask_bts, cache, slots_bt, i, merged_bt)
      x_btd = sharding.constrain_rows(x_btd)
      if i in collect:
        collected.append(x_btd)
    return x_btd, collected, cache

  def _scanned(self, x_btd, positions_bt, mask_bts, collect, merged_bt):
    graphdef = nnx.graphdef(self.layers[0])
    stacked = jax.tree.map(lambda *w: jnp.stack(w), *[nnx.state(l) for l in self.layers])

    def body(x, state):
      x, _ = nnx.merge(graphdef, state)(x, positions_bt, mask_bts, merged_bt=merged_bt)
      x = sharding.constrain_rows(x)
      return x, x

    if self.remat == "layers":
      body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
    x_btd, outputs = jax.lax.scan(body, x_btd, stacked)
    return x_btd, [outputs[i] for i in collect], None


def set_layer_execution(model: nnx.Module, scan: bool, remat: str = "none") -> None:
  """How every decoder stack of `model` runs an uncached forward (DecoderStack: `scan`,
  `remat`), in place; part of the model's graph, so programs traced after this follow it."""
  if remat not in REMAT:
    raise ValueError(f"remat={remat!r}: use one of {', '.join(REMAT)}")
  for _, node in nnx.iter_graph(model):
    if isinstance(node, DecoderStack):
      node.scan, node.remat = scan, remat


@dataclasses.dataclass
class BaseOutput:
  hidden: jax.Array  # [B, T, D] final-normed last layer
  collected: list[jax.Array]  # residual outputs of the requested layers, each [B, T, D]
  cache: KVCache | None


class Llama(nnx.Module):
  """The base model. Takes input embeddings so HAMburger can feed merged entries."""

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    pd = dtype_of(cfg.param_dtype)
    self.embed_tokens = nnx.Param(_BASE_INIT(rngs.params(), (cfg.vocab_size, cfg.hidden_size), pd),
                                  logical_axes=("vocab", "embed"))
    self.decoder = DecoderStack(cfg, cfg.num_layers, rngs=rngs)
    self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=pd,
                        dtype=dtype_of(cfg.dtype))
    self.lm_head = (None if cfg.tie_word_embeddings else
                    nnx.Param(_BASE_INIT(rngs.params(), (cfg.hidden_size, cfg.vocab_size), pd),
                              logical_axes=("embed", "vocab")))

  def embed(self, ids: jax.Array) -> jax.Array:
    return jnp.take(self.embed_tokens[...], ids, axis=0).astype(dtype_of(self.cfg.dtype))

  def head_dv(self) -> jax.Array:
    """The LM head as [D, V]; the tied head reuses the embedding matrix."""
    return self.embed_tokens[...].T if self.lm_head is None else self.lm_head[...]

  def logits(self, h: jax.Array) -> jax.Array:
    """fp32 logits [..., V]."""
    dt = dtype_of(self.cfg.dtype)
    return jnp.einsum("...d,dv->...v", h.astype(dt), self.head_dv().astype(dt),
                      preferred_element_type=jnp.float32)

  def forward(self, x_btd: jax.Array, positions_bt: jax.Array, mask_bts: jax.Array,
              cache: KVCache | None = None, slots_bt: jax.Array | None = None,
              collect: Sequence[int] = (), merged_bt: jax.Array | None = None) -> BaseOutput:
    """`merged_bt` [B, T] bool marks merged-entry inputs, where base adapters act; None (prompt,
    base mode) runs the exact base weights everywhere."""
    x, collected, cache = self.decoder(x_btd, positions_bt, mask_bts, cache, slots_bt, collect,
                                       merged_bt)
    return BaseOutput(self.norm(x), collected, cache)

  def __call__(self, ids_bt: jax.Array, segment_ids_bt: jax.Array | None = None,
               positions_bt: jax.Array | None = None,
               merged_bt: jax.Array | None = None) -> jax.Array:
    """Plain uncached forward: token ids -> fp32 logits [B, T, V] (adapters only at merged_bt)."""
    b, t = ids_bt.shape
    if segment_ids_bt is None:
      segment_ids_bt = jnp.ones((b, t), jnp.int32)
    if positions_bt is None:
      positions_bt = jnp.broadcast_to(jnp.arange(t), (b, t))
    out = self.forward(self.embed(ids_bt), positions_bt, causal_segment_mask(segment_ids_bt),
                       merged_bt=merged_bt)
    return self.logits(out.hidden)


def causal_segment_mask(segment_ids_bt: jax.Array) -> jax.Array:
  """[B, T, T] block-diagonal causal mask for packed rows; segment id 0 is padding."""
  t = segment_ids_bt.shape[1]
  causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
  same = segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]
  # Padding rows attend to themselves so their softmax stays finite (their outputs are unused).
  pad_self = (segment_ids_bt[:, :, None] == 0) & jnp.eye(t, dtype=bool)
  return (causal & same & (segment_ids_bt[:, :, None] > 0)) | pad_self
