"""Device time by operation from a profiler trace: each traced call's operations are found,
counted once a call, and the heavier program's time is the larger."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hamburger_jax.benchmarks.op_profile import profile_calls


def test_ops_of_two_programs_are_timed_and_counted(tmp_path):
  def heavy_program(x):
    return jnp.tanh((x @ x) @ x)

  def light_program(x):
    return jnp.tanh(x) + 1.0

  heavy, light = jax.jit(heavy_program), jax.jit(light_program)
  x = jnp.ones((384, 384))
  heavy(x).block_until_ready(), light(x).block_until_ready()  # compiled before tracing
  prof = profile_calls(lambda: (heavy(x), light(x)), 3, str(tmp_path))
  assert prof.calls == 3 and prof.ops and prof.device_s > 0 and prof.wall_s > 0
  by_module: dict[str, float] = {}
  for op in prof.ops:
    module = op.name.split("/")[0]
    by_module[module] = by_module.get(module, 0.0) + op.seconds
  assert set(by_module) == {"jit_heavy_program", "jit_light_program"}, by_module
  assert by_module["jit_heavy_program"] > 2 * by_module["jit_light_program"]
  assert all(op.calls % 3 == 0 for op in prof.ops)  # every op once (or n times) a call
  kinds = prof.kinds()
  assert sum(k.calls for k in kinds) == sum(o.calls for o in prof.ops)
  assert abs(sum(k.seconds for k in kinds) - prof.device_s) < 1e-9
  assert len(kinds) <= len(prof.ops) and all("." not in k.name[-3:] for k in kinds)
  table = prof.lines(top=2)
  assert table[0].startswith("device time by operation over 3 calls")
  assert table[2] == "| kind of operation | count a call | ms a call | share |"
  assert table[4].startswith("| `") and "| operation |" in "".join(table)
  assert list(tmp_path.rglob("*.xplane.pb"))  # the trace stays for a closer look
