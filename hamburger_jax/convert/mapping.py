"""Weight import/export as a mapping table: source name -> (our param path, per-tensor hooks)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hamburger_jax.model.decode_layout import is_decoding_layout

Path = tuple
Hook = Callable[[np.ndarray], np.ndarray]


class WeightsError(ValueError):
  """Weights do not fit the model: a missing, unknown or mis-shaped tensor (named)."""


def identity(x: np.ndarray) -> np.ndarray:
  return x


def transpose(x: np.ndarray) -> np.ndarray:
  return np.ascontiguousarray(x.T)


@dataclasses.dataclass(frozen=True)
class Rule:
  target: Path  # path of the param in our model's state
  to_ours: Hook = identity  # source tensor -> our layout
  to_source: Hook = identity  # our layout -> source tensor


Table = dict[str, Rule]


def linear(target: Path) -> Rule:
  """A torch Linear weight [out, in] <-> our Dense kernel [in, out]."""
  return Rule(target, transpose, transpose)


def flat_params(model: nnx.Module) -> dict[Path, nnx.Variable]:
  return {tuple(p): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def load(model: nnx.Module, tensors: Mapping[str, np.ndarray], table: Table, source: str,
         ignore: Iterable[str] = ()) -> None:
  """Writes `tensors` into `model` in place through `table`, strictly.

  Every table entry must be present in `tensors` and every tensor must be in the table (or in
  `ignore`); shapes must match the model. Errors name the tensor and the source.
  """
  params = flat_params(model)
  ignore = set(ignore)
  unknown = sorted(set(tensors) - set(table) - ignore)
  if unknown:
    raise WeightsError(f"{source}: unexpected tensor {unknown[0]!r} ({len(unknown)} unknown in "
                       f"all); the checkpoint does not match this model architecture")
  missing = sorted(set(table) - set(tensors))
  if missing:
    raise WeightsError(f"{source}: missing tensor {missing[0]!r} ({len(missing)} missing in all); "
                       f"the checkpoint is incomplete or for another model")
  for name, rule in table.items():
    if rule.target not in params:
      raise WeightsError(f"internal: mapping for {name!r} targets unknown param {rule.target}")
    var = params[rule.target]
    value = np.asarray(rule.to_ours(np.asarray(tensors[name])))
    if value.shape != tuple(var.shape):
      raise WeightsError(
          f"{source}: tensor {name!r} has shape {tuple(np.shape(tensors[name]))} -> "
          f"{value.shape} in our layout, but the model config expects {tuple(var.shape)} at "
          f"{'.'.join(map(str, rule.target))}; check that config and weights are the same model")
    var.set_value(jnp.asarray(value, dtype=var.dtype))
  unset = [p for p, v in params.items() if isinstance(v[...], jax.ShapeDtypeStruct)]
  if unset:
    raise WeightsError(f"{source}: no tensor for param {'.'.join(map(str, unset[0]))} of an "
                       f"abstract model ({len(unset)} in all); initialise the model instead")


def check_training_layout(model: nnx.Module) -> None:
  """Raises WeightsError when `model` is in the decoding layout (model/decode_layout.py), fused
  or not: its merged-entry adapters are folded into kernels no export format holds, so an
  export of it would leave them out (or, fused, hold kernels no loader reads)."""
  if is_decoding_layout(model):
    raise WeightsError("this model is in the decoding layout (model/decode_layout.py: folded "
                       "adapters, fused or separate projections, the decoding dtype), which no "
                       "export holds; export the model it was made from (an Engine's "
                       "`model`, not its `runner`)")


def export(model: nnx.Module, table: Table) -> dict[str, np.ndarray]:
  """The inverse of `load`: source name -> tensor in the source's layout. Every export goes
  through here, so none takes a decoding layout (check_training_layout)."""
  check_training_layout(model)
  params = flat_params(model)
  return {name: np.asarray(rule.to_source(np.asarray(params[rule.target][...])))
          for name, rule in table.items()}
