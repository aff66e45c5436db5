"""Grouped-query softmax attention: the dense kernel every cache layout ends in on CPU, and for
packed training rows (segments of a row attend causally within themselves) cuDNN's fused
kernel on a GPU, chosen at run time (`choose_attention`) after a numeric check against XLA and
a timing against it at the step's row shape. Passing the check is not enough: a window's train
step with cuDNN's packed kernel took 794 ms on an H200 (JAX 0.11.2), its attention kernels 80% of
the device time, against 389 ms with XLA's on an H100 the day before (docs/results/training.md)."""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
# The packed (segment) layout is not in jax.nn.dot_product_attention's signature; jax.nn
# imports this module on every backend. It is private: a JAX that moves it costs the fused
# kernel (XLA's runs, and choose_attention says why), not the import of the model.
try:
  from jax._src.cudnn import fused_attention_stablehlo as cudnn
except ImportError as e:  # pragma: no cover - depends on the installed JAX
  cudnn, _CUDNN_IMPORT_ERROR = None, f"{type(e).__name__}: {e}"
else:
  _CUDNN_IMPORT_ERROR = None

from hamburger_jax.config import LlamaConfig


def causal_segment_mask(segment_ids_bt: jax.Array) -> jax.Array:
  """[B, T, T] block-diagonal causal mask for packed rows; segment id 0 is padding."""
  t = segment_ids_bt.shape[1]
  causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
  same = segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]
  # Padding rows attend to themselves so their softmax stays finite (their outputs are unused).
  pad_self = (segment_ids_bt[:, :, None] == 0) & jnp.eye(t, dtype=bool)
  return (causal & same & (segment_ids_bt[:, :, None] > 0)) | pad_self


@struct.dataclass
class PackedMask:
  """causal_segment_mask of packed rows, kept as their segment ids [B, T] (0: padding; each
  segment one contiguous run, as packing lays them): a fused kernel takes the segments, the
  dense kernel the mask they make."""
  segment_ids_bt: jax.Array


def attend(q_bthd: jax.Array, k_bskd: jax.Array, v_bskd: jax.Array,
           mask_bts: jax.Array) -> jax.Array:
  """Grouped-query softmax attention in fp32; mask True = may attend. Returns [B, T, H*Dh]
  (head h = kv * G + g). q is [B, T, H, Dh], or [B, T, G, Hkv, Dh] (a fused q|k|v kernel's
  layout, taken as it is: no transpose)."""
  b, t = q_bthd.shape[:2]
  dh = q_bthd.shape[-1]
  hkv = k_bskd.shape[2]
  if q_bthd.ndim == 5:
    spec = "btgkd,bskd->bkgts"
    q = q_bthd
  else:
    spec = "btkgd,bskd->bkgts"
    q = q_bthd.reshape(b, t, hkv, -1, dh)
  scores = jnp.einsum(spec, q, k_bskd,
                      preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(dh))
  scores = jnp.where(mask_bts[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_bskd.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v_bskd)
  return out.reshape(b, t, -1)


def attend_with_new(q_bthd: jax.Array, k_bskd: jax.Array, v_bskd: jax.Array, k_new: jax.Array,
                    v_new: jax.Array, slots_bt: jax.Array) -> jax.Array:
  """Attention over S cached entries (a row's view: slot s at index s) and T new ones: a new
  input sees the cached slots before the first new one and the new inputs up to itself. The
  new keys and values are rounded to the cache's dtype first, as a later read would see them.
  [B, T, H*Dh]."""
  t = q_bthd.shape[1]
  b, s = k_bskd.shape[:2]
  dt = k_bskd.dtype
  k = jnp.concatenate([k_bskd, k_new.astype(dt)], axis=1).astype(q_bthd.dtype)
  v = jnp.concatenate([v_bskd, v_new.astype(dt)], axis=1).astype(q_bthd.dtype)
  old = jnp.broadcast_to(jnp.arange(s)[None, None, :] < slots_bt[:, :1, None], (b, t, s))
  new = jnp.broadcast_to(jnp.tri(t, dtype=bool)[None], (b, t, t))
  return attend(q_bthd, k, v, jnp.concatenate([old, new], axis=-1))



def segment_runs(segment_ids_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Each row's runs of equal segment ids (padding runs too), as cuDNN's packed layout takes
  them: lengths [B, T] and start offsets [B, T + 1], int32, left-aligned and -1 after a row's
  last run. T runs bound a row, so the shapes are static."""
  b, t = segment_ids_bt.shape
  pos = jnp.arange(t, dtype=jnp.int32)
  starts = jnp.concatenate([jnp.ones((b, 1), bool),
                            segment_ids_bt[:, 1:] != segment_ids_bt[:, :-1]], axis=1)
  # Start positions first, in order; t fills the rest (sorting keeps them left-aligned).
  first = jnp.sort(jnp.where(starts, pos, t), axis=1)
  ends = jnp.concatenate([first[:, 1:], jnp.full((b, 1), t, jnp.int32)], axis=1)
  live = first < t
  lengths = jnp.where(live, ends - first, -1)
  offsets = jnp.concatenate([jnp.where(live, first, -1), jnp.full((b, 1), -1, jnp.int32)], 1)
  return lengths.astype(jnp.int32), offsets.astype(jnp.int32)


def runs_mask(lengths_bm: jax.Array, offsets_bm: jax.Array, t: int) -> jax.Array:
  """[B, T, T] the mask cuDNN's packed causal attention means by these runs: a token sees the
  tokens of its own run up to itself."""
  pos = jnp.arange(t)
  start = offsets_bm[:, :lengths_bm.shape[1], None]
  member = (pos >= start) & (pos < start + lengths_bm[:, :, None]) & (lengths_bm[:, :, None] > 0)
  same = jnp.einsum("bmt,bms->bts", member.astype(jnp.int32), member.astype(jnp.int32)) > 0
  return same & (pos[:, None] >= pos[None, :])


def fused_packed_attention(q_bthd: jax.Array, k_bskd: jax.Array, v_bskd: jax.Array,
                           segment_ids_bt: jax.Array, implementation: str = "cudnn"
                           ) -> jax.Array:
  """Packed rows' attention through cuDNN's fused kernel in its packed layout (segment runs;
  padding runs attend among themselves: their outputs are unused), [B, T, H*Dh] as `attend`.
  implementation "xla" runs the same operands through XLA with the mask the runs mean (the
  call's shape, checkable on a CPU)."""
  b, t = q_bthd.shape[:2]
  dh = q_bthd.shape[-1]
  if q_bthd.ndim == 5:  # [B, T, G, Hkv, Dh] -> head kv * G + g, attend's order
    q_bthd = jnp.swapaxes(q_bthd, 2, 3)
  q = q_bthd.reshape(b, t, -1, dh)
  lengths, offsets = segment_runs(segment_ids_bt)
  scale = 1.0 / math.sqrt(dh)
  if implementation == "cudnn":
    out = cudnn.dot_product_attention(
        q, k_bskd, v_bskd, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets,
        kv_offsets=offsets, scale=scale, mask_type=cudnn.MaskType.PADDING_CAUSAL,
        qkv_layout="BTNH")
  elif implementation == "xla":
    mask = runs_mask(lengths, offsets, t)[:, None]
    out = jax.nn.dot_product_attention(q, k_bskd, v_bskd, mask=mask, scale=scale,
                                       implementation="xla")
  else:
    raise ValueError(f"implementation={implementation!r}: use cudnn or xla")
  return out.reshape(b, t, -1)


def attend_packed(q_bthd: jax.Array, k_bskd: jax.Array, v_bskd: jax.Array,
                  segment_ids_bt: jax.Array, kernel: str = "xla") -> jax.Array:
  """Packed rows' attention by `kernel` ("xla": attend over causal_segment_mask; "cudnn":
  fused_packed_attention). Outputs at padding differ between them and are unused."""
  if kernel == "cudnn":
    return fused_packed_attention(q_bthd, k_bskd, v_bskd, segment_ids_bt)
  return attend(q_bthd, k_bskd, v_bskd, causal_segment_mask(segment_ids_bt))


def fused_unavailable(cfg: LlamaConfig) -> str | None:
  """Why cuDNN's fused kernel cannot run this model's attention here (None: it may)."""
  if jax.default_backend() != "gpu":
    return f"the backend is {jax.default_backend()}, not a GPU"
  if cudnn is None:
    return f"this JAX has no jax._src.cudnn.fused_attention_stablehlo ({_CUDNN_IMPORT_ERROR})"
  if cfg.dtype not in ("bfloat16", "float16"):
    return f"model dtype {cfg.dtype}: cuDNN's fused attention takes bfloat16 or float16"
  if cfg.head_dim % 8 or cfg.head_dim > 128:
    return f"head_dim {cfg.head_dim}: cuDNN's fused attention wants a multiple of 8, <= 128"
  return None


# The check's rows: several segments and trailing padding in one, a single segment in the other.
_CHECK_SEGMENTS = (((1, 100), (2, 60), (3, 80), (0, 16)), ((1, 256),))
CHECK_TOLERANCE = 3e-2  # max |cudnn - xla| over max |xla|: a few bf16 roundings


def fused_attention_error(cfg: LlamaConfig) -> str | None:
  """cuDNN's packed attention against the XLA kernel on a small random batch of this model's
  heads and dtype, outputs and gradients at the segments' tokens: None when they agree within
  CHECK_TOLERANCE, else what went wrong (an error, or the largest difference), in one line."""
  dt = jnp.dtype(cfg.dtype)
  seg = jnp.asarray(np.array([np.concatenate([np.full(n, s) for s, n in row])
                              for row in _CHECK_SEGMENTS], np.int32))
  b, t = seg.shape
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (b, t, cfg.num_heads, cfg.head_dim)).astype(dt)
  k, v = (jax.random.normal(key, (b, t, cfg.num_kv_heads, cfg.head_dim)).astype(dt)
          for key in keys[1:3])
  # Cotangents only at the segments' tokens: padding's outputs are not compared, nor fed back.
  w = jax.random.normal(keys[3], (b, t, cfg.num_heads * cfg.head_dim)) * (seg > 0)[..., None]

  def outputs(kernel):
    loss = lambda q, k, v: jnp.sum(attend_packed(q, k, v, seg, kernel).astype(jnp.float32) * w)
    out = attend_packed(q, k, v, seg, kernel) * (seg > 0)[..., None]
    return (out, *jax.grad(loss, argnums=(0, 1, 2))(q, k, v))

  try:
    got = jax.jit(lambda: outputs("cudnn"))()
    want = jax.jit(lambda: outputs("xla"))()
    for name, a, x in zip(("output", "dq", "dk", "dv"), got, want):
      a, x = np.asarray(a, np.float32), np.asarray(x, np.float32)
      err = float(np.max(np.abs(a - x)) / max(float(np.max(np.abs(x))), 1e-6))
      if not err <= CHECK_TOLERANCE:
        return f"{name} differs from XLA's by {err:.3g} of its largest value"
  except Exception as e:  # pylint: disable=broad-except
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
  return None


def choose_attention(setting: str, cfg: LlamaConfig, check: bool = True,
                     shape: tuple[int, int] | None = None,
                     timer: Callable[..., dict[str, float]] | None = None
                     ) -> tuple[str, str | None]:
  """The packed rows' kernel for model.attention `setting` (config.ATTENTION), and, when cuDNN
  was asked for (or "auto" on a GPU) but XLA's runs, why, in one line. `check`: run
  fused_attention_error first (off for a compile-only trainer: no device to run on). `shape`
  (rows a device, tokens a row): "auto" also times both kernels there (`timer`, default
  packed_kernel_seconds) and keeps cuDNN's only where it is the faster."""
  if setting == "xla":
    return "xla", None
  why = fused_unavailable(cfg)
  if why is not None:
    # "auto" off a GPU is the plain case, not a fallback worth a line.
    return "xla", (why if setting == "cudnn" or jax.default_backend() == "gpu" else None)
  why = fused_attention_error(cfg) if check else None
  if why:
    return "xla", why
  if setting == "auto" and check and shape is not None:
    s = (timer or packed_kernel_seconds)(cfg, *shape)
    if not s["cudnn"] < s["xla"]:
      return "xla", (f"slower here: {1e3 * s['cudnn']:.2f} ms against XLA's "
                     f"{1e3 * s['xla']:.2f} ms a forward and backward of one layer's attention "
                     f"over {shape[0]} packed rows of {shape[1]} tokens")
  return "cudnn", None


# The timing's rows: TIMING_SEGMENTS equal segments, the last cut short by 1/16 of the row left
# as padding (how packing fills a row: a few samples, then what does not fit).
TIMING_SEGMENTS = 4


def timing_segments(rows: int, t: int) -> np.ndarray:
  """[rows, t] segment ids of the timing's packed rows (0: padding)."""
  row = np.minimum(np.arange(t) * TIMING_SEGMENTS // t + 1, TIMING_SEGMENTS).astype(np.int32)
  row[t - t // 16:] = 0
  return np.broadcast_to(row, (rows, t)).copy()


def packed_kernel_seconds(cfg: LlamaConfig, rows: int, t: int, repeats: int = 3,
                          kernels: Sequence[str] = ("cudnn", "xla")) -> dict[str, float]:
  """Seconds of one layer's packed attention, forward and backward, by each kernel over `rows`
  rows of `t` tokens (timing_segments) in the model's dtype: the best of `repeats` after a
  compile and a warm-up call."""
  dt = jnp.dtype(cfg.dtype)
  seg = jnp.asarray(timing_segments(rows, t))
  keys = jax.random.split(jax.random.key(1), 3)
  q = jax.random.normal(keys[0], (rows, t, cfg.num_heads, cfg.head_dim)).astype(dt)
  k, v = (jax.random.normal(key, (rows, t, cfg.num_kv_heads, cfg.head_dim)).astype(dt)
          for key in keys[1:])
  out = {}
  for kernel in kernels:
    loss = lambda q, k, v, kernel=kernel: jnp.sum(
        attend_packed(q, k, v, seg, kernel).astype(jnp.float32))
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    jax.block_until_ready(step(q, k, v))
    best = float("inf")
    for _ in range(repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(step(q, k, v))
      best = min(best, time.perf_counter() - t0)
    out[kernel] = best
  return out
