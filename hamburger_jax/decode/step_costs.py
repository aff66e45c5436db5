"""What one decode step costs on this device, timed: the unit steps of decode/launches.py (base,
merged, mixed, micro) each run in a jitted loop of STEPS steps with its token fed back, as the
engine's decode loop runs them. The micro rule (decode/micro_rule.py) measures its cost vector
with it (`Probe`); the benches (hamburger_jax/benchmarks/) report them."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from hamburger_jax.decode import launches
from hamburger_jax.decode.step import base_of, has_adapters

STEPS = 8  # steps per timed call: the call's dispatch is spread over them
KV_ENTRIES = 200  # each sequence's cache: a chat prompt and a short answer
# Rounds of each probe loop (the fastest kept): the probe runs once per engine and slot count.
PROBE_REPEATS = 3


def _timed(fn: Callable[[], Any]) -> float:
  t = time.perf_counter()
  fn()
  return time.perf_counter() - t


def step_loop(graphdef, step):
  """A jitted `fn(params, cache, x) -> (token, cache)` that runs `step(model, x, cache) ->
  (token [B], cache)` STEPS times in one `fori_loop`, the cache donated, as the engine's decode
  loop runs its steps (no host dispatch between them). Each step's last input row becomes the
  embedding of the token it chose, so each step depends on the last and none can be skipped or
  hoisted."""

  def run(params, cache, x):
    m = nnx.merge(graphdef, params)
    embed = base_of(m).embed

    def body(_, carry):
      x, cache, _ = carry
      token, cache = step(m, x, cache)
      return x.at[:, -1].set(embed(token).astype(x.dtype)), cache, token

    _, cache, token = jax.lax.fori_loop(0, STEPS, body,
                                        (x, cache, jnp.zeros((x.shape[0],), jnp.int32)))
    return token, cache

  return jax.jit(run, donate_argnums=(1,))


def step_costs(runner, repeats: int, batch: int = 1,
               names: Sequence[str] = tuple(launches.TIMED_STEPS)) -> dict[str, float]:
  """Seconds of one decode step at this batch size (decode/launches.py's unit steps, in the
  decoding layout `runner`, each with its LM head): "base" (an unmerged input: the exact
  base), "merged" (a merged input: the adapters folded into the kernels; equal to "base"
  without adapters), "mixed" (every other row's input merged, as in a macro step whose rows'
  entries differ: the adapters in the layout's mixed form on those rows), "micro" (one micro
  step, with the model's micro-step head: the full one, or its reduced vocabulary) and "first
  micro" (micro step 1: the F features and e(t0) in one pass). Each runs in
  step_loop (steps in one jitted loop, its token fed back: no host dispatch between
  them, which would weigh most on the small micro step). r = micro / base is docs/SPEC.md 6's
  cost ratio in the ceiling k / (1 + (k - 1) r). `names`: which of them to time (default
  all)."""

  graphdef, params = nnx.split(runner)
  out = {}
  for name in names:
    fn = launches.TIMED_STEPS[name]
    x, cache = launches.unit_args(runner, name, batch, KV_ENTRIES)
    loop = step_loop(graphdef, fn)
    state = {"cache": jax.tree.map(jnp.copy, cache)}  # each loop donates its own copy

    def call():
      token, state["cache"] = loop(params, state["cache"], x)
      jax.block_until_ready(token)

    call()
    out[name] = min(_timed(call) for _ in range(max(3, repeats))) / STEPS
  return out


@dataclasses.dataclass(frozen=True)
class Probe:
  """`step_costs` of one runner (a HAMburger in the decoding layout), as decode/micro_rule.py's
  `measure` times them."""
  runner: Any
  repeats: int = PROBE_REPEATS

  @property
  def adapters(self) -> bool:
    return has_adapters(self.runner)

  def __call__(self, batch: int, names: Sequence[str]) -> dict[str, float]:
    return step_costs(self.runner, self.repeats, batch, names=names)
