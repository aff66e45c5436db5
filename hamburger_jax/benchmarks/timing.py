"""Timing decode: batches under several settings interleaved (the machine's drift hits them
alike), one macro step alone, the unit steps in a jitted loop, and the lockstep cost model."""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from hamburger_jax import roofline
from hamburger_jax.benchmarks import widths
from hamburger_jax.decode import launches


def timed(fn: Callable[[], Any]) -> float:
  t = time.perf_counter()
  fn()
  return time.perf_counter() - t


def run_interleaved(engine, ids, n_new: int, repeats: int, runs: dict[str, dict],
                    engines: dict | None = None):
  """Decodes one batch under each of several engine.generate settings (`runs`: name -> its
  keyword arguments; `engines`: name -> another engine for that run): each is compiled and run
  once, then `repeats` rounds run each once in turn, so the machine's drift hits them alike (run
  one after the other, a ~10% drift on this CPU showed up in their ratio). Returns name -> (best
  decode s, compile s, generations)."""
  engines = engines or {}
  gen = lambda name, kw: engines.get(name, engine).generate(ids, max_new_tokens=n_new, **kw)
  first = {name: gen(name, kw) for name, kw in runs.items()}
  best = {name: (float("inf"), None) for name in runs}
  for _ in range(repeats):
    for name, kw in runs.items():
      g = gen(name, kw)
      if g[0].decode_s < best[name][0]:
        best[name] = (g[0].decode_s, g)
  return {name: (best[name][0], first[name][0].compile_s, best[name][1]) for name in runs}

def engine_decode_s(engine, ids, n_new: int, repeats: int,
                    runs: dict[str, dict]) -> dict[str, tuple[float, float]]:
  """name -> (best decode seconds of the batch, compile seconds) of engine.generate under each
  setting, interleaved as run_interleaved does. Decode seconds: the call's wall time less its
  prompts' prefill times (the rows are prefilled one by one before the batch decodes, so a
  row's own decode_s would count its batch mates' prefills)."""
  def decode_s(kw) -> float:
    t = time.perf_counter()
    gens = engine.generate(ids, max_new_tokens=n_new, **kw)
    return time.perf_counter() - t - sum(g.prefill_s for g in gens)

  compile_s = {name: engine.generate(ids, max_new_tokens=n_new, **kw)[0].compile_s
               for name, kw in runs.items()}
  best = {name: float("inf") for name in runs}
  for _ in range(repeats):
    for name, kw in runs.items():
      best[name] = min(best[name], decode_s(kw))
  return {name: (best[name], compile_s[name]) for name in runs}

def step_costs(runner, repeats: int, batch: int = 1) -> dict[str, float]:
  """Seconds of one decode step at this batch size (decode/launches.py's unit steps, in the
  decoding layout `runner`, each with its LM head): "base" (an unmerged input: the exact
  base), "merged" (a merged input: the adapters folded into the kernels; equal to "base"
  without adapters) and "micro" (one micro step, with the model's micro-step head: the full
  one, or its reduced vocabulary). Each runs in widths.step_loop (steps in one jitted loop, its
  token fed back: no host dispatch between them, which would weigh most on the small micro
  step). r = micro / base is docs/SPEC.md 6's cost ratio in the ceiling k / (1 + (k - 1) r)."""

  graphdef, params = nnx.split(runner)
  out = {}
  for name, fn in launches.UNIT_STEPS.items():
    x, cache = launches.unit_args(runner, name, batch, widths.KV_ENTRIES)
    loop = widths.step_loop(graphdef, fn)
    state = {"cache": jax.tree.map(jnp.copy, cache)}  # each loop donates its own copy

    def call():
      token, state["cache"] = loop(params, state["cache"], x)
      jax.block_until_ready(token)

    call()
    out[name] = min(timed(call) for _ in range(max(3, repeats))) / widths.STEPS
  return out

def time_decode_step(model, mode: str, batch: int, kv_len: int, repeats: int) -> dict[str, float]:
  """roofline.decode_step_program compiled (seconds) and timed (the best mean step time of
  `repeats` runs, each long enough to average over calls), with XLA's FLOPs for it (None on a
  GPU, where XLA does not count the matmuls cuBLAS runs)."""
  step, (params, state) = roofline.decode_step_program(model, mode, batch, kv_len)
  t = time.perf_counter()
  compiled = step.lower(params, state).compile()  # the calls below reuse it
  compile_s = time.perf_counter() - t
  # The state is donated: each call takes the previous one's. Its cache length runs past
  # kv_len; the writes past the end are dropped and the step reads all kv_len slots either way.
  box = {"state": state}

  def run(n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
      box["state"] = compiled(params, box["state"])
    jax.block_until_ready(box["state"])
    return (time.perf_counter() - t) / n

  run(1)  # the first call places the arguments
  calls = max(1, min(20, int(0.5 / run(1))))
  step_s = min(run(calls) for _ in range(repeats))
  xla = roofline.xla_flops(compiled) if roofline.xla_counts_matmuls() else None
  return {"step_s": step_s, "compile_s": compile_s, "xla": xla}

def lockstep_cost(gens, r: float) -> float:
  """Cost of a batch's decode in base-step units. Rows advance in lockstep: macro step j costs one
  base step plus r per micro step, and it runs micro steps until its largest group is complete.
  At batch 1 this is steps * (1 + (k - 1) r), docs/SPEC.md 6's ceiling k / (1 + (k - 1) r)."""
  steps = max(g.macro_steps for g in gens)
  largest = [max((g.groups[j] for g in gens if j < len(g.groups)), default=1)
             for j in range(steps)]
  return sum(1 + r * (m - 1) for m in largest)
