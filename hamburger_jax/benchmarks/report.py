"""What a decode bench prints besides its timings: the launch figures of the programs it timed,
the micro step's cost ratio r where bytes bound a step, where a traced decode spends the
device's time, and its decode settings in words."""

from __future__ import annotations

import dataclasses
from typing import Iterator

from hamburger_jax import cli

PROFILE_KINDS = 8  # kinds of operation a profile lists (profiled_lines)


def launch_lines(runner, batch: int, kv_len: int, model=None, *, tpu_fusions: bool = True
                 ) -> list[str]:
  """The launch figures of a timed decode program (decode/launches.py): lowered dots per step,
  and with libtpu installed (unless not `tpu_fusions`) the fusions on one TPU v5e chip."""
  from hamburger_jax import platforms  # pylint: disable=import-outside-toplevel
  from hamburger_jax.decode import launches  # pylint: disable=import-outside-toplevel
  tpu = platforms.libtpu_installed() and tpu_fusions
  figs = cli.phase("launch figures" + (" (TPU v5e compiles)" if tpu else ""),
                   lambda: launches.figures(runner, batch, kv_len, model, tpu=tpu))
  note = "" if tpu else ", not counted: libtpu is not installed or --no-tpu-fusions"
  return [f"\nlaunches per step (batch {batch}, KV {kv_len}; dots: matmuls in the lowered "
          "program, each a kernel launch on a GPU; fusions: the program compiled for one TPU "
          f"v5e chip{note}):\n", *launches.report_lines(figs)]


def bytes_bound_lines(hcfg, dtype: str, kv_len: int, head_rows: dict[str, int | None]
                      ) -> list[str]:
  """The micro step's cost ratio r where bytes bound a step (every weight read once per pass,
  batch 1, `dtype` weights), per micro-step vocabulary (name -> its LM-head rows; None: the
  whole vocabulary), with the forced-K ceiling it allows: what a measured r compares with."""
  from hamburger_jax.costs import analytic  # pylint: disable=import-outside-toplevel
  hcfg = dataclasses.replace(hcfg, base=dataclasses.replace(hcfg.base, dtype=dtype,
                                                            param_dtype=dtype))
  k = hcfg.graft.max_group
  base = analytic.decode_step_bytes(hcfg, "base", 1, kv_len)
  out = [f"\nr where bytes bound a step (batch 1, KV {kv_len}, {dtype} weights): a base step "
         f"reads {base / 1e6:.0f} MB"]
  for name, rows in head_rows.items():
    micro = analytic.micro_step_bytes(hcfg, 1, rows)
    r = micro / base
    out.append(f"- micro step, {name} micro vocab: {micro / 1e6:.0f} MB, r = {r:.3f}; forced "
               f"groups of {k} at most {k / (1 + (k - 1) * r):.2f}x the base")
  return out


def group_cap(max_group: int | None) -> str:
  return f", groups of at most {max_group} tokens" if max_group else ""


def kind_lines(prof, per: float, unit: str, top: int) -> list[str]:
  """A markdown table of an OpProfile's kinds of operation (benchmarks/op_profile.py), the
  `top` most costly then the rest, in counts and ms `unit` (the profile over `per` of them)."""
  share = lambda seconds: f"{seconds / max(prof.device_s, 1e-12):.1%}"
  out = [f"| kind of operation | count {unit} | ms {unit} | share |", "|---|---|---|---|"]
  kinds = prof.kinds()
  for op in kinds[:top]:
    out.append(f"| `{op.name[:72]}` | {op.calls / per:.1f} | {op.seconds * 1e3 / per:,.3f} | "
               f"{share(op.seconds)} |")
  rest = kinds[top:]
  if rest:
    seconds = sum(o.seconds for o in rest)
    out.append(f"| {len(rest)} other kinds | {sum(o.calls for o in rest) / per:.1f} | "
               f"{seconds * 1e3 / per:,.3f} | {share(seconds)} |")
  return out


def profiled_lines(runs, ids: list, n_new: int, note: str = "",
                   top: int = PROFILE_KINDS) -> Iterator[str]:
  """Where one decode of the batch `ids` spends the device's time, for each (name, engine,
  generate kwargs) of `runs`: a line of its macro steps (k, micro steps a step, device and
  wall ms a macro step; `note` follows the name), then its `top` kinds of operation
  (kind_lines), each decode traced once (timing.profile_decode). Each run's lines come as soon
  as it is read: a caller stopped at its time cap keeps the runs before."""
  import tempfile  # pylint: disable=import-outside-toplevel
  from hamburger_jax.benchmarks import timing  # pylint: disable=import-outside-toplevel
  for name, engine, kw in runs:
    with tempfile.TemporaryDirectory() as trace_dir:
      prof, steps, gens = timing.profile_decode(engine, ids, n_new, trace_dir, **kw)
    k = sum(g.new_tokens for g in gens) / sum(g.macro_steps for g in gens)
    yield from ["", f"- batch {len(ids)}, {name}{note}: {steps} macro steps (k {k:.2f}, micro "
                f"steps/step {timing.micro_steps_per_step(gens):.2f}); device "
                f"{prof.device_s * 1e3 / steps:,.2f} ms a macro step of "
                f"{prof.wall_s * 1e3 / steps:,.2f} ms wall, prefills included ({prof.where})",
                "", *kind_lines(prof, steps, "a macro step", top)]
