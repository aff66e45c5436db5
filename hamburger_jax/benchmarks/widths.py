"""What a base forward of w rows costs against one of 1 row, and how close to the memory roofline
it runs (`python -m infer.bench --mode widths`).

Decoding is memory-bound: a forward streams every weight once whatever its row count, so on a
kernel that reaches the machine's bandwidth w rows cost about what 1 row costs, up to the width
where the FLOPs catch up. Two shapes of rows are timed:
  slots: w sequences, one new token each (serving w slots; the KV cache is read once per row);
  tokens: one sequence, w new tokens in one forward (a prefill chunk, a multi-token step).
Each step is a base forward with its LM head and greedy argmax over the last row of each
sequence, run `STEPS` at a time in one jitted loop with the cache donated, as the engine's
decode loop runs it (no host dispatch between steps).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
from flax import nnx

from hamburger_jax.costs import analytic
from hamburger_jax.decode.step_costs import KV_ENTRIES, STEPS, step_loop  # noqa: F401  (the benches')
from hamburger_jax.model.kv_cache import KVCache
from hamburger_jax.model.llama import Llama

SHAPES = ("slots", "tokens")


@dataclasses.dataclass(frozen=True)
class WidthCost:
  shape: str
  width: int
  step_s: float
  bytes_read: int  # weights once + the KV cache each sequence reads

  @property
  def gb_s(self) -> float:
    return self.bytes_read / self.step_s / 1e9


def weight_bytes(base: Llama) -> int:
  """Bytes of the base's weights a forward streams (a tied head counted once: one matrix)."""
  return sum(v.size * v.dtype.itemsize for _, v in nnx.to_flat_state(nnx.state(base, nnx.Param)))


def forward_loop(base: Llama, shape: str, width: int, kv_len: int, sequences: int = 1):
  """(fn, args): `fn(params, cache, x)` runs STEPS base forwards of `width` rows (step_loop) and
  returns (tokens, cache); the cache holds `kv_len` entries per sequence before the first.
  Shape "tokens" takes `width` new tokens in each of `sequences` sequences (a verify step of a
  batch)."""
  if shape not in SHAPES:
    raise ValueError(f"shape={shape!r}: use one of {SHAPES}")
  cfg = base.cfg
  graphdef, params = nnx.split(base)
  batch, rows = (width, 1) if shape == "slots" else (sequences, width)
  dtype = jnp.dtype(cfg.dtype)

  def step(m, x, cache):
    pos = cache.length[:, None] + jnp.arange(rows)[None]
    out = m.forward(x, pos, None, cache, pos)
    # The cache's length stays: every step writes the same slots and reads the same entries.
    return jnp.argmax(m.logits(out.hidden[:, -1]), axis=-1).astype(jnp.int32), out.cache

  cache = KVCache.init(cfg.num_layers, batch, kv_len + rows, cfg.num_kv_heads, cfg.head_dim,
                       dtype).replace(length=jnp.full((batch,), kv_len, jnp.int32))
  x = jax.random.normal(jax.random.key(0), (batch, rows, cfg.hidden_size), jnp.float32) * 0.02
  return step_loop(graphdef, step), (params, cache, x.astype(dtype))


def measure(base: Llama, widths: list[int], kv_len: int, repeats: int,
            shapes: tuple[str, ...] = SHAPES) -> list[WidthCost]:
  """Every (shape, width), interleaved over `repeats` rounds (each keeps its best), so the
  machine's drift hits them alike."""
  runs = {(s, w): forward_loop(base, s, w, kv_len) for s in shapes for w in widths}
  compiled, state = {}, {}
  for key, (fn, (params, cache, x)) in runs.items():
    compiled[key] = fn.lower(params, cache, x).compile()
    state[key] = cache
  best = {key: float("inf") for key in runs}
  for _ in range(repeats + 1):  # the first round warms up
    for key, (_, (params, _, x)) in runs.items():
      t = time.perf_counter()
      token, state[key] = compiled[key](params, state[key], x)
      jax.block_until_ready(token)
      best[key] = min(best[key], (time.perf_counter() - t) / STEPS)
  wb = weight_bytes(base)
  return [WidthCost(s, w, best[(s, w)], wb + analytic.kv_bytes(
      base.cfg, base.cfg.num_layers, w if s == "slots" else 1, kv_len)) for s, w in runs]


def report(costs: list[WidthCost], copy_gb_s: float) -> list[str]:
  """Markdown rows: per shape and width, the step time, its cost relative to 1 row, the bytes
  it must read, the bandwidth achieved and its fraction of the copy bandwidth (the roofline)."""
  one = {c.shape: c.step_s for c in costs if c.width == 1}
  lines = ["| rows as | width | step ms | vs 1 row | MB read | GB/s | of copy bandwidth |",
           "|---|---|---|---|---|---|---|"]
  for c in costs:
    rel = f"{c.step_s / one[c.shape]:.2f}x" if c.shape in one else "-"
    lines.append(f"| {c.shape} | {c.width} | {1e3 * c.step_s:.1f} | {rel} | "
                 f"{c.bytes_read / 1e6:.0f} | {c.gb_s:.1f} | {c.gb_s / copy_gb_s:.0%} |")
  return lines


# ---------------------------------------------------------------- projection variants

VARIANTS = ("separate f32", "fused f32", "separate bf16")


def projection_stack(cfg, variant: str, width: int):
  """(fn, weights): the decoder layers' projections alone (no attention, norms or cache) for
  `width` rows, as the model lays them out ("separate": q, k, v, o, gate, up, down), fused as
  MaxText and llama.cpp do (one q|k|v and one gate|up matmul), or stored in bfloat16 (bf16 x
  bf16 -> f32 dots; one row is padded to two, since XLA:CPU's bf16 matrix-vector path runs at
  ~1.4 GB/s). Random weights, one list entry per layer (no stacked weight is sliced)."""
  d, f = cfg.hidden_size, cfg.intermediate_size
  q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  fused = variant.startswith("fused")
  wdt = jnp.bfloat16 if variant.endswith("bf16") else jnp.float32
  shapes = ({"qkv": (d, q + 2 * kv), "o": (q, d), "gu": (d, 2 * f), "down": (f, d)} if fused else
            {"q": (d, q), "k": (d, kv), "v": (d, kv), "o": (q, d), "gate": (d, f), "up": (d, f),
             "down": (f, d)})
  key = jax.random.key(0)
  weights = [{name: (0.02 * jax.random.normal(jax.random.fold_in(key, 8 * i + j), s)).astype(wdt)
              for j, (name, s) in enumerate(shapes.items())} for i in range(cfg.num_layers)]

  def dot(x, w):
    if w.dtype == jnp.float32:
      return x @ w
    n = x.shape[0]
    xb = x.astype(w.dtype)
    xb = jnp.concatenate([xb, xb]) if n == 1 else xb
    return jnp.dot(xb, w, preferred_element_type=jnp.float32)[:n]

  def run(x, weights):
    def body(_, x):
      for w in weights:
        if fused:
          a = dot(x, w["qkv"])
          a = a[:, :q] + jnp.sum(a[:, q:]) * 1e-9  # k and v feed the cache in the model
          x = x + dot(a, w["o"])
          gu = dot(x, w["gu"])
          h = jax.nn.silu(gu[:, :f]) * gu[:, f:]
        else:
          a = dot(x, w["q"]) + (jnp.sum(dot(x, w["k"])) + jnp.sum(dot(x, w["v"]))) * 1e-9
          x = x + dot(a, w["o"])
          h = jax.nn.silu(dot(x, w["gate"])) * dot(x, w["up"])
        x = (x + dot(h, w["down"])) * 0.5
      return x
    return jax.lax.fori_loop(0, STEPS, body, x)

  x = jnp.full((width, d), 0.01, jnp.float32)
  return jax.jit(run), (x, weights)


def measure_variants(cfg, widths: list[int], repeats: int,
                     variants: tuple[str, ...] = VARIANTS) -> dict[tuple[str, int], float]:
  """Seconds per pass of each (variant, width), interleaved over `repeats` rounds (best kept)."""
  runs = {(v, w): projection_stack(cfg, v, w) for v in variants for w in widths}
  compiled = {key: fn.lower(*args).compile() for key, (fn, args) in runs.items()}
  best = {key: float("inf") for key in runs}
  for _ in range(repeats + 1):
    for key, (_, args) in runs.items():
      t = time.perf_counter()
      jax.block_until_ready(compiled[key](*args))
      best[key] = min(best[key], (time.perf_counter() - t) / STEPS)
  return best


def report_variants(cfg, best: dict[tuple[str, int], float], copy_gb_s: float) -> list[str]:
  widths = sorted({w for _, w in best})
  variants = list(dict.fromkeys(v for v, _ in best))
  per_layer = analytic.layer_params(cfg) - 2 * cfg.hidden_size  # the projections (no norms)
  lines = ["| projections | " + " | ".join(f"{w} rows ms (vs 1)" for w in widths) +
           " | GB/s at 1 row (of copy) |", "|---" * (len(widths) + 2) + "|"]
  for v in variants:
    nbytes = cfg.num_layers * per_layer * (2 if v.endswith("bf16") else 4)
    gb_s = nbytes / best[(v, widths[0])] / 1e9
    cells = [f"{1e3 * best[(v, w)]:.1f} ({best[(v, w)] / best[(v, widths[0])]:.2f}x)"
             for w in widths]
    lines.append(f"| {v} | " + " | ".join(cells) + f" | {gb_s:.1f} ({gb_s / copy_gb_s:.0%}) |")
  return lines
