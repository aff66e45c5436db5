"""What the device can do at best, and how close a measured step comes to it: peak matmul
FLOP/s and memory bandwidth, MFU, the fraction of the memory roofline, which roof bounds a step.

A module of its own because it describes the machine, not the model: analytic.py counts what a
step of the model costs (FLOPs, bytes it must read) and runs nothing; this one measures a CPU,
looks an accelerator up, and sets the two side by side.

Peaks: dense bf16 matmul throughput and HBM bandwidth of known accelerators (datasheets, cited
beside each), detected from `jax.devices()[0].device_kind`; on a CPU, both are measured (a
jitted large matmul in the compute dtype; a memcpy between preallocated buffers).
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Peak:
  """What a device can do at best: matmul FLOP/s and memory bandwidth (bytes/s)."""
  name: str
  flops: float
  bandwidth: float
  source: str  # a datasheet, or "measured ..."

  def best(self, other: "Peak") -> "Peak":
    """The higher of two measurements of one machine: on a shared CPU the load moves both, and
    a peak measured below what a step then reaches would read as MFU over 100%."""
    return dataclasses.replace(self, flops=max(self.flops, other.flops),
                               bandwidth=max(self.bandwidth, other.bandwidth))


T, G = 1e12, 1e9
# Dense (no structured sparsity) bf16 matmul peaks and HBM bandwidths, per chip.
ACCELERATORS = {
    # NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100): SXM 1,979
    # TFLOPS bf16 "with sparsity" (989.5 dense), 3.35 TB/s; PCIe 1,513 (756.5 dense), 2 TB/s;
    # NVL 1,671 (835.5 dense), 3.9 TB/s.
    "H100 SXM": Peak("NVIDIA H100 SXM", 989.5 * T, 3350 * G, "NVIDIA H100 datasheet"),
    "H100 PCIe": Peak("NVIDIA H100 PCIe", 756.5 * T, 2000 * G, "NVIDIA H100 datasheet"),
    "H100 NVL": Peak("NVIDIA H100 NVL", 835.5 * T, 3900 * G, "NVIDIA H100 datasheet"),
    # NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200): SXM 1,979
    # TFLOPS bf16 with sparsity (989.5 dense), 4.8 TB/s HBM3e.
    "H200": Peak("NVIDIA H200 SXM", 989.5 * T, 4800 * G, "NVIDIA H200 datasheet"),
    # cloud.google.com/tpu/docs/v4: 275 TFLOPS bf16, 1,200 GB/s HBM2 per chip.
    "TPU v4": Peak("TPU v4", 275 * T, 1200 * G, "cloud.google.com/tpu/docs/v4"),
    # cloud.google.com/tpu/docs/v5e: 197 TFLOPS bf16, 819 GB/s per chip.
    "TPU v5e": Peak("TPU v5e", 197 * T, 819 * G, "cloud.google.com/tpu/docs/v5e"),
    # cloud.google.com/tpu/docs/v5p: 459 TFLOPS bf16, 2,765 GB/s per chip.
    "TPU v5p": Peak("TPU v5p", 459 * T, 2765 * G, "cloud.google.com/tpu/docs/v5p"),
    # cloud.google.com/tpu/docs/v6e: 918 TFLOPS bf16, 1,640 GB/s per chip.
    "TPU v6e": Peak("TPU v6e", 918 * T, 1640 * G, "cloud.google.com/tpu/docs/v6e"),
}


def accelerator_key(device_kind: str) -> str | None:
  """`jax.Device.device_kind` -> its ACCELERATORS key; None for a kind not in the table.

  Kinds as JAX reports them: "NVIDIA H100 80GB HBM3" (SXM), "NVIDIA H100 PCIe", "NVIDIA H100
  NVL", "NVIDIA H200", "TPU v4", "TPU v5 lite" (v5e), "TPU v5" (v5p), "TPU v6 lite" (v6e)."""
  kind = device_kind.strip()
  if "H200" in kind:
    return None if "NVL" in kind else "H200"  # H200 NVL runs at a lower clock: not tabled
  if "H100" in kind:
    return "H100 PCIe" if "PCIe" in kind else "H100 NVL" if "NVL" in kind else "H100 SXM"
  tpu = {"TPU v4": "TPU v4", "TPU v5 lite": "TPU v5e", "TPU v5e": "TPU v5e", "TPU v5": "TPU v5p",
         "TPU v5p": "TPU v5p", "TPU v6 lite": "TPU v6e", "TPU v6e": "TPU v6e"}
  return tpu.get(kind)


def cpu_model() -> str:
  """The CPU's model name as the kernel reports it (what `lscpu` prints), else the platform's."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or "CPU"


def _timed(fn: Callable[[], Any]) -> float:
  t = time.perf_counter()
  fn()
  return time.perf_counter() - t


def copy_bandwidth_gb_s(size_mb: int = 512, repeats: int = 5) -> float:
  """Memory bandwidth of a memcpy (read + write) between two preallocated large buffers.

  Preallocated on purpose: a jitted copy allocates (and page-faults) a fresh output every call,
  which measured ~5x below this machine's real bandwidth."""
  src = np.ones(size_mb * 2**20 // 4, np.float32)
  dst = np.empty_like(src)
  np.copyto(dst, src)
  best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeats))
  return 2 * src.nbytes / best / 1e9


def matmul_flops_per_s(dtype: str = "float32", n: int = 2048, repeats: int = 5) -> float:
  """FLOP/s of a jitted [n, n] @ [n, n] matmul in `dtype` on the default device, the best of
  `repeats` (each a chain of 4, so dispatch does not count)."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype) / math.sqrt(n)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dtype) / math.sqrt(n)
  chain = jax.jit(lambda a, b: ((((a @ b) @ b) @ b) @ b))
  jax.block_until_ready(chain(a, b))
  best = min(_timed(lambda: jax.block_until_ready(chain(a, b))) for _ in range(repeats))
  return 4 * 2 * n**3 / best


def device_peak(dtype: str = "bfloat16", device=None, tflops: float | None = None,
                gb_s: float | None = None) -> Peak:
  """The peak to measure against. An accelerator in ACCELERATORS: its datasheet figures (dense
  bf16, whatever `dtype` the model runs). A CPU: this machine measured now (a matmul in
  `dtype`, a memcpy). `tflops` / `gb_s` (TFLOP/s, GB/s) override either; an accelerator not in
  the table needs both."""
  device = device or jax.devices()[0]
  kind = device.device_kind
  flops = tflops * T if tflops else None
  bandwidth = gb_s * G if gb_s else None
  if device.platform == "cpu":
    source = "given" if flops and bandwidth else "measured: " + ", ".join(
        [f"jitted 2048^2 {dtype} matmul" if not flops else "FLOP/s given",
         "512 MB memcpy" if not bandwidth else "bandwidth given"])
    return Peak(f"{cpu_model()}, {os.cpu_count()} cores", flops or matmul_flops_per_s(dtype),
                bandwidth or copy_bandwidth_gb_s() * G, source)
  key = accelerator_key(kind)
  if key is None:
    if not (flops and bandwidth):
      raise ValueError(f"no peak figures for device kind {kind!r}: pass its dense bf16 peak "
                       "and memory bandwidth (--peak-tflops, --peak-gb-s)")
    return Peak(kind, flops, bandwidth, "given")
  peak = ACCELERATORS[key]
  if flops or bandwidth:
    peak = dataclasses.replace(peak, flops=flops or peak.flops,
                               bandwidth=bandwidth or peak.bandwidth, source="given")
  return peak


def mfu(flops_per_step: float, step_s: float, peak: Peak) -> float:
  """Model FLOPs utilisation: model FLOPs done per second over the peak."""
  return flops_per_step / step_s / peak.flops


def roofline_fraction(bytes_per_step: float, step_s: float, peak: Peak) -> float:
  """Bytes a step must read per second over the peak bandwidth: 1.0 is the memory roofline."""
  return bytes_per_step / step_s / peak.bandwidth


def bound(flops_per_step: float, bytes_per_step: float, peak: Peak) -> str:
  """Which roof is lower for this step: "compute" when its FLOPs take longer at peak than its
  bytes do, else "memory"."""
  return "compute" if flops_per_step / peak.flops >= bytes_per_step / peak.bandwidth else "memory"
