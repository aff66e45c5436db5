"""The weights as decoding runs them, made from the layout checkpoints, converters and training
use (one kernel per projection, merged-entry adapters as LoRA):

- fused projections: q|k|v one kernel [D, G + 2, Hkv, Dh] (every KV head's G query heads,
  then the keys, then the values), gate|up one kernel [D, 2, F]; in the base and the micro
  decoder. Fewer, wider matmuls: on a GPU or TPU a small model's decode step is bound by how
  many kernels it launches.
- folded adapters: each adapted kernel also stored with its adapter folded in (W + scale a b),
  so a step whose live entries are all merged costs one matmul a projection like any other;
  and its factors (a, scale b; block-diagonal in a fused kernel's projections), so a step of
  merged and plain entries can read the kernel once: x W, plus (x a) b on the merged rows
  (model/lora.py: FoldedAdapter; the form is the backend's, hamburger_jax/precision.py).
- a dtype: e.g. bfloat16 weights and activations on an accelerator (norms, softmax and logits
  stay float32 in the model code).

Folding in bfloat16: W + BA is summed in float32 and rounded once (`fold`). The rounding keeps
BA only to W's precision (`fold_errors`: ||round(W + BA) - round(W) - BA|| is 0.25 of ||BA|| on
the shipped graft, on average), yet round(W + BA) is the bfloat16 kernel nearest the float32
adapted one: as far from it as the bfloat16 base from the float32 base, and with no bias toward
W (round(W + BA) - round(W) is BA on average over W's low bits). Teacher-forced, bfloat16
HAMburger follows float32 as closely as the bfloat16 base does, after merged entries as after
the others (docs/results/fidelity.md), so the fold stays: BA kept apart would cost two more
matmuls a projection in every merged step, a float32 folded kernel twice its bytes. In the
"factors" form a mixed step's merged rows take the factors' change unrounded into W: they
differ from the folded kernel's output by that rounding (float32: last bits; bfloat16: as
above).

The model the engine decodes is `decode_layout(model)`; the model given stays as it is. What
decode_layout makes is marked (`is_decoding_layout`), fused or not: exports refuse it
(convert/mapping.py: check_training_layout), since a folded adapter is no LoRA to save.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hamburger_jax.config import HamburgerConfig, LlamaConfig
from hamburger_jax.model import lora
from hamburger_jax.model.abstract import abstract
from hamburger_jax.model.hamburger import Hamburger
from hamburger_jax.model.llama import FUSED, Linear, Llama, dtype_of

DTYPES = ("float32", "bfloat16")
# The attribute decode_layout sets on the model it makes and on every module in it (its base
# too: a converter may be handed the base alone).
MARKER = "decoding_layout"


def decode_layout(model: Llama | Hamburger, *, fused: bool = True,
                  dtype: str | None = None, mixed: str = "factors") -> Llama | Hamburger:
  """`model` in the decoding layout (the module docstring): fused projections unless
  `fused=False`, folded adapters whose steps of merged and plain entries run in the form
  `mixed` (lora.MIXED_FORMS), weights and compute in `dtype` (None: the model's). The
  same math: equal outputs up to rounding (model/llama.py: Linear, ALL_MERGED). Marked
  (`is_decoding_layout`) whatever `fused` is; a model with nothing to change (no adapters,
  separate projections, its own dtype) comes back as it is, unmarked: it is its own layout."""
  if dtype is not None and dtype not in DTYPES:
    raise ValueError(f"dtype={dtype!r}: use one of {', '.join(DTYPES)}")
  if mixed not in lora.MIXED_FORMS:
    raise ValueError(f"mixed={mixed!r}: use one of {', '.join(lora.MIXED_FORMS)}")
  hamburger = isinstance(model, Hamburger)
  base_cfg = model.cfg.base if hamburger else model.cfg
  if base_cfg.fused_projections or is_decoding_layout(model):
    raise ValueError("the model is in the decoding layout already: lay out the model it was "
                     "made from")
  cfg = dataclasses.replace(base_cfg, fused_projections=fused, dtype=dtype or base_cfg.dtype,
                            param_dtype=dtype or base_cfg.param_dtype)
  if hamburger:
    adapters = model.cfg.graft.base_lora_rank > 0
    out = abstract(lambda rngs: Hamburger(HamburgerConfig(cfg, model.cfg.graft), rngs=rngs,
                                          folded_adapters=mixed))
  else:
    adapters = False
    out = abstract(lambda rngs: Llama(cfg, rngs=rngs))
  if not fused and not adapters and cfg == base_cfg:
    return model  # nothing to change: decode the model's own arrays
  src = {tuple(p): v[...] for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  # Each adapted projection's kernel with its adapter folded in, by the projection's path.
  adapted = [(tuple(p), node) for p, node in nnx.iter_graph(model)
             if isinstance(node, Linear) and node.lora is not None]
  folded = {p: fold(node.kernel[...], node.lora, dtype_of(cfg.param_dtype))
            for p, node in adapted}
  factors = {p: factors_of(node.lora, dtype_of(cfg.param_dtype)) for p, node in adapted}
  for path, var in nnx.to_flat_state(nnx.state(out)):
    var.set_value(jnp.asarray(_value(src, folded, factors, tuple(path), cfg), var.dtype))
  if hamburger and model.micro_ids is not None:
    out.set_micro_vocab(np.asarray(model.micro_ids[...]))
  for _, node in nnx.iter_graph(out):
    if isinstance(node, nnx.Module):
      setattr(node, MARKER, True)
  return out


def is_decoding_layout(model: nnx.Module) -> bool:
  """Whether `model`, or a module in it, was made by decode_layout."""
  return any(isinstance(node, nnx.Module) and getattr(node, MARKER, False) is True
             for _, node in nnx.iter_graph(model))


def fold(kernel: jax.Array, adapter: lora.LoRA, dtype) -> jax.Array:
  """The kernel a merged entry is multiplied by, in `dtype`: W + scale a b summed in float32
  and rounded once (the module docstring says why this holds in bfloat16)."""
  if isinstance(adapter, lora.FoldedAdapter):
    raise ValueError("the adapter is folded already: fold the LoRA it was made from")
  delta = adapter.delta(jnp.float32).reshape(kernel.shape)
  return (kernel.astype(jnp.float32) + delta).astype(dtype)


def factors_of(adapter: lora.LoRA, dtype) -> tuple[jax.Array, jax.Array]:
  """The adapter's factors as a mixed step multiplies by them, in `dtype`: a, and scale b."""
  if isinstance(adapter, lora.FoldedAdapter):
    raise ValueError("the adapter is folded already: lay out the LoRA it was made from")
  b = adapter.scale * adapter.b[...].astype(jnp.float32)
  return adapter.a[...].astype(dtype), b.astype(dtype)


def fold_errors(model: Hamburger, dtype: str) -> dict[str, float]:
  """{dotted path of each adapted projection: ||F - W' - BA|| / ||BA||}, where F is its folded
  kernel and W' its plain kernel as the decoding layout in `dtype` holds them: how much of the
  adapter's change to the kernel rounding loses (0: none; 1 when F rounds back to W'). NaN for
  an adapter that is zero (b = 0 at init)."""
  if dtype not in DTYPES:
    raise ValueError(f"dtype={dtype!r}: use one of {', '.join(DTYPES)}")
  out = {}
  for path, node in nnx.iter_graph(model):
    if isinstance(node, Linear) and isinstance(node.lora, lora.LoRA):
      w = node.kernel[...]
      delta = node.lora.delta(jnp.float32).reshape(w.shape)
      kept = (fold(w, node.lora, dtype).astype(jnp.float32)
              - w.astype(dtype).astype(jnp.float32))
      size = float(jnp.linalg.norm(delta))
      out[".".join(map(str, path))] = (float(jnp.linalg.norm(kept - delta)) / size if size
                                       else float("nan"))
  return out


def _value(src: dict, folded: dict, factors: dict, path: tuple, cfg: LlamaConfig):
  """The decoding layout's value at `path`, from the source model's params `src`, folded
  kernels `folded` and adapter factors `factors` (a, scale b), each by its projection's path."""
  *prefix, name = path
  part = None  # of an adapter: "kernel" (folded), "a" or "b"
  if len(prefix) >= 2 and prefix[-1] == "lora":
    part, prefix = name, prefix[:-1]  # the projection the adapter belongs to
  if not prefix:
    return src[path]
  *owner, proj = prefix
  parts = [(*owner, p) for p in FUSED.get(proj, (proj,))]
  if part is None:
    if proj not in FUSED:
      return src[path]
    mats = [src[(*p, "kernel")] for p in parts]
  elif part == "kernel":
    mats = [folded[p] for p in parts]
  elif part == "a":
    return jnp.concatenate([factors[p][0] for p in parts], axis=1)
  else:  # b: block-diagonal, so each projection's outputs see only its own adapter's a
    bs = [factors[p][1] for p in parts]
    r = bs[0].shape[0]
    mats = [jnp.zeros((r * len(bs), b.shape[1]), b.dtype).at[i * r:(i + 1) * r].set(b)
            for i, b in enumerate(bs)]
  return _fused(proj, mats, cfg)


def _fused(proj: str, mats: list, cfg: LlamaConfig):
  """The [n, out] matrices of `proj`'s projections (FUSED) as its decoding kernel lays them out
  (n: the input size of a kernel, the rank of a factor b)."""
  if proj == "qkv_proj":
    h, hkv, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    g = h // hkv
    q, k, v = mats
    n = q.shape[0]
    # Query head h = kv * G + g goes to [g, kv]: each group's heads at one index of the KV axis.
    q = q.reshape(n, hkv, g, dh).transpose(0, 2, 1, 3)
    return jnp.concatenate([q, k.reshape(n, 1, hkv, dh), v.reshape(n, 1, hkv, dh)], axis=1)
  if proj == "gate_up_proj":
    return jnp.stack(mats, axis=1)
  return mats[0]
