"""The Llama-family base decoder in Flax NNX: RMSNorm, RoPE, GQA attention, SwiGLU MLP."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from hamburger_jax import sharding
from hamburger_jax.config import REMAT, LlamaConfig
from hamburger_jax.model.attention import PackedMask, attend, attend_packed, causal_segment_mask
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


# `merged_bt` of a forward where every entry is a merged group: the adapters act everywhere, as
# one set of kernels (Linear: the kernel with its adapter folded in), not per row.
ALL_MERGED = "all"
# The projections a fused kernel holds, in its order, by the fused kernel's name in its layer
# (`fused_projections`; model/decode_layout.py lays them out).
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# An uncached forward's mask: dense [B, T, T] bool, or packed rows' segments.
Mask = jax.Array | PackedMask
KV = tuple[jax.Array, jax.Array]  # keys, values of new entries, every layer: [L, B, T, Hkv, Dh]


class Linear(nnx.Module):
  """y = x @ kernel (+ bias). kernel is [in, *out]: transformers' weight transposed, with the
  output dimension split in several where one kernel holds several projections (a fused
  q|k|v by KV head, gate|up)."""

  def __init__(self, in_features: int, out_features: int | tuple[int, ...],
               axes: tuple[str | None, ...], *, rngs: nnx.Rngs, use_bias: bool = False,
               param_type=nnx.Param, init: Initializer | None = None, param_dtype=jnp.float32,
               dtype=jnp.float32):
    init = init or _BASE_INIT
    out = (out_features,) if isinstance(out_features, int) else tuple(out_features)
    self.kernel = param_type(init(rngs.params(), (in_features, *out), param_dtype),
                             logical_axes=axes)
    self.bias = (param_type(init(rngs.params(), out, param_dtype), logical_axes=axes[1:])
                 if use_bias else None)
    self.dtype = dtype
    # A merged-entry adapter once attached (hamburger_jax.model.lora: LoRA to train,
    # FoldedAdapter to decode).
    self.lora = nnx.data(None)

  def __call__(self, x: jax.Array, merged: jax.Array | str | None = None) -> jax.Array:
    """`merged`: None, the plain layer; ALL_MERGED, the layer with its adapter everywhere;
    a bool array of x's leading dims, the adapter where True (merged entries) and the plain
    layer elsewhere."""
    kernel = self.kernel[...]
    if self.lora is not None and isinstance(merged, str):
      kernel = self.lora.folded(kernel)
    y = matmul(x, kernel, self.dtype)
    if self.bias is not None:
      y = y + self.bias[...].astype(self.dtype)
    if self.lora is not None and merged is not None and not isinstance(merged, str):
      y = self.lora.per_row(x, y, merged)
    return y


def matmul(x: jax.Array, kernel: jax.Array, dtype) -> jax.Array:
  """x [..., in] @ kernel [in, *out] in `dtype`: one dot_general."""
  x, kernel = x.astype(dtype), kernel.astype(dtype)
  return jnp.dot(x, kernel) if kernel.ndim == 2 else jnp.tensordot(x, kernel, axes=1)


def rows_where(merged: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
  """`a` where `merged` [leading dims] is True, else `b`."""
  return jnp.where(merged.reshape(merged.shape + (1,) * (a.ndim - merged.ndim)), a, b)


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
  """GQA self-attention. With cfg.fused_projections q, k and v are one kernel [D, G + 2, Hkv,
  Dh]: the G query heads of every KV head, then the keys, then the values (one matmul; a tensor
  split by KV heads keeps each group on one device)."""

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, param_type=nnx.Param,
               init: Callable[[int], Initializer] | None = None):
    d, h, hkv, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    kw = dict(rngs=rngs, param_type=param_type, param_dtype=dtype_of(cfg.param_dtype),
              dtype=dtype_of(cfg.dtype))
    mk = (lambda fan_in: init(fan_in)) if init else (lambda fan_in: None)
    if cfg.fused_projections:
      self.qkv_proj = Linear(d, (h // hkv + 2, hkv, dh), ("embed", None, "kv_heads", None),
                             init=mk(d), **kw)
    else:
      self.q_proj = Linear(d, h * dh, ("embed", "heads"), init=mk(d), **kw)
      self.k_proj = Linear(d, hkv * dh, ("embed", "kv_heads"), init=mk(d), **kw)
      self.v_proj = Linear(d, hkv * dh, ("embed", "kv_heads"), init=mk(d), **kw)
    self.o_proj = Linear(h * dh, d, ("heads", "embed"), init=mk(h * dh), **kw)
    self.num_heads, self.num_kv_heads, self.head_dim = h, hkv, dh
    self.fused = cfg.fused_projections
    self.rope_cfg = cfg  # static; frequencies are recomputed at trace time (an array here
    # would become module state)
    self.kernel = "xla"  # packed rows' attention (attention.attend_packed): set_attention

  def project(self, x_btd: jax.Array, merged_bt=None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [B, T, H, Dh] (fused: [B, T, G, Hkv, Dh]), k and v [B, T, Hkv, Dh], before RoPE."""
    b, t, _ = x_btd.shape
    h, hkv, dh = self.num_heads, self.num_kv_heads, self.head_dim
    if self.fused:
      y = self.qkv_proj(x_btd, merged_bt)  # [B, T, G + 2, Hkv, Dh]
      g = h // hkv
      # Split along a major dimension (free on a TPU, where the two minor ones are tiled); q
      # stays [B, T, G, Hkv, Dh], which attention takes as it is.
      return y[:, :, :g], y[:, :, g], y[:, :, g + 1]
    return (self.q_proj(x_btd, merged_bt).reshape(b, t, h, dh),
            self.k_proj(x_btd, merged_bt).reshape(b, t, hkv, dh),
            self.v_proj(x_btd, merged_bt).reshape(b, t, hkv, dh))

  def __call__(self, x_btd: jax.Array, positions_bt: jax.Array, mask_bts: Mask | None,
               cache=None, slots_bt: jax.Array | None = None, layer: int = 0,
               merged_bt=None) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Attention output [B, T, D] and the inputs' keys and values [B, T, Hkv, Dh]. Without a
    cache the inputs attend among themselves under `mask_bts`; with one (read only: the caller
    writes the keys and values) each input at cache slot `slots_bt` attends to the cache's
    earlier entries and, causally, to the inputs."""
    q, k, v = self.project(x_btd, merged_bt)
    inv_freq = inverse_frequencies(self.rope_cfg)
    q = apply_rope(q, positions_bt, inv_freq)
    k = apply_rope(k, positions_bt, inv_freq)
    if cache is None and isinstance(mask_bts, PackedMask):
      out = attend_packed(q, k, v, mask_bts.segment_ids_bt, self.kernel)
    elif cache is None:
      out = attend(q, k, v, mask_bts)
    else:  # the cache owns how its entries are read (a dense row, or a paged pool's blocks)
      out = cache.attend_new(layer, q, k, v, slots_bt)
    return self.o_proj(out, merged_bt), (k, v)


class MLP(nnx.Module):
  """SwiGLU. With cfg.fused_projections gate and up are one kernel [D, 2, F]."""

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, param_type=nnx.Param,
               init: Callable[[int], Initializer] | None = None):
    d, f = cfg.hidden_size, cfg.intermediate_size
    kw = dict(rngs=rngs, param_type=param_type, param_dtype=dtype_of(cfg.param_dtype),
              dtype=dtype_of(cfg.dtype))
    mk = (lambda fan_in: init(fan_in)) if init else (lambda fan_in: None)
    if cfg.fused_projections:
      self.gate_up_proj = Linear(d, (2, f), ("embed", None, "mlp"), init=mk(d), **kw)
    else:
      self.gate_proj = Linear(d, f, ("embed", "mlp"), init=mk(d), **kw)
      self.up_proj = Linear(d, f, ("embed", "mlp"), init=mk(d), **kw)
    self.down_proj = Linear(f, d, ("mlp", "embed"), init=mk(f), **kw)
    self.fused = cfg.fused_projections

  def __call__(self, x: jax.Array, merged_bt=None) -> jax.Array:
    if self.fused:
      y = self.gate_up_proj(x, merged_bt)  # [..., 2, F]
      gate, up = y[..., 0, :], y[..., 1, :]
    else:
      gate, up = self.gate_proj(x, merged_bt), self.up_proj(x, merged_bt)
    return self.down_proj(jax.nn.silu(gate) * up, merged_bt)


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
    a, kv = self.self_attn(self.input_layernorm(x_btd), positions_bt, mask_bts, cache,
                           slots_bt, layer, merged_bt)
    x_btd = x_btd + a
    return x_btd + self.mlp(self.post_attention_layernorm(x_btd), merged_bt), kv


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

  def __call__(self, x_btd: jax.Array, positions_bt: jax.Array, mask_bts: Mask | None,
               cache=None, slots_bt: jax.Array | None = None, collect: Sequence[int] = (),
               merged_bt=None, span: tuple[int, int] | None = None
               ) -> tuple[jax.Array, list[jax.Array], KV | None]:
    """Returns the last residual stream, the residual outputs of layers `collect`, and with a
    cache (read only) the inputs' keys and values of every layer, for the caller to write.

    `merged_bt`: where the adapters act (Linear: None, ALL_MERGED, or [B, T] bool). `span`
    (start, stop): only those layers run (a merge at layer L runs [0, L) per token and [L, N)
    per group); `collect` names layers by their index in the stack, and a cache holds the
    span's layers alone (its layer 0 is layer `start`)."""
    start, stop = span or (0, len(self.layers))
    x_btd = sharding.constrain_rows(x_btd)
    if self.scan and cache is None and stop - start > 1:
      return self._scanned(x_btd, positions_bt, mask_bts, collect, merged_bt, start, stop)
    collected, keys, values = [], [], []
    for i in range(start, stop):
      x_btd, (k, v) = self.layers[i](x_btd, positions_bt, mask_bts, cache, slots_bt, i - start,
                                     merged_bt)
      x_btd = sharding.constrain_rows(x_btd)
      keys.append(k)
      values.append(v)
      if i in collect:
        collected.append(x_btd)
    kv = None
    if cache is not None and keys:
      kv = (jnp.stack(keys), jnp.stack(values))
    elif cache is not None:  # an empty span (a merge above the top layer): no layer's entries
      attn = self.layers[0].self_attn
      empty = jnp.zeros((0, *x_btd.shape[:2], attn.num_kv_heads, attn.head_dim), x_btd.dtype)
      kv = (empty, empty)
    return x_btd, collected, kv

  def _scanned(self, x_btd, positions_bt, mask_bts, collect, merged_bt, start, stop):
    graphdef = nnx.graphdef(self.layers[start])
    stacked = jax.tree.map(lambda *w: jnp.stack(w),
                           *[nnx.state(l) for l in self.layers[start:stop]])

    def body(x, state):
      x, _ = nnx.merge(graphdef, state)(x, positions_bt, mask_bts, merged_bt=merged_bt)
      x = sharding.constrain_rows(x)
      return x, x

    if self.remat == "layers":
      body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
    x_btd, outputs = jax.lax.scan(body, x_btd, stacked)
    return x_btd, [outputs[i - start] for i in collect], None


def set_layer_execution(model: nnx.Module, scan: bool, remat: str = "none") -> None:
  """How every decoder stack of `model` runs an uncached forward (DecoderStack: `scan`,
  `remat`), in place; part of the model's graph, so programs traced after this follow it."""
  if remat not in REMAT:
    raise ValueError(f"remat={remat!r}: use one of {', '.join(REMAT)}")
  for _, node in nnx.iter_graph(model):
    if isinstance(node, DecoderStack):
      node.scan, node.remat = scan, remat


def set_attention(model: nnx.Module, kernel: str) -> None:
  """The kernel every attention layer of `model` runs packed rows (a PackedMask) with, "xla"
  or "cudnn" (attention.choose_attention picks it), in place; part of the model's graph."""
  if kernel not in ("xla", "cudnn"):
    raise ValueError(f"attention kernel {kernel!r}: use xla or cudnn")
  for _, node in nnx.iter_graph(model):
    if isinstance(node, Attention):
      node.kernel = kernel


@dataclasses.dataclass
class BaseOutput:
  hidden: jax.Array  # [B, T, D] final-normed last layer (a span short of it: its raw output)
  collected: list[jax.Array]  # residual outputs of the requested layers, each [B, T, D]
  cache: Any = None  # the cache with the inputs' entries written (write=True)
  kv: KV | None = None  # the inputs' keys and values (with a cache)


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

  def forward(self, x_btd: jax.Array, positions_bt: jax.Array, mask_bts: Mask | None = None,
              cache=None, slots_bt: jax.Array | None = None, collect: Sequence[int] = (),
              merged_bt=None, write: bool = True,
              span: tuple[int, int] | None = None, norm: bool = True) -> BaseOutput:
    """Without a cache: inputs attending among themselves under `mask_bts`. With one: inputs at
    cache slots `slots_bt` after its earlier entries; `write` puts their keys and values in it
    (else the caller writes `kv`, e.g. after a branch that must not carry the cache).
    `merged_bt` marks merged-entry inputs, where base adapters act (Linear); None (prompt,
    base mode) runs the exact base weights everywhere. `span` (start, stop): those layers only
    (DecoderStack); `hidden` is final-normed where the span ends at the last layer and `norm`,
    else the raw residual stream (what a merge at layer L hands its upper layers)."""
    x, collected, kv = self.decoder(x_btd, positions_bt, mask_bts,
                                    None if cache is None else cache.view(), slots_bt, collect,
                                    merged_bt, span)
    if cache is not None and write:
      cache = cache.write_layers(slots_bt, *kv)
    top = span is None or span[1] == self.cfg.num_layers
    return BaseOutput(self.norm(x) if top and norm else x, collected, cache, kv)

  def __call__(self, ids_bt: jax.Array, segment_ids_bt: jax.Array | None = None,
               positions_bt: jax.Array | None = None,
               merged_bt: jax.Array | None = None) -> jax.Array:
    """Plain uncached forward: token ids -> fp32 logits [B, T, V] (adapters only at merged_bt)."""
    b, t = ids_bt.shape
    if segment_ids_bt is None:
      segment_ids_bt = jnp.ones((b, t), jnp.int32)
    if positions_bt is None:
      positions_bt = jnp.broadcast_to(jnp.arange(t), (b, t))
    out = self.forward(self.embed(ids_bt), positions_bt, PackedMask(segment_ids_bt),
                       merged_bt=merged_bt)
    return self.logits(out.hidden)
