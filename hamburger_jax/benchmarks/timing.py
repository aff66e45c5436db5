"""Timing decode: batches under several settings interleaved (the machine's drift hits them
alike), one macro step alone, the unit steps in a jitted loop, and the lockstep cost model."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from hamburger_jax.costs import program_flops
from hamburger_jax.decode.step_costs import step_costs  # noqa: F401  (the benches' API)
from hamburger_jax.decode.requests import Generation, pooled_tokens_per_step
from hamburger_jax.decode.step_program import decode_step_program


def timed(fn: Callable[[], Any]) -> float:
  t = time.perf_counter()
  fn()
  return time.perf_counter() - t


@dataclasses.dataclass(frozen=True)
class BatchTiming:
  """One setting's figures for a batch, from its fastest round (time_batches)."""
  decode_s: float  # the time the batch decoded (batch_decode_s)
  prefill_s: float  # its rows' prefills, added up: reported apart, never in tok/s
  compile_s: float  # spent compiling in the setting's first (untimed) call
  tokens: int  # tokens all its rows generated
  gens: list[Generation]  # the round's generations, in prompt order

  @property
  def tokens_per_s(self) -> float:
    return self.tokens / self.decode_s

  @property
  def tokens_per_step(self) -> float:
    """Tokens a macro step, pooled over the rows (verify mode: tokens a base forward)."""
    return pooled_tokens_per_step(self.gens)


def batch_decode_s(gens: Sequence[Generation]) -> float:
  """Seconds a batch decoded: from its first row's admission to its last row's result, less
  every row's prefill. The engine prefills the rows one at a time as it admits them
  (decode/serving.py), so one row's own decode_s counts the prefills of the rows admitted after
  it (row 0's: all of the others'), and the call's wall time counts its host setup too. (A row
  evicted for KV blocks and prefilled again would count its first prefill as decoding; the
  benches' pools hold every row, so none is.)"""
  start = min(g.queue_s for g in gens)  # the first admission, after the call's compile
  end = max(g.latency_s for g in gens)
  return end - start - sum(g.prefill_s for g in gens)


def time_batches(engine, ids, n_new: int, repeats: int, runs: dict[str, dict],
                 engines: dict | None = None) -> dict[str, BatchTiming]:
  """Decodes one batch under each of several engine.generate settings (`runs`: name -> its
  keyword arguments; `engines`: name -> another engine for that run): each is compiled and run
  once, then `repeats` rounds run each once in turn, so that the machine's drift hits them
  alike (run one after the other, a ~10% drift on this CPU showed up in their ratio). Returns
  name -> its fastest round's BatchTiming: tok/s = tokens all rows generated / the time the
  batch decoded, its prefills apart."""
  engines = engines or {}
  gen = lambda name, kw: engines.get(name, engine).generate(ids, max_new_tokens=n_new, **kw)
  compile_s = {name: gen(name, kw)[0].compile_s for name, kw in runs.items()}
  best: dict[str, BatchTiming] = {}
  for _ in range(repeats):
    for name, kw in runs.items():
      gens = gen(name, kw)
      t = BatchTiming(batch_decode_s(gens), sum(g.prefill_s for g in gens), compile_s[name],
                      sum(g.new_tokens for g in gens), gens)
      if name not in best or t.tokens_per_s > best[name].tokens_per_s:
        best[name] = t
  return best

def time_decode_step(model, mode: str, batch: int, kv_len: int, repeats: int) -> dict[str, float]:
  """decode_step_program compiled (seconds) and timed (the best mean step time of
  `repeats` runs, each long enough to average over calls), with XLA's FLOPs for it (None on a
  GPU, where XLA does not count the matmuls cuBLAS runs)."""
  step, (params, state) = decode_step_program(model, mode, batch, kv_len)
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
  xla = program_flops.xla_flops(compiled) if program_flops.xla_counts_matmuls() else None
  return {"step_s": step_s, "compile_s": compile_s, "xla": xla}

def lockstep_cost(gens, r: float) -> float:
  """Cost of a batch's decode in base-step units. Rows advance in lockstep: macro step j costs one
  base step plus r per micro step, and it runs micro steps until its largest group is complete.
  At batch 1 this is steps * (1 + (k - 1) r), docs/SPEC.md 6's ceiling k / (1 + (k - 1) r)."""
  return sum(1 + r * (m - 1) for m in largest_groups(gens))


def last_row_steps(gens) -> int:
  """The macro steps a batch decoded together ran: its slowest row's (the batch decodes until
  that row finishes; the base's: one a token)."""
  return max(g.macro_steps for g in gens)


def macro_step_cost(ham: BatchTiming, base: BatchTiming) -> float:
  """What one of a batch's macro steps cost, in the base's steps of the same batch: each
  setting's decode time over the steps its batch ran (last_row_steps). It keeps apart what the
  tokens/s ratio mixes: a batch's speed over its base's is (the base's steps / its steps) /
  this, and its steps are its slowest row's, whatever the others' groups."""
  return (ham.decode_s / last_row_steps(ham.gens)) / (base.decode_s / last_row_steps(base.gens))


def largest_groups(gens) -> list[int]:
  """The largest group of each macro step of a batch decoded together (generate: every row
  starts at the same step): the micro steps that step ran, plus one."""
  steps = last_row_steps(gens)
  return [max((g.groups[j] for g in gens if j < len(g.groups)), default=1)
          for j in range(steps)]


def micro_steps_per_step(gens) -> float:
  """Micro steps a batch's macro step ran, on average (the lockstep: as many as its largest
  group needs), to set against the tokens each row emitted per macro step."""
  largest = largest_groups(gens)
  return sum(m - 1 for m in largest) / len(largest)


def profile_decode(engine, ids, n_new: int, trace_dir: str, **generate_kw):
  """Where a batch's decode spends the device's time: one engine.generate of `ids` (run once
  untimed first, so compiling is not traced) under the profiler (benchmarks/op_profile.py).
  Returns (OpProfile of the call, prefills included; the macro steps it ran, the most of any
  row; its generations)."""
  from hamburger_jax.benchmarks.op_profile import profile_calls  # pylint: disable=C0415
  run = lambda: engine.generate(ids, max_new_tokens=n_new, **generate_kw)
  run()
  box = {}

  def call():
    box["gens"] = run()
    return jnp.zeros(())  # generate returns once the batch is done: nothing left to wait for

  prof = profile_calls(call, 1, trace_dir)
  return prof, last_row_steps(box["gens"]), box["gens"]
