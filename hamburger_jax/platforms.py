"""Which backend a process starts, where libtpu is installed (to compile for TPUs: hamburger_jax/aot.py)
on a host that may have no TPU. No jax import here: this runs before jax starts a backend."""

from __future__ import annotations

import glob
import importlib.util
import os


def libtpu_installed() -> bool:
  return importlib.util.find_spec("libtpu") is not None


def tpu_attached() -> bool:
  """Whether this host has TPU chips (their device files), as opposed to libtpu alone."""
  return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def use_cpu_backend() -> None:
  """The CPU as jax's backend and libtpu as a compiler only: set before jax starts a backend
  (libtpu would otherwise look for a TPU, warn and fall back). libtpu's start-up probes for the
  host's accelerator type and workers are answered so that it stays quiet."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
  # Compiling holds no chip: several processes (test workers, a bench beside a check) may.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


# libtpu's flags that keep a v5p compile off its SparseCores. Its SparseCore code generator
# overflowed its stack on the 135M H100 config's merger step (a crash, exit 139); a GPU checked
# by proxy has no SparseCore, so nothing of the figure is lost there.
NO_SPARSE_CORE_FLAGS = tuple(
    f"--xla_tpu_enable_offloading_{op}_to_sparsecore=false"
    for op in ("gather", "scatter", "sort", "reduce", "copy", "reshape")
) + ("--xla_tpu_enable_sparse_core_compute_offload=false",)


def no_sparse_core() -> None:
  """Adds NO_SPARSE_CORE_FLAGS to LIBTPU_INIT_ARGS: before libtpu starts, which reads it once."""
  have = os.environ.get("LIBTPU_INIT_ARGS", "").split()
  os.environ["LIBTPU_INIT_ARGS"] = " ".join(
      have + [f for f in NO_SPARSE_CORE_FLAGS if f not in have])


def gpu_attached() -> bool:
  return bool(glob.glob("/dev/nvidia[0-9]*"))


def cpu_unless_tpu() -> None:
  """libtpu installed on a host with neither TPU chips nor a GPU: the CPU backend, quietly
  (importing hamburger_jax calls this; it acts only before jax starts a backend)."""
  if libtpu_installed() and not tpu_attached() and not gpu_attached():
    use_cpu_backend()
