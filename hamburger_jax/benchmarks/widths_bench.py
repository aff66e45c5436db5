"""infer.bench --mode widths: a base forward of w rows against one of 1 row, in the decoding
layout and the checkpoint's, and the layers' projections alone in other layouts and dtypes."""

from __future__ import annotations

import os

from hamburger_jax.benchmarks import widths
from hamburger_jax import cli
from hamburger_jax.benchmarks.report import launch_lines


WIDTHS = (1, 2, 4, 8, 16)

def bench_widths(args) -> None:
  """A base forward of w rows against one of 1 row (hamburger_jax/benchmarks/widths.py): the
  decode loop's cost and bandwidth per width, then the layers' projections alone in other
  layouts and dtypes."""
  from hamburger_jax import pretrained  # pylint: disable=import-outside-toplevel
  from hamburger_jax.costs import peaks
  from hamburger_jax.model.decode_layout import decode_layout  # pylint: disable=C0415
  base, _ = cli.load_model("base", None, args.base, dtype=args.dtype, param_dtype=args.dtype)
  bw = cli.phase("copy bandwidth", peaks.copy_bandwidth_gb_s)
  layouts = {"fused": decode_layout(base), "separate": base}
  costs = {name: cli.phase(f"w-row forwards, {name} projections", lambda m=m: widths.measure(
      m, args.batches, widths.KV_ENTRIES, args.repeats)) for name, m in layouts.items()}
  bw = max(bw, peaks.copy_bandwidth_gb_s())  # measured again, after the forwards
  print(f"{pretrained.describe('base', None, args.base)}, {args.dtype} weights and compute; "
        f"{peaks.cpu_model()}, {os.cpu_count()} cores; copy bandwidth {bw:.1f} GB/s "
        "(the roofline)")
  print(f"step = a base forward with its LM head and argmax, KV cache of "
        f"{widths.KV_ENTRIES} entries, {widths.STEPS} steps per jitted call, best of "
        f"{args.repeats} interleaved rounds; MB read = weights once + each sequence's KV cache")
  for name, c in costs.items():
    print(f"\n{name} projections (the engine decodes fused: model/decode_layout.py)\n")
    print("\n".join(widths.report(c, bw)))
  best = cli.phase("projection variants", lambda: widths.measure_variants(
      base.cfg, args.batches, args.repeats))
  print("\nthe decoder layers' projections alone (random weights, no attention, norms or "
        "cache), per layout and weight dtype:\n")
  print("\n".join(widths.report_variants(base.cfg, best, bw)))
  print("\n".join(launch_lines(layouts["fused"], 1, widths.KV_ENTRIES,
                               tpu_fusions=not args.no_tpu_fusions)))
