"""Where a program's time goes: device time by operation, from a JAX profiler trace.

A step's MFU says how far it is from the peak, not why. Traced for a few calls, the device's
timelines (a GPU's or TPU's "/device:..." planes; on a CPU the XLA client's threads) give each
operation's time; summed by name they say which fusions, matmuls, sorts or copies hold the step,
which is what an accelerator run must bring back to be improved on a CPU.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re
import time
from typing import Any, Callable

import jax

# Lines of a device plane that repeat another's events (a GPU's "XLA Modules" spans its ops;
# "Steps" and "Framework" ones group them); ops are read from the others.
_SPANS = re.compile(r"XLA Modules|Steps|Framework|Source|TensorFlow|Launch", re.I)
_NAME_CHARS = 72


@dataclasses.dataclass
class OpTime:
  name: str
  calls: int
  seconds: float


@dataclasses.dataclass
class OpProfile:
  """Device seconds by operation over `calls` calls of a traced function."""
  ops: list[OpTime]  # most time first
  device_s: float  # the sum over ops
  wall_s: float  # the traced calls, end to end
  calls: int
  where: str  # the plane read

  def kinds(self) -> list[OpTime]:
    """The ops summed by kind: the name less its module and numeric suffix (every
    `loop_add_fusion.N` is one kind), most time first."""
    by: dict[str, OpTime] = {}
    for op in self.ops:
      kind = re.sub(r"\.\d+$", "", op.name.rsplit("/", 1)[-1])
      k = by.setdefault(kind, OpTime(kind, 0, 0.0))
      k.calls += op.calls
      k.seconds += op.seconds
    return sorted(by.values(), key=lambda o: -o.seconds)

  def lines(self, top: int = 20) -> list[str]:
    """Markdown: the totals, then the `top` kinds and the `top` single operations."""
    out = [f"device time by operation over {self.calls} calls ({self.where}): "
           f"{self.device_s / self.calls * 1e3:,.1f} ms a call of "
           f"{self.wall_s / self.calls * 1e3:,.1f} ms wall"]
    for title, ops in (("kind of operation", self.kinds()), ("operation", self.ops)):
      out += ["", f"| {title} | count a call | ms a call | share |", "|---|---|---|---|",
              *(self._row(f"`{o.name[:_NAME_CHARS]}`", o.calls, o.seconds) for o in ops[:top])]
      if len(ops) > top:
        rest = ops[top:]
        out.append(self._row(f"{len(rest)} others", sum(o.calls for o in rest),
                             sum(o.seconds for o in rest)))
    return out

  def _row(self, name: str, calls: int, seconds: float) -> str:
    return (f"| {name} | {calls / self.calls:g} | {seconds / self.calls * 1e3:,.2f} | "
            f"{seconds / max(self.device_s, 1e-12):.1%} |")


def _has_events(lines: list) -> bool:
  return any(True for line in lines for _ in line.events)


def _planes(profile) -> tuple[str, list, bool]:
  """(what was read, the lines holding operations, whether only events naming their HLO module
  count): a device's "XLA Ops" lines (one event per HLO operation), else its other lines less
  the spans (kernels on streams), else a CPU's XLA client threads (which also wait and lock)."""
  devices = [p for p in profile.planes
             if p.name.startswith("/device:") and not p.name.startswith("/device:CUSTOM")]
  names = ", ".join(sorted({p.name for p in devices}))
  ops = [line for p in devices for line in p.lines if line.name == "XLA Ops"]
  if _has_events(ops):
    return f"{names}, XLA Ops", ops, False
  kernels = [line for p in devices for line in p.lines if not _SPANS.search(line.name or "")]
  if _has_events(kernels):
    return f"{names}, kernels", kernels, False
  host = [p for p in profile.planes if p.name == "/host:CPU"]
  return "/host:CPU, XLA client threads", [line for p in host for line in p.lines
                                            if "XLA" in (line.name or "")], True


def summarize(path: str, calls: int, wall_s: float) -> OpProfile:
  """An OpProfile of the trace file `path` (an .xplane.pb)."""
  from jax.profiler import ProfileData  # pylint: disable=import-outside-toplevel
  where, lines, need_module = _planes(ProfileData.from_file(path))
  seconds: dict[str, float] = collections.defaultdict(float)
  count: dict[str, int] = collections.Counter()
  for line in lines:
    for e in line.events:
      module = dict(e.stats).get("hlo_module")
      if not e.name or (need_module and not module):
        continue
      name = f"{module}/{e.name}" if module else e.name
      seconds[name] += e.duration_ns * 1e-9
      count[name] += 1
  ops = sorted((OpTime(n, count[n], s) for n, s in seconds.items()), key=lambda o: -o.seconds)
  return OpProfile(ops, sum(o.seconds for o in ops), wall_s, calls, where)


def profile_calls(fn: Callable[[], Any], calls: int, trace_dir: str) -> OpProfile:
  """Runs `fn` (which returns arrays to wait for) `calls` times under the profiler, writing the
  trace under `trace_dir`, and summarizes it."""
  os.makedirs(trace_dir, exist_ok=True)
  before = set(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
  with jax.profiler.trace(trace_dir):
    t = time.perf_counter()
    out = None
    for _ in range(calls):
      out = fn()
    jax.block_until_ready(out)
    wall = time.perf_counter() - t
  new = sorted(set(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
               - before, key=os.path.getmtime)
  if not new:
    raise RuntimeError(f"the profiler wrote no trace under {trace_dir}")
  return summarize(new[-1], calls, wall)
