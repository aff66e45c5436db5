"""FLOPs counted from a program rather than from the model's shapes (analytic.py counts those):
the matmuls of the program a function traces to, and XLA's cost analysis of a compiled one.

The traced count and analytic.py's analytic count see the same matmuls, so tests hold them
equal exactly; XLA's figure also counts elementwise work and, on a GPU, none of the matmuls it
hands to cuBLAS (analytic.py's docstring has the figures).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
from jax.extend import core


def xla_counts_matmuls(device=None) -> bool:
  """Whether XLA's cost analysis counts the matmuls on this device's backend: on a GPU the ones
  it hands to cuBLAS are not counted (a measured 7-12% of a train step's FLOPs on an H200)."""
  return (device or jax.devices()[0]).platform != "gpu"


def xla_flops(compiled) -> float:
  """FLOPs of a compiled program (`jax.jit(f).lower(...).compile()`) by XLA's cost analysis."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older jax: one dict per program
    cost = cost[0]
  return float(cost["flops"])


def traced_matmul_flops(fn: Callable, *args, **kwargs) -> int:
  """Matmul FLOPs (every dot_general: 2 x output elements x contracted size) of the program `fn`
  traces to, scan bodies times their length, the costliest branch of a cond. A while loop's
  trip count is unknown at trace time: one is refused."""
  return _jaxpr_matmul_flops(jax.make_jaxpr(fn)(*args, **kwargs).jaxpr)


def _jaxpr_matmul_flops(jaxpr) -> int:
  total = 0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "dot_general":
      (contract, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      out = eqn.outvars[0].aval.shape
      total += 2 * math.prod(out) * math.prod(lhs[i] for i in contract)
      continue
    if name == "while":
      raise ValueError("a while loop's trip count is unknown at trace time: count a program "
                       "without one")
    subs = [_jaxpr_matmul_flops(j) for j in _subjaxprs(eqn.params)]
    if name == "cond":
      total += max(subs, default=0)
    elif name == "scan":
      total += eqn.params["length"] * sum(subs)
    else:
      total += sum(subs)
  return total


def _subjaxprs(params: dict) -> list:
  """The jaxprs an equation runs inside it (a scan's body, a cond's branches, a pjit's callee)."""
  out = []
  for value in params.values():
    for v in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(v, core.ClosedJaxpr):
        out.append(v.jaxpr)
      elif isinstance(v, core.Jaxpr):
        out.append(v)
  return out
