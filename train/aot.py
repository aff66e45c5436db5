"""Check a pod config without a pod: compile a training run's programs for a TPU slice on this
machine (no TPU, no weights, no data) and print what each needs per chip.

  python -m train.aot --config configs/smollm2_135m_tpu_v5e.yaml --topology v5e:4x4
  python -m train.aot --config configs/llama3_2_1b_tpu_v5p.yaml --topology v5p:2x2x4
  python -m train.aot --config configs/llama3_2_1b_h100.yaml --topology v5p:2x2x1 --chips 1 \\
      --hbm-gib 74.5                      # a one-GPU config checked on one chip, by proxy

Compiles, with the TPU compiler (libtpu: pip install "jax[tpu]"), every stage's train step
(gradient accumulation as configured) and evaluation step on the config's mesh over the slice,
and the teacher pass of train.prepare_data. Prints per chip: trained params, optimizer state,
frozen weights, batch, temporaries and the total against the chip's HBM, FLOPs per step, fusions
and the collectives in the compiled program. Exit 1, with one line per program, when a program
does not fit in the HBM less --headroom. `--lower-only`: the programs lowered with the run's
shardings (mesh, shapes and shardings checked) and the sharded state per chip, in seconds, not
compiled.
"""

from __future__ import annotations

import argparse
import sys

from hamburger_jax import aot, platforms


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m train.aot", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", required=True, help="YAML run config (see configs/)")
  p.add_argument("--topology", required=True,
                 help="TPU slice: GENERATION:AxB[xC], generation one of "
                 f"{', '.join(aot.GENERATIONS)} (e.g. v5e:4x4, v5p:2x2x4)")
  p.add_argument("--stage", default=None, help="one stage of a staged config (default: all)")
  p.add_argument("--num-slices", type=int, default=1, help="slices joined over the network "
                 "(multi-slice: the data axis spans them)")
  p.add_argument("--chips", type=int, default=None,
                 help="use the slice's first N devices only (e.g. 1: a one-device config)")
  p.add_argument("--hbm-gib", type=float, default=None,
                 help="memory per device to fit in, GiB (default: the TPU chip's HBM); e.g. "
                 "74.5 for an 80 GB GPU checked by proxy")
  p.add_argument("--headroom", type=float, default=aot.DEFAULT_HEADROOM,
                 help="fraction of the memory kept free (default %(default)s)")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="override a config value (repeatable)")
  p.add_argument("--teacher-top-k", type=int, default=None,
                 help="the teacher pass's top-k (default: 16 for a distill config, else 0)")
  p.add_argument("--max-len", type=int, default=None,
                 help="the teacher pass's train.prepare_data --max-len")
  p.add_argument("--batch-tokens", type=int, default=None,
                 help="the teacher pass's train.prepare_data --batch-tokens")
  p.add_argument("--no-teacher-pass", action="store_true", help="skip the teacher pass")
  p.add_argument("--lower-only", action="store_true",
                 help="lower the programs and report the sharded state per chip; no compile")
  p.add_argument("--no-sparse-core", action="store_true",
                 help="keep the compile off a v5p's SparseCores (libtpu's SparseCore code "
                 "generator crashes on some programs; for a GPU checked by proxy)")
  args = p.parse_args(argv)
  if not 0 <= args.headroom < 1:
    p.error(f"--headroom {args.headroom} must be in [0, 1)")
  for flag in ("num_slices", "chips", "max_len", "batch_tokens"):
    v = getattr(args, flag)
    if v is not None and v < 1:
      p.error(f"--{flag.replace('_', '-')} {v} must be >= 1")
  if args.hbm_gib is not None and not args.hbm_gib > 0:
    p.error(f"--hbm-gib {args.hbm_gib} must be > 0")
  platforms.use_cpu_backend()  # before jax starts a backend
  if args.no_sparse_core:
    platforms.no_sparse_core()

  from hamburger_jax.config import ConfigError  # pylint: disable=import-outside-toplevel
  from hamburger_jax.data import teacher_pass  # pylint: disable=import-outside-toplevel
  from hamburger_jax.training import aot as train_aot  # pylint: disable=import-outside-toplevel
  lowering = dict(
      overrides=args.set, stage=args.stage, num_slices=args.num_slices, chips=args.chips,
      hbm_gib=args.hbm_gib, teacher_top_k=args.teacher_top_k,
      max_len=args.max_len or teacher_pass.DEFAULT_MAX_LEN,
      batch_tokens=args.batch_tokens or teacher_pass.DEFAULT_BATCH_TOKENS,
      teacher_pass=not args.no_teacher_pass,
      progress=lambda what: print(f"{what} ...", file=sys.stderr, flush=True))
  try:
    if args.lower_only:
      print("\n".join(train_aot.lowering_lines(
          train_aot.lower_train(args.config, args.topology, **lowering))))
      return 0
    check = train_aot.check_train(args.config, args.topology, headroom=args.headroom,
                                  **lowering)
  except (ConfigError, aot.AotError, RuntimeError) as e:  # RuntimeError: an asset not installed
    raise SystemExit(f"error: {e}") from None
  print("\n".join(train_aot.report_lines(check)))
  errors = check.errors()
  for line in errors:
    print(f"error: {line}", file=sys.stderr)
  return 1 if errors else 0


if __name__ == "__main__":
  sys.exit(main())
