"""Compiling for a TPU slice that is not attached (deviceless ahead-of-time compilation, as
MaxText's train_compile does): the slice's devices from libtpu's topology description, a mesh
on them, programs lowered against abstract arrays and compiled by the TPU compiler, on a CPU
machine. What the compiler reports per chip (memory, FLOPs, bytes, fusions, collectives) is
what a run on that slice would use.

Needs libtpu (`pip install "jax[tpu]"` at the pinned jax version, requirements-test.txt) and
JAX_PLATFORMS=cpu (platforms.use_cpu_backend): the default backend stays the CPU, libtpu only
compiles.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import re
import threading
import time
import warnings
from typing import Any, Callable, Iterator

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from hamburger_jax.platforms import libtpu_installed, use_cpu_backend

GIB = 2**30
# HBM per chip, GiB (cloud.google.com/tpu/docs/v4, v5e, v5p, v6e), by jax's device_kind. A v4
# chip's two TensorCores are two devices to libtpu's topology: each has half.
TPU_HBM_GIB = {"TPU v4": 32, "TPU v5 lite": 16, "TPU v5": 95, "TPU v6 lite": 32}
GENERATIONS = {"v4": "TPU v4", "v5e": "TPU v5 lite", "v5p": "TPU v5", "v6e": "TPU v6 lite"}
# What a program may use of a chip's HBM: XLA's runtime, fragmentation and the buffers of the
# run's other programs need the rest.
DEFAULT_HEADROOM = 0.10
COMPILE_STACK_BYTES = 512 * 2**20
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all",
               "collective-permute")


class AotError(ValueError):
  """A topology, config or environment that cannot be compiled for (the message says what to
  do)."""


def tpu_devices(topology: str, num_slices: int = 1) -> list:
  """The devices of a TPU slice (or `num_slices` slices) named like "v5e:4x4" or "v5p:2x2x4"
  (generation:chips per axis), from libtpu's topology description: no TPU needed."""
  if not libtpu_installed():
    raise AotError('compiling for a TPU needs libtpu: pip install "jax[tpu]==%s"'
                   % jax.__version__)
  gen, _, shape = topology.partition(":")
  if gen not in GENERATIONS or not re.fullmatch(r"\d+(x\d+){1,2}", shape):
    raise AotError(f"topology {topology!r}: use GENERATION:AxB or AxBxC with a generation of "
                   f"{', '.join(GENERATIONS)} (e.g. v5e:4x4, v5p:2x2x4)")
  if num_slices < 1:
    raise AotError(f"num_slices={num_slices} must be >= 1")
  chips = int(np.prod([int(x) for x in shape.split("x")]))
  if chips < 4:
    raise AotError(f"topology {topology!r} has {chips} chip(s): libtpu describes slices of 4 "
                   f"chips or more (one host); compile for {gen}:2x2 with --chips 1 for one chip")
  use_cpu_backend()
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  try:
    return list(topologies.get_topology_desc(platform="tpu", topology_name=topology,
                                             num_slices=num_slices).devices)
  except Exception as e:  # pylint: disable=broad-except  # libtpu's XlaRuntimeError & co.
    raise AotError(f"libtpu does not describe topology {topology!r}: {e}") from None


def on_device(tree: Any, device) -> Any:
  """A tree of arrays or ShapeDtypeStructs as ShapeDtypeStructs placed on one `device` (a chip
  of a slice that is not attached): the arguments a one-chip program is lowered against."""
  place = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=SingleDeviceSharding(device))
  return jax.tree.map(place, jax.eval_shape(lambda t: t, tree))


def device_hbm_bytes(devices: list) -> int:
  """HBM of one device of `devices` (a chip, or a v4 chip's TensorCore)."""
  kind = devices[0].device_kind
  if kind not in TPU_HBM_GIB:
    raise AotError(f"no HBM figure for {kind!r}: known are {', '.join(TPU_HBM_GIB)}")
  per_chip = len(devices) // len({tuple(d.coords) + (getattr(d, "slice_index", 0),)
                                  for d in devices})
  return int(TPU_HBM_GIB[kind] * GIB / max(per_chip, 1))


# ----------------------------------------------------------------------------- reports


@dataclasses.dataclass
class ProgramReport:
  """What the compiler says of one compiled program, per device (chip)."""
  name: str
  compile_s: float
  argument: int  # bytes of the arguments (weights, optimiser state, batch, caches)
  output: int
  alias: int  # output bytes written in place of donated arguments
  temp: int  # XLA's temporaries (activations kept for the backward pass, workspaces)
  code: int
  flops: float
  bytes_accessed: float
  fusions: int
  collectives: dict[str, tuple[int, int]]  # op -> (count, bytes) in the compiled HLO

  @property
  def total(self) -> int:
    """Peak bytes the program holds on a device: arguments, outputs not written in place of
    an argument, temporaries, code."""
    return self.argument + self.output - self.alias + self.temp + self.code


@contextlib.contextmanager
def no_persistent_cache() -> Iterator[None]:
  """Compiles in the block skip JAX's persistent compilation cache: a program compiled for
  devices that are not attached cannot be loaded back from it (JAX warns and compiles anyway)."""
  was = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  try:
    with warnings.catch_warnings():  # a cache opened before this block still looks entries up
      warnings.filterwarnings("ignore", message="Error reading persistent compilation cache")
      yield
  finally:
    jax.config.update("jax_enable_compilation_cache", was)


def _compile(lowered, name: str, knob: str) -> Any:
  """`lowered.compile()`; a program the compiler refuses for the chip's own HBM (whatever
  hbm_gib reports) raises AotError naming it and `knob` (what to turn)."""
  try:
    return lowered.compile()
  except Exception as e:  # pylint: disable=broad-except  # libtpu's XlaRuntimeError
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    raise AotError(f"{name} does not fit: {str(e).splitlines()[0].rstrip('.')}"
                   + (f"; {knob}" if knob else "")) from None


def compile_for_tpu(lowered, name: str = "the program", knob: str = "") -> Any:
  """`lowered.compile()` for TPU devices (no persistent cache), refusals as in _compile."""
  with no_persistent_cache():
    return _compile(lowered, name, knob)


def compile_all(lowered: dict[str, Any], progress: Callable[[str], None] = lambda _: None,
                workers: int | None = None, knob: str = "") -> dict[str, ProgramReport]:
  """Compiles lowered programs (name -> jax Lowered) side by side, one per core (XLA compiles
  outside Python's lock); each one's report, in the order given. The compile seconds are each
  program's own wall time, so they overlap. Refusals as in _compile."""
  def one(name: str) -> ProgramReport:
    progress(f"compiling {name}")
    t = time.perf_counter()
    compiled = _compile(lowered[name], name, knob)
    return report_of(name, compiled, time.perf_counter() - t)

  workers = workers or max(1, min(len(lowered), os.cpu_count() or 1))
  # The TPU compiler recurses deeply on a large program: a worker thread gets the stack a main
  # thread has (a 30-layer train step overflowed the default one).
  previous = threading.stack_size(COMPILE_STACK_BYTES)
  try:
    with no_persistent_cache(), concurrent.futures.ThreadPoolExecutor(workers) as pool:
      return dict(zip(lowered, pool.map(one, lowered)))
  finally:
    threading.stack_size(previous)


def report_of(name: str, compiled, compile_s: float) -> ProgramReport:
  """What the compiler says of a compiled program, per device."""
  mem = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  text = compiled.as_text()
  return ProgramReport(
      name=name, compile_s=compile_s, argument=mem.argument_size_in_bytes,
      output=mem.output_size_in_bytes, alias=mem.alias_size_in_bytes,
      temp=mem.temp_size_in_bytes, code=mem.generated_code_size_in_bytes,
      flops=float(cost.get("flops", 0.0)), bytes_accessed=float(cost.get("bytes accessed", 0.0)),
      fusions=count_fusions(text), collectives=collectives(text))


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
                "f8e4m3fn": 1, "f8e5m2": 1}
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
# An HLO instruction: `%name = SHAPE op(`; SHAPE is an array or a tuple of them.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(.+?)\s+([a-z][a-z0-9-]*)\(")


def _shape_bytes(shape: str) -> int:
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    if dtype in _DTYPE_BYTES:
      total += _DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
  return total


def collectives(hlo_text: str) -> dict[str, tuple[int, int]]:
  """Collective ops in a compiled HLO module: op -> (count, bytes of their outputs). The
  asynchronous forms (`all-gather-start`, ...) count as their op; `-done` halves are skipped.
  A collective inside a loop body counts once (per trip, not per program run)."""
  out: dict[str, list[int]] = {}
  for line in hlo_text.splitlines():
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    shape, op = m.groups()
    if op.endswith("-done"):
      continue
    base = op[:-len("-start")] if op.endswith("-start") else op
    if base not in COLLECTIVES:
      continue
    count, size = out.setdefault(base, [0, 0])
    nbytes = _shape_bytes(shape)
    if op.endswith("-start") and shape.startswith("("):
      nbytes //= 2  # an async start's tuple holds the operand and the result
    out[base] = [count + 1, size + nbytes]
  return {k: (c, b) for k, (c, b) in out.items()}


def count_fusions(hlo_text: str) -> int:
  """Fusion call sites in a compiled HLO module (each a kernel the device runs), those inside
  loop bodies and branches included once."""
  return sum(1 for line in hlo_text.splitlines()
             if (m := _INSTRUCTION.match(line)) and m.group(2) == "fusion")


def fit_error(needed: int, hbm: int, what: str, headroom: float, knob: str) -> str | None:
  """None when `needed` bytes fit in `hbm` less the headroom; else the one line that says by
  how much and what to change."""
  usable = hbm * (1 - headroom)
  if needed <= usable:
    return None
  return (f"{what} does not fit: {needed / GIB:.2f} GiB per device needed, "
          f"{usable / GIB:.2f} GiB usable ({hbm / GIB:.1f} GiB HBM less {headroom:.0%} "
          f"headroom): {(needed - usable) / GIB:.2f} GiB over; {knob}")


def sharded_bytes(tree: Any) -> int:
  """Bytes one device holds of a tree of ShapeDtypeStructs carrying shardings (the largest
  shard: every device holds the same amount when the dimensions divide evenly)."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) else x.shape
    total += int(np.prod(shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
  return total


def gib(n: float) -> str:
  return f"{n / GIB:.2f}"


def collectives_cell(report: ProgramReport) -> str:
  """'all-gather 12 (340 MB), all-reduce 3 (1 MB)' or 'none'."""
  if not report.collectives:
    return "none"
  return ", ".join(f"{op} {c} ({b / 1e6:.1f} MB)" for op, (c, b) in
                   sorted(report.collectives.items()))
