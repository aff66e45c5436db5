"""What a decode step launches, counted without running it: the matmuls in its lowered program
(each `dot_general` is a kernel launch on a GPU, where a small model's step is bound by how many
kernels it launches, not by bytes), and, where libtpu is installed, the fusions of the program
compiled for one TPU v5e chip (each a kernel the TPU runs).

The unit steps (the decode benches time the same functions, in a loop):
  base:   a base forward of one entry per row with its LM head (the exact base weights);
  merged: the same reading a merged entry (the adapters acting: folded kernels);
  micro:  one micro step (the micro decoder on one new input) with its LM head and stop head;
  mixed:  a base step of merged and plain entries (every other row merged);
and the whole macro steps of decode/step_program.py: base mode, and HAMburger with forced
K-token groups.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from hamburger_jax import aot, platforms
from hamburger_jax.decode import step as decode_step
from hamburger_jax.decode.step_program import decode_step_program
from hamburger_jax.model.hamburger import Hamburger
from hamburger_jax.model.kv_cache import KVCache
from hamburger_jax.model.llama import ALL_MERGED, Llama

UnitStep = Callable[[Hamburger, jax.Array, KVCache], tuple[jax.Array, KVCache]]
TPU_TOPOLOGY = "v5e:2x2"  # one chip of it: libtpu describes slices of 4 chips or more


# `_base_step`'s merged entries in every other row: the per-row form a macro step runs when
# some rows' entries are merged and others' not (decode/step.py: advance).
ALTERNATE_ROWS = "alternate rows"


def _base_step(merged) -> UnitStep:
  def run(m: Hamburger | Llama, x_btd: jax.Array, cache: KVCache):
    """One entry per row at the cache's length (written there, the length kept: repeated
    steps cost the same), its features' LM head and argmax."""
    pos = cache.length[:, None]
    mode = "hamburger" if isinstance(m, Hamburger) else "base"
    rows = merged
    if merged == ALTERNATE_ROWS:
      rows = (jnp.arange(x_btd.shape[0]) % 2 == 0)[:, None]
    feats, cache = decode_step.forward_features(m, mode, x_btd, pos, cache, pos, rows)
    head = decode_step.base_of(m).logits(feats[:, 0, -1])
    return jnp.argmax(head, axis=-1).astype(jnp.int32), cache
  return run


def _micro_step(m: Hamburger, x_btd: jax.Array, cache: KVCache):
  """The engine's micro step 1 on new inputs x (one; or the F features and e(t0)), with the
  micro head's choice and the stop head (its decision folded into the token so that it is
  computed)."""
  h, cache = m.micro_step(1, x_btd, cache)
  token = m.micro_greedy(h).astype(jnp.int32)
  return token + (m.stop_logits(h) > 1e9).astype(jnp.int32), cache


# "mixed": a base step whose batch holds merged and unmerged entries (the adapters in the
# layout's mixed form on the merged rows: decode/step.py: advance, model/lora.py).
UNIT_STEPS: dict[str, UnitStep] = {"base": _base_step(None), "merged": _base_step(ALL_MERGED),
                                   "micro": _micro_step, "mixed": _base_step(ALTERNATE_ROWS)}
# Timed, not counted: "first micro", micro step 1, which reads the F features and e(t0) in one
# pass (the micro step's program with F + 1 inputs a row).
TIMED_STEPS: dict[str, UnitStep] = {**UNIT_STEPS, "first micro": _micro_step}


def unit_args(model: Hamburger, name: str, batch: int, kv_len: int):
  """(x [B, 1, D], cache) of a unit step (first micro: x [B, F + 1, D]): the base cache holds
  `kv_len` entries per row with the step's one written last; the micro cache is the micro
  decoder's own."""
  cfg = decode_step.base_of(model).cfg
  inputs = model.num_features + 1 if name == "first micro" else 1
  x = jnp.zeros((batch, inputs, cfg.hidden_size), jnp.dtype(cfg.dtype))
  if name in ("micro", "first micro"):
    return x, model.micro_cache(batch, drafting=False)  # `_micro_step` runs the micro decoder
  cache = KVCache.init(cfg.num_layers, batch, kv_len, cfg.num_kv_heads, cfg.head_dim,
                       jnp.dtype(cfg.dtype))
  return x, cache.replace(length=jnp.full((batch,), kv_len - 1, jnp.int32))


def programs(runner: Hamburger | Llama, batch: int, kv_len: int,
             model: Hamburger | None = None) -> dict[str, tuple]:
  """name -> (jitted step, args) of every counted program. `runner`: the model in the decoding
  layout (decode_layout; a base model alone has the base step only); `model`: the same in the
  training layout, for the standalone macro steps (default: none of them)."""
  graphdef, params = nnx.split(runner)
  out = {}
  names = UNIT_STEPS if isinstance(runner, Hamburger) else ("base",)
  for name in names:
    fn = UNIT_STEPS[name]
    step = jax.jit(lambda p, x, c, fn=fn: fn(nnx.merge(graphdef, p), x, c))
    out[f"{name} step"] = (step, (params, *unit_args(runner, name, batch, kv_len)))
  if model is not None:
    for mode, name in (("base", "macro step, base mode"),
                       ("hamburger", "macro step, HAMburger forced K")):
      out[name] = decode_step_program(model, mode, batch, kv_len)
  return out


def lowered_dots(step, args) -> int:
  """Matmuls (`dot_general`s) in the program `step` lowers to for `args`."""
  return step.lower(*args).as_text().count("stablehlo.dot_general")


def tpu_fusions(step, args) -> int | None:
  """Fusions of the program compiled for one TPU v5e chip; None without libtpu."""
  if not platforms.libtpu_installed():
    return None
  abstract = aot.on_device(args, aot.tpu_devices(TPU_TOPOLOGY)[0])
  return aot.count_fusions(aot.compile_for_tpu(step.lower(*abstract)).as_text())


def figures(runner: Hamburger, batch: int, kv_len: int, model=None,
            tpu: bool = True) -> dict[str, dict[str, int | None]]:
  """name -> {"dots": lowered dot_generals, "fusions": v5e fusions or None} of `programs`."""
  return {name: {"dots": lowered_dots(step, args),
                 "fusions": tpu_fusions(step, args) if tpu else None}
          for name, (step, args) in programs(runner, batch, kv_len, model).items()}


def report_lines(figs: dict[str, dict[str, int | None]]) -> list[str]:
  """A markdown table of `figures`, with each program's dots and fusions against the base
  step's."""
  base = figs.get("base step") or next(iter(figs.values()))
  ratio = lambda a, b: "-" if a is None or not b else f"{a / b:.2f}x"
  lines = ["| program | lowered dots | vs base step | fusions (TPU v5e) | vs base step |",
           "|---|---|---|---|---|"]
  for name, f in figs.items():
    fus = "-" if f["fusions"] is None else str(f["fusions"])
    lines.append(f"| {name} | {f['dots']} | {ratio(f['dots'], base['dots'])} | {fus} | "
                 f"{ratio(f['fusions'], base['fusions'])} |")
  return lines
