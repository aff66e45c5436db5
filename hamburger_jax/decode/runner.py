"""The model as decoding runs it: `decode_layout` (model/decode_layout.py) of the model given,
made from its weights or, for an abstract model (nnx.eval_shape: shapes and dtypes, no
weights), as shapes alone, so that programs for devices that are not attached can be lowered
and compiled without weights. The engine and the standalone step program (step_program.py)
both take their runner from here, so both decode the same layout.
"""

from __future__ import annotations

import jax
from flax import nnx

from hamburger_jax.model.decode_layout import decode_layout
from hamburger_jax.model.hamburger import Hamburger
from hamburger_jax.model.llama import Llama


def is_abstract(model: Llama | Hamburger) -> bool:
  """Whether `model` holds shapes (nnx.eval_shape) rather than weights."""
  return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(nnx.state(model)))


def decode_runner(model: Llama | Hamburger, *, fused: bool = True, dtype: str | None = None,
                  mixed: str = "factors") -> tuple[Llama | Hamburger, bool]:
  """(`model` in the decoding layout, whether it is abstract): `fused` projections, `dtype`
  and the `mixed` form as decode_layout takes them. The model given stays as it is."""
  layout = lambda m: decode_layout(m, fused=fused, dtype=dtype, mixed=mixed)
  abstract = is_abstract(model)
  return (nnx.eval_shape(layout, model) if abstract else layout(model)), abstract
