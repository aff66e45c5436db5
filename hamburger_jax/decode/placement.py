"""Where the engine's arrays live: without a mesh, on the default device; under a device mesh,
the weights split by the inference sharding rules (the tensor axis: sharding.INFER_RULES) and
the decode state replicated (small next to the weights). An abstract model's weights stay
shapes, with their shardings, so that programs for devices that are not attached can be
lowered and compiled."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from hamburger_jax import sharding


def platform(mesh: Mesh | None) -> str:
  """The platform ("cpu", "gpu", "tpu") the engine decodes on: the mesh's, else the default
  device's."""
  return (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform


def place_weights(params: Any, mesh: Mesh | None, abstract: bool) -> Any:
  """The decoding layout's params placed for `mesh` (as they are without one)."""
  if mesh is None:
    return params
  shardings = sharding.state_shardings(params, mesh, sharding.INFER_RULES)
  if abstract:
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        params, shardings)
  return jax.device_put(params, shardings)


def replicate(tree: Any, mesh: Mesh | None) -> Any:
  """Host values onto the engine's devices: replicated over the mesh, if there is one."""
  if mesh is None:
    return jax.tree.map(jnp.asarray, tree)
  return jax.device_put(tree, NamedSharding(mesh, P()))
