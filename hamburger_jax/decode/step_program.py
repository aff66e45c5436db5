"""One macro step at decode as the engine runs it, standalone: a jitted program and its
arguments, so that its time (benchmarks/timing.py), its XLA cost and costs.analytic.decode_step_flops
describe the same program, and so that it can be lowered for devices that are not attached
(decode/aot.py) or counted for launches (decode/launches.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hamburger_jax.decode import step as decode_step
from hamburger_jax.decode.runner import decode_runner
from hamburger_jax.decode.shapes import decode_state
from hamburger_jax.model.kv_cache import KVCache

# The step program's token buffer: it emits into a fixed buffer that each call writes past the
# end of (dropped writes), so repeated calls are the same step.
STEP_TOKENS = 16


def decode_step_program(model, mode: str, batch: int, kv_len: int, dtype: str | None = None):
  """One macro step at decode as the engine runs it (decode/step.py: macro_step, greedy, in the
  decoding layout: model/decode_layout.py, fused projections). Returns (step, args):
  `step(*args)` -> the decode state after the step, the state (and its cache) donated.

  HAMburger mode forces every group to K tokens and every entry to be merged (the micro steps
  all run, the folded adapters act: what confidence 0 decodes; StepVariant.forced). The base
  cache is dense, `kv_len` slots, all of them read: the step writes the last one. `model` may
  be abstract (nnx.eval_shape): the step can then be lowered and compiled, not run. `dtype`:
  the decoding layout's (None: the model's)."""
  if mode not in ("base", "hamburger"):
    raise ValueError(f"mode={mode!r}: use base or hamburger")
  runner, abstract = decode_runner(model, dtype=dtype)
  cfg = runner.cfg.base
  graphdef, params = nnx.split(runner)
  k = runner.max_group if mode == "hamburger" else 1
  f = runner.num_features if mode == "hamburger" else 1
  variant = decode_step.StepVariant(forced=mode == "hamburger")

  def step(params, state):
    return decode_step.macro_step(nnx.merge(graphdef, params), mode, state,
                                  stop_ids=jnp.zeros((0,), jnp.int32), stochastic=False,
                                  variant=variant)

  def init():
    dt = jnp.dtype(cfg.dtype)
    cache = KVCache.init(cfg.num_layers, batch, kv_len, cfg.num_kv_heads, cfg.head_dim, dt)
    state = decode_state(cache.replace(length=jnp.full((batch,), kv_len - 1, jnp.int32)), cfg,
                         slots=batch, max_new=STEP_TOKENS, max_group=k, num_features=f)
    # Every row live, with a full prompt, no token limit and confidence 0 (forced groups).
    return state.replace(
        features=jax.random.normal(jax.random.key(0), (batch, f, cfg.hidden_size)).astype(dt),
        prompt_len=jnp.full((batch,), kv_len, jnp.int32), done=jnp.zeros((batch,), bool),
        max_new=jnp.full((batch,), 2**30, jnp.int32), continue_at=jnp.zeros((batch,), jnp.float32))

  state = jax.eval_shape(init) if abstract else init()
  return jax.jit(step, donate_argnums=(1,)), (params, state)
