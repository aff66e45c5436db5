"""The weights as decoding runs them, made from the layout checkpoints, converters and training
use (one kernel per projection, merged-entry adapters as LoRA):

- fused projections: q|k|v one kernel [D, G + 2, Hkv, Dh] (every KV head's G query heads,
  then the keys, then the values), gate|up one kernel [D, 2, F]; in the base and the micro
  decoder. Fewer, wider matmuls: on a GPU or TPU a small model's decode step is bound by how many kernels it
  launches.
- folded adapters: each adapted kernel also stored with its adapter folded in (W + scale a b),
  so a merged entry costs one matmul like any other entry (model/lora.py: FoldedAdapter).
- a dtype: e.g. bfloat16 weights and activations on an accelerator (norms, softmax and logits
  stay float32 in the model code).

The model the engine decodes is `decode_layout(model)`; the model given stays as it is.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from hamburger_jax.config import HamburgerConfig, LlamaConfig
from hamburger_jax.model.hamburger import Hamburger
from hamburger_jax.model.llama import Linear, Llama

DTYPES = ("float32", "bfloat16")


def decode_layout(model: Llama | Hamburger, *, fused: bool = True,
                  dtype: str | None = None) -> Llama | Hamburger:
  """`model` in the decoding layout (the module docstring): fused projections unless
  `fused=False`, folded adapters, weights and compute in `dtype` (None: the model's). The
  same math: equal outputs up to rounding (model/llama.py: Linear, ALL_MERGED)."""
  if dtype is not None and dtype not in DTYPES:
    raise ValueError(f"dtype={dtype!r}: use one of {', '.join(DTYPES)}")
  hamburger = isinstance(model, Hamburger)
  base_cfg = model.cfg.base if hamburger else model.cfg
  if base_cfg.fused_projections:
    raise ValueError("the model is in the decoding layout already")
  cfg = dataclasses.replace(base_cfg, fused_projections=fused, dtype=dtype or base_cfg.dtype,
                            param_dtype=dtype or base_cfg.param_dtype)
  if hamburger:
    adapters = model.cfg.graft.base_lora_rank > 0
    out = nnx.eval_shape(lambda: Hamburger(HamburgerConfig(cfg, model.cfg.graft),
                                           rngs=nnx.Rngs(0), folded_adapters=True))
  else:
    adapters = False
    out = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
  if not fused and not adapters and cfg == base_cfg:
    return model  # nothing to change: decode the model's own arrays
  src = {tuple(p): v[...] for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  # Each adapted projection's kernel with its adapter folded in, by the projection's path.
  folded = {tuple(p): node.lora.folded(node.kernel[...]) for p, node in nnx.iter_graph(model)
            if isinstance(node, Linear) and node.lora is not None}
  for path, var in nnx.to_flat_state(nnx.state(out)):
    var.set_value(jnp.asarray(_value(src, folded, tuple(path), cfg), var.dtype))
  if hamburger and model.micro_ids is not None:
    out.set_micro_vocab(np.asarray(model.micro_ids[...]))
  return out


def _value(src: dict, folded: dict, path: tuple, cfg: LlamaConfig):
  """The decoding layout's value at `path`, from the source model's params `src` and folded
  kernels `folded`."""
  *prefix, name = path
  adapter = name == "kernel" and len(prefix) >= 2 and prefix[-1] == "lora"  # a folded kernel
  if adapter:
    prefix = prefix[:-1]  # the projection the adapter belongs to
  if not prefix:
    return src[path]
  *owner, proj = prefix

  def kernel(p: str):
    """Projection `p` beside this one, [in, out]: folded for an adapter's kernel."""
    return folded[(*owner, p)] if adapter else src[(*owner, p, "kernel")]

  if proj == "qkv_proj":
    h, hkv, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    d, g = cfg.hidden_size, h // hkv
    q, k, v = (kernel(p) for p in ("q_proj", "k_proj", "v_proj"))
    # Query head h = kv * G + g goes to [g, kv]: each group's heads at one index of the KV axis.
    q = q.reshape(d, hkv, g, dh).transpose(0, 2, 1, 3)
    return jnp.concatenate([q, k.reshape(d, 1, hkv, dh), v.reshape(d, 1, hkv, dh)], axis=1)
  if proj == "gate_up_proj":
    return jnp.stack([kernel("gate_proj"), kernel("up_proj")], axis=1)
  return kernel(proj) if adapter else src[path]
