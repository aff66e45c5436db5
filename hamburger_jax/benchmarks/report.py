"""What a decode bench prints besides its timings: the launch figures of the programs it timed
and its decode settings in words."""

from __future__ import annotations

from hamburger_jax import cli


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


def group_cap(max_group: int | None) -> str:
  return f", groups of at most {max_group} tokens" if max_group else ""
