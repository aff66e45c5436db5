"""Device mesh and logical-axis sharding rules (training: FSDP + tensor; inference: tensor only)."""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from hamburger_jax.config import ConfigError

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # the batch is split over every axis that is not tensor

# logical axis -> mesh axis (None = replicated). Params carry logical names (`logical_axes`).
TRAIN_RULES: Mapping[str, str | None] = {
    "vocab": "tensor", "embed": "fsdp", "heads": "tensor", "kv_heads": "tensor",
    "mlp": "tensor", "norm": None,
}
# Decode reads every weight once per token: FSDP would all-gather each step, so inference keeps
# weights whole along the model dimension and splits only over tensor.
INFER_RULES: Mapping[str, str | None] = {**TRAIN_RULES, "embed": None}


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1,
              devices: list | None = None) -> jax.sharding.Mesh:
  """A (data, fsdp, tensor) mesh; one axis may be -1 (the devices left over)."""
  devices = devices if devices is not None else jax.devices()
  n = len(devices)
  shape = [data, fsdp, tensor]
  if shape.count(-1) > 1:
    raise ConfigError(f"mesh {dict(zip(MESH_AXES, shape))}: at most one axis may be -1")
  known = int(np.prod([s for s in shape if s != -1]))
  if any(s == 0 or s < -1 for s in shape) or n % known:
    raise ConfigError(f"mesh {dict(zip(MESH_AXES, shape))} does not divide the {n} devices: "
                      f"the product of the axes must equal {n} (or use -1 for one axis)")
  shape = [n // known if s == -1 else s for s in shape]
  if int(np.prod(shape)) != n:
    raise ConfigError(f"mesh {dict(zip(MESH_AXES, shape))} uses {int(np.prod(shape))} devices "
                      f"but {n} are present: make the product {n} or set one axis to -1")
  slices = len({getattr(d, "slice_index", 0) for d in devices})
  if slices == 1:
    return jax.make_mesh(tuple(shape), MESH_AXES, axis_types=(AxisType.Auto,) * 3,
                         devices=devices)
  # Several slices talk over the data-centre network, far slower than the slices' own links:
  # only the data axis (gradients all-reduced once a step) spans them.
  if shape[0] % slices:
    raise ConfigError(f"mesh {dict(zip(MESH_AXES, shape))} on {slices} slices: the data axis "
                      f"spans the slices, so it must be a multiple of {slices}")
  grid = mesh_utils.create_hybrid_device_mesh(
      (shape[0] // slices, shape[1], shape[2]), (slices, 1, 1), devices)
  return jax.sharding.Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def logical_to_spec(axes: tuple, shape: tuple[int, ...], mesh: jax.sharding.Mesh,
                    rules: Mapping[str, str | None]) -> P:
  """PartitionSpec for one param; a dim that the mesh axis does not divide stays replicated."""
  spec = []
  used = set()
  for name, dim in zip(axes, shape):
    axis = rules.get(name) if name is not None else None
    if axis is None or axis in used or dim % mesh.shape[axis]:
      spec.append(None)
    else:
      spec.append(axis)
      used.add(axis)
  return P(*spec)


def state_shardings(state: Any, mesh: jax.sharding.Mesh,
                    rules: Mapping[str, str | None]) -> Any:
  """NamedShardings for an nnx.State (or a pytree holding them), from each param's logical axes."""

  def one(x):
    if isinstance(x, nnx.Variable):
      axes = x.get_metadata().get("logical_axes") or (None,) * len(x.shape)
      return x.replace(NamedSharding(mesh, logical_to_spec(axes, x.shape, mesh, rules)))
    return NamedSharding(mesh, P())

  return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_divisor(mesh: jax.sharding.Mesh) -> int:
  return int(np.prod([mesh.shape[a] for a in BATCH_AXES]))


def constrain_rows(x: jax.Array) -> jax.Array:
  """Activations [rows, ...] split by rows over the data-parallel axes and whole along every
  other dimension, when traced under a mesh (jax.set_mesh; a no-op otherwise).

  Without it the compiler propagates the weights' FSDP split (embed over fsdp) into the
  activations and contracts sharded dimensions: every matmul all-reduces activations and every
  device holds whole-batch activations. With it, FSDP does what it should: each layer's weights
  are all-gathered, each device computes its own rows."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not all(a in mesh.shape for a in BATCH_AXES):
    return x
  if x.shape[0] % int(np.prod([mesh.shape[a] for a in BATCH_AXES])):
    return x
  return jax.lax.with_sharding_constraint(x, P(BATCH_AXES, *([None] * (x.ndim - 1))))

