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


def gpu_attached() -> bool:
  return bool(glob.glob("/dev/nvidia[0-9]*"))


def cpu_unless_tpu() -> None:
  """libtpu installed on a host with neither TPU chips nor a GPU: the CPU backend, quietly
  (importing hamburger_jax calls this; it acts only before jax starts a backend)."""
  if libtpu_installed() and not tpu_attached() and not gpu_attached():
    use_cpu_backend()
